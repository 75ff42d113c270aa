"""A minimal ``kustomize build`` for deploy/k8s, used only where no ``kubectl`` is installed.

It supports exactly what deploy/k8s/kustomization.yaml uses: ``namespace``, file ``resources``,
and ``configMapGenerator``/``secretGenerator`` with ``literals``/``envs`` and
``options.disableNameSuffixHash``, including kustomize's content-hash name suffix and the
rewriting of references to generated names. Anything else raises ``NotImplementedError``, so a
richer kustomization fails loudly instead of rendering wrong. When kubectl is present,
tests/deploy/test_k8s.py checks that this renders exactly what ``kubectl kustomize`` does.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

SUPPORTED_KEYS = {"apiVersion", "kind", "namespace", "resources", "configMapGenerator", "secretGenerator"}
GENERATOR_KEYS = {"name", "literals", "envs", "options"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass"}


def _parse_env_line(line: str, where: str) -> tuple[str, str] | None:
    line = line.strip()
    if not line or line.startswith("#"):
        return None
    if "=" not in line:
        raise ValueError(f"{where}: expected KEY=VALUE, got {line!r}")
    key, value = line.split("=", 1)
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        value = value[1:-1]
    return key, value


def _go_json(obj: Any) -> str:
    """JSON as Go's encoding/json writes it: sorted keys, no spaces, HTML characters escaped."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for char, escape in (("&", "\\u0026"), ("<", "\\u003c"), (">", "\\u003e"), ("\u2028", "\\u2028")):
        text = text.replace(char, escape)
    return text.replace("\u2029", "\\u2029")


def name_suffix(resource: dict[str, Any]) -> str:
    """kustomize's 10-character content hash of a generated ConfigMap or Secret.

    sha256 of the JSON of kind, name, data (and type for a Secret), first 10 hex digits with
    0, 1, 3, a, e swapped for g, h, k, m, t. kustomize v5 looks the name up under a path that
    never matches, so it hashes an empty name; so does this.
    """
    encoded: dict[str, Any] = {"kind": resource["kind"], "name": "", "data": resource["data"]}
    if resource["kind"] == "Secret":
        encoded["type"] = resource["type"]
    digest = hashlib.sha256(_go_json(encoded).encode()).hexdigest()
    swap = {"0": "g", "1": "h", "3": "k", "a": "m", "e": "t"}
    return "".join(swap.get(c, c) for c in digest[:10])


def _generate(kind: str, spec: dict[str, Any], base: Path) -> tuple[dict[str, Any], bool]:
    unknown = set(spec) - GENERATOR_KEYS
    if unknown or set(spec.get("options", {})) - {"disableNameSuffixHash"}:
        raise NotImplementedError(f"kustomize_lite: unsupported {kind} generator fields in {spec}")
    data: dict[str, str] = {}
    for literal in spec.get("literals", []):
        parsed = _parse_env_line(literal, f"{spec['name']} literal")
        if parsed:
            data[parsed[0]] = parsed[1]
    for env_file in spec.get("envs", []):
        for line in (base / env_file).read_text().splitlines():
            parsed = _parse_env_line(line, str(base / env_file))
            if parsed:
                data[parsed[0]] = parsed[1]
    data = dict(sorted(data.items()))
    resource: dict[str, Any] = {"apiVersion": "v1", "kind": kind, "metadata": {"name": spec["name"]}}
    if kind == "Secret":
        resource["data"] = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
        resource["type"] = "Opaque"
    else:
        resource["data"] = data
    hashed = not spec.get("options", {}).get("disableNameSuffixHash", False)
    return resource, hashed


def _rename_refs(node: Any, renames: dict[tuple[str, str], str]) -> None:
    """Point envFrom, env valueFrom and volume references at the generated names."""
    if isinstance(node, list):
        for item in node:
            _rename_refs(item, renames)
        return
    if not isinstance(node, dict):
        return
    for key, kind, field in (
        ("configMapRef", "ConfigMap", "name"),
        ("configMapKeyRef", "ConfigMap", "name"),
        ("secretRef", "Secret", "name"),
        ("secretKeyRef", "Secret", "name"),
        ("configMap", "ConfigMap", "name"),
        ("secret", "Secret", "secretName"),
    ):
        ref = node.get(key)
        if isinstance(ref, dict) and (kind, ref.get(field)) in renames:
            ref[field] = renames[(kind, ref[field])]
    for value in node.values():
        _rename_refs(value, renames)


def build(directory: str | Path) -> list[dict[str, Any]]:
    """Render ``directory``/kustomization.yaml into a list of resources (kustomize's order aside)."""
    base = Path(directory)
    kustomization = yaml.safe_load((base / "kustomization.yaml").read_text())
    unknown = set(kustomization) - SUPPORTED_KEYS
    if unknown:
        raise NotImplementedError(f"kustomize_lite: unsupported kustomization fields {sorted(unknown)}")
    resources: list[dict[str, Any]] = []
    for name in kustomization.get("resources", []):
        path = base / name
        if not path.is_file():
            raise NotImplementedError(f"kustomize_lite: only file resources are supported, not {name}")
        resources.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
    renames: dict[tuple[str, str], str] = {}
    for kind, key in (("ConfigMap", "configMapGenerator"), ("Secret", "secretGenerator")):
        for spec in kustomization.get(key, []):
            resource, hashed = _generate(kind, spec, base)
            if hashed:
                generated = f"{spec['name']}-{name_suffix(resource)}"
                renames[(kind, spec["name"])] = generated
                resource["metadata"]["name"] = generated
            resources.append(resource)
    namespace = kustomization.get("namespace")
    for resource in resources:
        if namespace and resource["kind"] not in CLUSTER_SCOPED:
            resource["metadata"]["namespace"] = namespace
        _rename_refs(resource.get("spec"), renames)
    return resources
