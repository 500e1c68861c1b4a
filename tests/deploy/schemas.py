"""Offline schema checks for the deployment manifests: Kubernetes objects and the compose file.

Where each schema comes from (nothing is downloaded at test time):

- Built-in Kubernetes kinds: the *strict* JSON schemas (unknown fields rejected) that the
  ``kubernetes-validate`` package ships, generated from the Kubernetes OpenAPI for each minor version.
- ``ServiceMonitor`` (prometheus-operator) and ``ScaledObject`` (KEDA) are CRDs with no schema there:
  the ``cloudcoil-models-*`` packages ship pydantic models generated from those projects' CRDs; their
  JSON schema, with ``additionalProperties: false`` added to every object that lists its properties,
  stands in for the CRD's structural schema (the API server also prunes unknown fields).
- The compose specification's JSON schema as vendored (with its sha256 and licence) by
  ``check-jsonschema``.

Each package is a dev dependency; a test that needs a missing one is skipped with the package named.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

import jsonschema
import pytest

# The oldest Kubernetes the chart declares (Chart.yaml kubeVersion) and the newest with schemas here.
OLDEST_KUBERNETES = "1.25.0"


def _need(module: str, package: str) -> Any:
    return pytest.importorskip(module, reason=f"dev dependency {package} is not installed")


def kubernetes_versions() -> list[str]:
    kv = _need("kubernetes_validate", "kubernetes-validate")
    return [OLDEST_KUBERNETES, kv.latest_version()]


def _strict(node: Any) -> Any:
    if isinstance(node, dict):
        if "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for v in node.values():
            _strict(v)
    elif isinstance(node, list):
        for v in node:
            _strict(v)
    return node


@functools.cache
def _crd_validator(api_version: str, kind: str) -> jsonschema.Draft202012Validator:
    if (api_version, kind) == ("monitoring.coreos.com/v1", "ServiceMonitor"):
        model = _need(
            "cloudcoil.models.prometheus_operator.v1", "cloudcoil[prometheus-operator]"
        ).ServiceMonitor
    elif (api_version, kind) == ("keda.sh/v1alpha1", "ScaledObject"):
        model = _need("cloudcoil.models.keda.v1alpha1", "cloudcoil[keda]").ScaledObject
    else:
        raise AssertionError(f"no schema for custom resource {api_version} {kind}: add one to {__name__}")
    return jsonschema.Draft202012Validator(_strict(model.model_json_schema(by_alias=True, mode="validation")))


def kubernetes_errors(doc: dict[str, Any]) -> list[str]:
    """Every schema violation of one manifest, for each Kubernetes version we support."""
    api_version, kind = doc.get("apiVersion", ""), doc.get("kind", "")
    where = f"{kind} {doc.get('metadata', {}).get('name')}"
    group = api_version.split("/")[0] if "/" in api_version else ""
    if "." in group and not group.endswith(".k8s.io"):  # a group outside Kubernetes: a custom resource
        return [
            f"{where}: {e.json_path}: {e.message}" for e in _crd_validator(api_version, kind).iter_errors(doc)
        ]
    kv = _need("kubernetes_validate", "kubernetes-validate")
    errors = []
    for version in kubernetes_versions():
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as exc:
            errors.append(f"{where} (Kubernetes {version}): {exc.message} at {list(exc.path)}")
    return errors


def compose_validator() -> jsonschema.protocols.Validator:
    _need("check_jsonschema", "check-jsonschema")
    text = (resources.files("check_jsonschema") / "builtin_schemas/vendor/compose-spec.json").read_text()
    schema = json.loads(text)
    return jsonschema.validators.validator_for(schema)(schema)
