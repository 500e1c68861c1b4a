{{/* Names and labels, as `helm create` writes them. */}}
{{- define "specgate.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "specgate.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "specgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "specgate.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "specgate.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "specgate.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "specgate.pvcName" -}}
{{- .Values.modelStore.persistence.existingClaim | default (printf "%s-models" (include "specgate.fullname" .)) -}}
{{- end -}}

{{/* Refuse values that would cut the SIGTERM drain short. */}}
{{- define "specgate.checkGrace" -}}
{{- $needed := add .Values.preStopSleepSeconds .Values.drainTimeoutSeconds -}}
{{- if le (int .Values.terminationGracePeriodSeconds) (int $needed) -}}
{{- fail (printf "terminationGracePeriodSeconds (%v) must exceed preStopSleepSeconds + drainTimeoutSeconds (%v), or the kubelet kills draining requests" .Values.terminationGracePeriodSeconds $needed) -}}
{{- end -}}
{{- end -}}

{{/* settings.models as JSON: the target with its draft, and the draft served on its own too. */}}
{{- define "specgate.models" -}}
{{- $m := .Values.model -}}
{{- if $m.draft -}}
{{- list (dict "name" $m.name "source" $m.name "draft" $m.draft) (dict "name" $m.draft "source" $m.draft) | toJson -}}
{{- else -}}
{{- list (dict "name" $m.name "source" $m.name) | toJson -}}
{{- end -}}
{{- end -}}
