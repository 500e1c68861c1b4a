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

{{/* Settings in `config` that the chart sets itself, by environment (which wins over the file) or
by the container's flags and ports: refused, so none is ignored silently. */}}
{{- define "specgate.checkConfig" -}}
{{- $c := .Values.config | default dict -}}
{{- $limits := $c.limits | default dict -}}
{{- $server := $c.server | default dict -}}
{{- $cache := $c.cache | default dict -}}
{{- if hasKey $limits "drain_timeout_s" -}}
{{- fail "config.limits.drain_timeout_s: set drainTimeoutSeconds instead (the chart passes it as SPECGATE_LIMITS__DRAIN_TIMEOUT_S, which overrides the file, and checks the grace period against it)" -}}
{{- end -}}
{{- range $key := list "host" "port" -}}
{{- if hasKey $server $key -}}
{{- fail (printf "config.server.%s: the container listens on 0.0.0.0:8000 (the entrypoint's --host, the probes' and Service's port); leave it out" $key) -}}
{{- end -}}
{{- end -}}
{{- if hasKey ($c.auth | default dict) "api_keys" -}}
{{- fail "config.auth.api_keys: keys do not belong in a ConfigMap; put them in a Secret and name it in apiKeys.existingSecret" -}}
{{- end -}}
{{- if and (hasKey $cache "redis_url") (or $.Values.redis.url $.Values.redis.existingSecret) -}}
{{- fail "config.cache.redis_url and redis.url/redis.existingSecret both set: the chart's SPECGATE_CACHE__REDIS_URL would override the file; set one" -}}
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
