"""A small pure-Python kustomize for the manifests under ops/deploy/ (test helper, not a test).

`render(directory)` builds a kustomization the way `kubectl kustomize` does, for the
subset of kustomize those manifests use, and refuses anything else (`Unsupported`), so
a manifest that starts to rely on another feature fails loudly instead of rendering wrong:

- `resources` (files or directories), `components` (`kind: Component` directories),
  applied in kustomize's order: resources, then components, then this level's
  generators and transformers;
- `secretGenerator` / `configMapGenerator` with `behavior: merge` into a resource of the
  same name (values are placeholders: the files they name are kept out of git);
- `patches` from a file or an inline string, each document a strategic-merge patch that
  names its target by kind and `metadata.name`; `$patch: delete` removes the target;
- `images` (newName / newTag) and `namespace`.

Strategic merge follows Kubernetes' schema for the built-in kinds used here: maps merge
recursively, `null` deletes a field, lists of named things merge by their key
(`containers` by name, container `ports` by containerPort, Service `ports` by port,
`volumeMounts` by mountPath, ...; the patch's items first, then the others, the order
kustomize gives), every other list is replaced. Custom resources have
no schema in kustomize, so their lists are always replaced whole, as kustomize does.
`tests/ops/test_deploy_manifests.py` checks this renderer against `kubectl kustomize`
where a kubectl binary exists.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

__all__ = ["render", "Unsupported", "Resource", "BUILTIN_API_VERSIONS", "strategic_merge"]

Resource = dict[str, Any]

BUILTIN_API_VERSIONS = frozenset({"v1", "apps/v1", "policy/v1", "autoscaling/v2", "networking.k8s.io/v1"})
# list field -> merge key (Kubernetes' patchMergeKey) for the built-in kinds
_MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
               "volumeMounts": "mountPath", "imagePullSecrets": "name"}
_KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "components", "patches", "images", "namespace",
                         "secretGenerator", "configMapGenerator"}
_CLUSTER_SCOPED = frozenset({"Namespace", "PersistentVolume", "StorageClass", "ClusterRole", "ClusterRoleBinding"})


class Unsupported(ValueError):
    """The kustomization uses a feature this renderer does not implement."""


def _docs(text: str) -> list[Resource]:
    return [d for d in yaml.safe_load_all(text) if d is not None]


def _key(res: Resource) -> tuple[str, str]:
    return res["kind"], res["metadata"]["name"]


def _merge_key(field: str, items: list[Any]) -> str | None:
    if field == "ports":  # container ports merge by containerPort, a Service's by port
        return "containerPort" if any(isinstance(i, dict) and "containerPort" in i for i in items) else "port"
    return _MERGE_KEYS.get(field)


def strategic_merge(base: Any, patch: Any, *, builtin: bool) -> Any:
    """`patch` merged into `base` (both plain YAML data); returns the result, `base` unchanged."""
    if not isinstance(base, dict) or not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(base)
    for field, value in patch.items():
        if field == "$patch":
            continue
        if value is None:
            out.pop(field, None)
        elif isinstance(value, dict) and isinstance(out.get(field), dict):
            out[field] = strategic_merge(out[field], value, builtin=builtin)
        elif (isinstance(value, list) and isinstance(out.get(field), list) and builtin
              and (key := _merge_key(field, out[field] + value)) is not None):
            out[field] = _merge_list(out[field], value, key, builtin=builtin)
        else:
            out[field] = _strip_directives(value)
    return out


def _merge_list(base: list[Any], patch: list[Any], key: str, *, builtin: bool) -> list[Any]:
    """Items named in `patch` first, in its order (merged into their old selves where they existed),
    then `base`'s other items in their order: the order kustomize gives."""
    by_key = {item.get(key): item for item in base}
    named = {item.get(key) for item in patch}
    head = [strategic_merge(by_key[item.get(key)], item, builtin=builtin) if item.get(key) in by_key
            else _strip_directives(item) for item in patch if item.get("$patch") != "delete"]
    return head + [copy.deepcopy(item) for item in base if item.get(key) not in named]


def _strip_directives(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_directives(v) for k, v in value.items() if k != "$patch"}
    if isinstance(value, list):
        return [_strip_directives(v) for v in value]
    return copy.deepcopy(value)


def _load_kustomization(directory: Path, kind: str) -> Resource:
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    if spec.get("kind", "Kustomization") != kind:
        raise Unsupported(f"{directory}: expected a {kind}, found {spec.get('kind')}")
    unknown = set(spec) - _KUSTOMIZATION_FIELDS
    if unknown:
        raise Unsupported(f"{directory}/kustomization.yaml: fields {sorted(unknown)}")
    return spec


def _add(resources: list[Resource], new: list[Resource], where: str) -> None:
    for res in new:
        if any(_key(r) == _key(res) for r in resources):
            raise ValueError(f"{where}: {_key(res)} is defined twice")
        resources.append(res)


def _apply(directory: Path, spec: Resource, resources: list[Resource]) -> list[Resource]:
    """Apply one kustomization's (or component's) generators and transformers to `resources`."""
    for kind, field in (("Secret", "secretGenerator"), ("ConfigMap", "configMapGenerator")):
        for gen in spec.get(field, []):
            if gen.get("behavior") != "merge":
                raise Unsupported(f"{directory}: {field} {gen['name']} without behavior: merge")
            target = next((r for r in resources if _key(r) == (kind, gen["name"])), None)
            if target is None:
                raise ValueError(f"{directory}: {field} merges into {kind} {gen['name']}, which does not exist")
            keys = [entry.split("=", 1)[0] for entry in gen.get("files", [])]
            keys += [entry.split("=", 1)[0] for entry in gen.get("literals", [])]
            target.setdefault("data", {}).update({k: f"<generated {k}>" for k in keys})
    for patch_ref in spec.get("patches", []):
        if set(patch_ref) - {"path", "patch"}:
            raise Unsupported(f"{directory}: patch fields {sorted(patch_ref)}")
        text = (directory / patch_ref["path"]).read_text() if "path" in patch_ref else patch_ref["patch"]
        for patch in _docs(text):
            at = next((i for i, r in enumerate(resources) if _key(r) == _key(patch)), None)
            if at is None:
                raise ValueError(f"{directory}: patch targets {_key(patch)}, which does not exist")
            if patch.get("$patch") == "delete":
                resources.pop(at)
            else:
                builtin = resources[at]["apiVersion"] in BUILTIN_API_VERSIONS
                resources[at] = strategic_merge(resources[at], patch, builtin=builtin)
    for image in spec.get("images", []):
        for res in resources:
            for container in _containers(res):
                name, tag = _split_image(container["image"])
                if name == image["name"]:
                    name, tag = image.get("newName", name), image.get("newTag", tag)
                    container["image"] = name if tag is None else f"{name}:{tag}"
    if "namespace" in spec:
        for res in resources:
            if res["kind"] not in _CLUSTER_SCOPED:
                res["metadata"]["namespace"] = spec["namespace"]
    return resources


def _split_image(image: str) -> tuple[str, str | None]:
    """'registry/name:tag' -> ('registry/name', 'tag'); no tag -> (image, None)."""
    name, sep, tag = image.rpartition(":")
    return (image, None) if not sep or "/" in tag else (name, tag)


def _containers(node: Any) -> list[Resource]:
    """Every container and init container anywhere under `node` (pod templates of any kind)."""
    found: list[Resource] = []
    if isinstance(node, dict):
        for field, value in node.items():
            if field in ("containers", "initContainers") and isinstance(value, list):
                found.extend(value)
            else:
                found.extend(_containers(value))
    elif isinstance(node, list):
        for value in node:
            found.extend(_containers(value))
    return found


def _accumulate(directory: Path, spec: Resource) -> list[Resource]:
    resources: list[Resource] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        if path.is_dir():
            _add(resources, render(path), str(path))
        else:
            _add(resources, _docs(path.read_text()), str(path))
    for entry in spec.get("components", []):
        component = (directory / entry).resolve()
        comp_spec = _load_kustomization(component, "Component")
        _add(resources, _accumulate(component, comp_spec), str(component))
        resources = _apply(component, comp_spec, resources)
    return resources


def render(directory: Path) -> list[Resource]:
    """The resources `kubectl kustomize directory` would print, as plain YAML data."""
    directory = Path(directory)
    spec = _load_kustomization(directory, "Kustomization")
    return _apply(directory, spec, _accumulate(directory, spec))
