"""Offline helpers for tests/infra: load manifests, build kustomize overlays, validate against schemas.

``build`` covers the subset of kustomize that infra/k8s uses (resources, namespace, images, patches with a
kind + label-selector target and a strategic-merge patch); where ``kubectl`` is installed the tests also
compare it with ``kubectl kustomize``.
"""
from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
K8S = INFRA / "k8s"
SCHEMAS = INFRA / "schemas"
K8S_VERSION = "1.33.0"
CLUSTER_SCOPED = {"Namespace"}


def load_all(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _merge_lists(base: list[Any], patch: list[Any]) -> list[Any]:
    # strategic merge: lists of named objects (containers, env, ports) merge item by item on "name"
    if not all(isinstance(x, dict) and "name" in x for x in base + patch):
        return copy.deepcopy(patch)
    out = copy.deepcopy(base)
    for item in patch:
        match = next((x for x in out if x["name"] == item["name"]), None)
        if match is None:
            out.append(copy.deepcopy(item))
        else:
            match.update(merge(match, item))
    return out


def merge(base: Any, patch: Any) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            out[key] = merge(out[key], value) if key in out else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list):
        return _merge_lists(base, patch)
    return copy.deepcopy(patch)


def _selected(obj: dict[str, Any], target: dict[str, str]) -> bool:
    if target.get("kind") not in (None, obj["kind"]) or target.get("name") not in (None, obj["metadata"]["name"]):
        return False
    obj_labels = obj["metadata"].get("labels", {})
    pairs = [p.split("=", 1) for p in target.get("labelSelector", "").split(",") if p]
    return all(obj_labels.get(k) == v for k, v in pairs)


def _set_images(obj: dict[str, Any], images: list[dict[str, str]]) -> None:
    for container in obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
        name = container["image"].rsplit(":", 1)[0]
        for image in images:
            if image["name"] == name and "newTag" in image:
                container["image"] = f"{name}:{image['newTag']}"


def build(folder: Path) -> list[dict[str, Any]]:
    """The objects ``kustomize build folder`` emits (for the features infra/k8s uses)."""
    kust = load_all(folder / "kustomization.yaml")[0]
    objects: list[dict[str, Any]] = []
    for res in kust.get("resources", []):
        path = (folder / res).resolve()
        objects += build(path) if path.is_dir() else load_all(path)
    for patch in kust.get("patches", []):
        body = yaml.safe_load(patch["patch"])
        body.pop("metadata", None)  # the target selects the objects; the patch's own name is a placeholder
        body.pop("apiVersion", None), body.pop("kind", None)
        objects = [merge(o, body) if _selected(o, patch["target"]) else o for o in objects]
    for obj in objects:
        _set_images(obj, kust.get("images", []))
        if "namespace" in kust and obj["kind"] not in CLUSTER_SCOPED:
            obj["metadata"]["namespace"] = kust["namespace"]
    return objects


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def _closed(schema: Any) -> Any:
    """An openAPIV3Schema with unknown fields refused (kubectl's strict field validation does the same)."""
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out \
                and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_closed(x) for x in schema]
    return schema


@functools.cache
def crd_schema(file_name: str, version: str) -> dict[str, Any]:
    crd = load_all(SCHEMAS / file_name)[0]
    served = next(v for v in crd["spec"]["versions"] if v["name"] == version)
    return _closed(served["schema"]["openAPIV3Schema"])


KEDA_CRDS = {"ScaledObject": "keda.sh_scaledobjects.yaml",
             "TriggerAuthentication": "keda.sh_triggerauthentications.yaml"}


def validate(obj: dict[str, Any]) -> None:
    """Raise if ``obj`` does not match its schema: KEDA's vendored CRDs, else Kubernetes' bundled ones."""
    if obj["kind"] in KEDA_CRDS:
        group, version = obj["apiVersion"].split("/")
        assert group == "keda.sh", obj["apiVersion"]
        jsonschema.validate(obj, crd_schema(KEDA_CRDS[obj["kind"]], version))
        return
    import kubernetes_validate

    kubernetes_validate.validate(json.loads(json.dumps(obj)), K8S_VERSION, strict=True)
