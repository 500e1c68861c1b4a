"""The Helm chart renders with Helm, every manifest passes the Kubernetes schemas, and the values do what
values.yaml says. Nothing here talks to a cluster; none was available (see docs/scaling.md)."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from tests.deploy.chart import CHART, NAMESPACE, ROOT, env, gateway_container, helm, one, render
from tests.deploy.schemas import kubernetes_errors

# Value sets that between them switch every template and branch on.
SCENARIOS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "gpu-hpa-monitoring-secrets": {
        "image": {"repository": "registry.example/specgate-gpu", "tag": "0.1.0-cuda"},
        "gpu": {"enabled": True, "count": 2},
        "autoscaling": {"enabled": True, "kind": "hpa", "maxReplicas": 8},
        "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "apiKeys": {"existingSecret": "specgate-keys"},
        "upstreamSecret": "specgate-upstream-keys",
        "redis": {"existingSecret": "specgate-redis"},
        "otel": {"endpoint": "http://otel-collector.observability:4318"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "extraEnv": [{"name": "SPECGATE_OBSERVABILITY__LOG_JSON", "value": "true"}],
    },
    "keda-config-no-persistence": {
        "replicaCount": 3,
        "autoscaling": {"enabled": True, "kind": "keda"},
        "redis": {"url": "redis://redis.llm.svc:6379/0"},
        "modelStore": {"persistence": {"enabled": False}},
        "config": {
            "upstreams": [
                {"name": "vllm", "base_url": "http://vllm:8000/v1", "model": "big", "api_key_env": "VLLM_KEY"}
            ]
        },
        "podDisruptionBudget": {"enabled": False},
    },
    "existing-claim": {
        "modelStore": {"persistence": {"existingClaim": "shared-models", "accessModes": ["ReadWriteMany"]}}
    },
}


@pytest.fixture(scope="module", params=list(SCENARIOS))
def scenario(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(SCENARIOS[request.param])


def test_helm_lint_is_clean() -> None:
    result = helm().lint(str(CHART))
    assert result["errors"] == []
    # severity 1 is "info" (e.g. "icon is recommended"); anything above is a real finding
    assert [m for m in result["messages"] if m["severity"] > 1] == []


def test_every_manifest_passes_the_kubernetes_schemas(scenario: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = scenario
    assert docs, f"{name}: nothing rendered"
    errors = [e for d in docs for e in kubernetes_errors(d)]
    assert errors == [], f"{name}:\n" + "\n".join(errors)


MISTAKES: dict[str, tuple[str, Callable[[dict[str, Any]], Any]]] = {
    # (kind to mutate, mutation): each is a plausible slip the schema check must catch
    "unknown container field": (
        "Deployment",
        lambda d: d["spec"]["template"]["spec"]["containers"][0].update(livenessprobe={}),
    ),
    "probe port of the wrong type": (
        "Deployment",
        lambda d: d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"].update(
            port=[8000]
        ),
    ),
    "Service without ports' port": ("Service", lambda d: d["spec"]["ports"][0].pop("port")),
    "HPA v1 field in v2": (
        "HorizontalPodAutoscaler",
        lambda d: d["spec"].update(targetCPUUtilizationPercentage=80),
    ),
    "ServiceMonitor typo": ("ServiceMonitor", lambda d: d["spec"]["endpoints"][0].update(intervall="15s")),
    "ScaledObject without triggers": ("ScaledObject", lambda d: d["spec"].pop("triggers")),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_the_schema_check_catches_mistakes(mistake: str) -> None:
    kind, mutate = MISTAKES[mistake]
    docs = render(SCENARIOS["gpu-hpa-monitoring-secrets"]) + render(SCENARIOS["keda-config-no-persistence"])
    doc = copy.deepcopy(next(d for d in docs if d["kind"] == kind))
    assert kubernetes_errors(doc) == []
    mutate(doc)
    assert kubernetes_errors(doc), f"{mistake} went unnoticed"


def test_names_and_labels_are_valid(scenario: tuple[str, list[dict[str, Any]]]) -> None:
    dns_label = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
    for d in scenario[1]:
        assert dns_label.match(d["metadata"]["name"]), d["metadata"]["name"]
        assert "namespace" not in d["metadata"], "helm sets the namespace; templates must not"


def test_defaults_render_the_minimal_release() -> None:
    docs = render()
    assert sorted(d["kind"] for d in docs) == [
        "Deployment",
        "PersistentVolumeClaim",
        "PodDisruptionBudget",
        "Service",
    ]
    deploy = one(docs, "Deployment")
    assert deploy["spec"]["replicas"] == 1
    pod = deploy["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert (
        pod["volumes"][0]["persistentVolumeClaim"]["claimName"]
        == one(docs, "PersistentVolumeClaim")["metadata"]["name"]
    )
    e = env(gateway_container(docs))
    assert (
        "SPECGATE_API_KEYS" not in e
        and "SPECGATE_CACHE__REDIS_URL" not in e
        and "OTEL_EXPORTER_OTLP_ENDPOINT" not in e
    )


def test_probes_use_health_for_liveness_and_ready_for_readiness() -> None:
    c = gateway_container(render())
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert c["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}


def test_grace_period_covers_prestop_and_drain() -> None:
    docs = render({"drainTimeoutSeconds": 60, "preStopSleepSeconds": 10, "terminationGracePeriodSeconds": 90})
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    c = gateway_container(docs)
    assert env(c)["SPECGATE_LIMITS__DRAIN_TIMEOUT_S"] == "60"
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "10"]
    assert pod["terminationGracePeriodSeconds"] == 90


@pytest.mark.parametrize("grace", [35, 30, 10])
def test_a_grace_period_that_cuts_the_drain_short_is_refused(grace: int) -> None:
    with pytest.raises(Exception, match="terminationGracePeriodSeconds"):
        render({"drainTimeoutSeconds": 30, "preStopSleepSeconds": 5, "terminationGracePeriodSeconds": grace})


def test_models_are_pulled_by_the_init_container_with_the_cli() -> None:
    docs = render({"model": {"pull": ["qwen2.5-coder-0.5b"]}})
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["command"] == ["specgate", "models", "pull", "qwen2.5-coder-0.5b"]
    assert init["volumeMounts"] == gateway_container(docs)["volumeMounts"][:1]
    # the entrypoint's own pull would be a second, redundant check of the volume
    assert env(gateway_container(docs))["SPECGATE_SKIP_PULL"] == "1"


def test_hpa_scales_on_the_gateway_queue_depth_gauge() -> None:
    docs = render({"autoscaling": {"enabled": True}})
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "specgate",
    }
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    name = metric["pods"]["metric"]["name"]
    # the gauge must be one the gateway really exports, not a name that drifted
    assert f'"{name}"' in (ROOT / "gateway" / "observability" / "metrics.py").read_text()
    assert "replicas" not in one(docs, "Deployment")["spec"], "the HPA owns the replica count"


def test_keda_option_replaces_the_hpa() -> None:
    docs = render({"autoscaling": {"enabled": True, "kind": "keda"}})
    assert not [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    so = one(docs, "ScaledObject")
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert (
        trigger["metadata"]["query"]
        == f'sum(specgate_engine_queue_depth{{namespace="{NAMESPACE}", pod=~"specgate-.*"}})'
    )
    assert so["spec"]["scaleTargetRef"]["name"] == one(docs, "Deployment")["metadata"]["name"]


def test_gpu_values_request_gpus_and_keep_memory_limits() -> None:
    c = gateway_container(render({"gpu": {"enabled": True, "count": 2}}))
    assert c["resources"]["limits"] == {"memory": "12Gi", "nvidia.com/gpu": "2"}
    assert "nvidia.com/gpu" not in gateway_container(render())["resources"]["limits"]


def test_secrets_are_referenced_never_inlined() -> None:
    docs = render(SCENARIOS["gpu-hpa-monitoring-secrets"])
    c = gateway_container(docs)
    e = env(c)
    assert e["SPECGATE_API_KEYS"] == {"secretKeyRef": {"name": "specgate-keys", "key": "api-keys"}}
    assert e["SPECGATE_CACHE__REDIS_URL"] == {"secretKeyRef": {"name": "specgate-redis", "key": "redis-url"}}
    assert c["envFrom"] == [{"secretRef": {"name": "specgate-upstream-keys"}}]
    assert not [d for d in docs if d["kind"] == "Secret"]


def test_otel_endpoint_sets_the_standard_variables() -> None:
    e = env(gateway_container(render({"otel": {"endpoint": "http://collector:4318"}})))
    assert e["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://collector:4318"
    assert e["OTEL_TRACES_EXPORTER"] == "otlp"
    assert e["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/protobuf"


def test_service_monitor_is_off_by_default_and_scrapes_metrics_when_on() -> None:
    assert not [d for d in render() if d["kind"] == "ServiceMonitor"]
    docs = render({"serviceMonitor": {"enabled": True}})
    (endpoint,) = one(docs, "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["port"] == one(docs, "Service")["spec"]["ports"][0]["name"]
    assert endpoint["path"] == "/metrics"


def test_config_values_become_the_config_file() -> None:
    config = SCENARIOS["keda-config-no-persistence"]["config"]
    docs = render({"config": config})
    assert yaml.safe_load(one(docs, "ConfigMap")["data"]["specgate.yaml"]) == config
    c = gateway_container(docs)
    assert c["args"] == ["--config", "/etc/specgate/specgate.yaml"]
    assert {"name": "config", "mountPath": "/etc/specgate", "readOnly": True} in c["volumeMounts"]


def test_existing_claim_is_used_and_no_claim_is_created() -> None:
    docs = render(SCENARIOS["existing-claim"])
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    vol = one(docs, "Deployment")["spec"]["template"]["spec"]["volumes"][0]
    assert vol["persistentVolumeClaim"]["claimName"] == "shared-models"


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"gpuu": {"enabled": True}}, "'gpuu' not allowed"),
        ({"autoscaling": {"kind": "kedaa"}}, "must be one of 'hpa', 'keda'"),
        ({"redis": {"url": "http://redis:6379"}}, "does not match pattern"),
        ({"otel": {"protocol": "grpc"}}, "/otel/protocol"),  # only the OTLP/HTTP exporter is installed
    ],
)
def test_values_schema_refuses_typos_and_impossible_values(values: dict[str, Any], complaint: str) -> None:
    with pytest.raises(Exception, match=re.escape(complaint)):
        render(values)


@pytest.mark.parametrize(
    ("config", "values", "complaint"),
    [
        # the chart's SPECGATE_LIMITS__DRAIN_TIMEOUT_S overrides the file: 120 would have been 30,
        # and the grace-period check would have passed against 30
        ({"limits": {"drain_timeout_s": 120}}, {}, "drainTimeoutSeconds"),
        # the entrypoint's --host and the probes' and Service's port 8000 are the pod's
        ({"server": {"port": 9000}}, {}, "server.port"),
        ({"server": {"host": "127.0.0.1"}}, {}, "server.host"),
        ({"cache": {"redis_url": "redis://a:6379/0"}}, {"redis": {"url": "redis://b:6379/0"}}, "redis.url"),
        ({"auth": {"api_keys": ["sk-in-a-configmap"]}}, {}, "apiKeys.existingSecret"),  # never inlined
    ],
)
def test_config_the_chart_would_override_is_refused(
    config: dict[str, Any], values: dict[str, Any], complaint: str
) -> None:
    with pytest.raises(Exception, match=re.escape(complaint)):
        render({"config": config, **values})


def test_config_the_chart_leaves_alone_renders() -> None:
    c = gateway_container(
        render({"config": {"cache": {"redis_url": "redis://a:6379/0"}, "limits": {"rpm": 5}}})
    )
    assert "SPECGATE_CACHE__REDIS_URL" not in env(c)


def _notes(values: dict[str, Any]) -> str:
    with helm().Chart.load(str(CHART)) as chart:
        files = chart.render(values, name="specgate", namespace=NAMESPACE)
    return next(text for path, text in files.items() if path.endswith("NOTES.txt"))


def test_notes_warn_of_replicas_without_a_shared_redis_only_when_there_is_none() -> None:
    warning = "keep their own cache"
    assert warning in _notes({"replicaCount": 2})
    assert warning in _notes({"autoscaling": {"enabled": True}})  # the autoscaler adds replicas
    assert warning not in _notes({"replicaCount": 2, "redis": {"url": "redis://r:6379/0"}})
    assert warning not in _notes({"replicaCount": 2, "config": {"cache": {"redis_url": "redis://r:6379/0"}}})
    assert warning not in _notes({})
