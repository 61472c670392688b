"""Rendered pod templates read the way the kubelet reads them (test helper, not a test).

`pods` finds every pod template (Deployments, StatefulSets, both templates of a
LeaderWorkerSet, with the variables the LWS controller injects); `container_env`
builds a container's environment in the kubelet's order (injected, `envFrom`, then
`env` entries, each `$(VAR)` expanded from what came before); `expand` is that
expansion, failing on an undefined variable (the kubelet would pass `$(VAR)` through
literally, a silent misconfiguration). Secret values are placeholders
(`secret-<key>`) and downward-API fields fixed examples (`FIELD_VALUES`).
"""

from __future__ import annotations

import re
from typing import Any

from tests.ops.kustomize_render import Resource

__all__ = ["FIELD_VALUES", "Pod", "pods", "find", "component", "expand", "container_env", "gpus", "port_number",
           "matches"]

FIELD_VALUES = {"metadata.name": "edgeserve-decode-0", "status.podIP": "10.1.2.3", "metadata.namespace": "edgeserve"}
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def find(resources: list[Resource], kind: str, name: str | None = None) -> list[Resource]:
    """The resources of `kind` (named `name`, when given)."""
    return [r for r in resources if r["kind"] == kind and (name is None or r["metadata"]["name"] == name)]


class Pod:
    """One pod template: where it comes from, its labels and spec, and what the LWS controller injects."""

    def __init__(self, owner: Resource, template: Resource, injected: dict[str, str], group_size: int = 1) -> None:
        self.owner, self.labels, self.spec = owner, template["metadata"]["labels"], template["spec"]
        self.injected, self.group_size = injected, group_size
        self.name = f"{owner['kind']}/{owner['metadata']['name']}" + (
            f"[{injected['LWS_WORKER_INDEX']}]" if injected else "")


def pods(resources: list[Resource]) -> list[Pod]:
    """Every pod template in `resources`; a LeaderWorkerSet gives its leader (index 0) and worker (index 1)."""
    found = []
    for res in resources:
        if res["kind"] in ("Deployment", "StatefulSet"):
            found.append(Pod(res, res["spec"]["template"], {}))
        elif res["kind"] == "LeaderWorkerSet":
            lwt = res["spec"]["leaderWorkerTemplate"]
            for index, template in ((0, lwt["leaderTemplate"]), (1, lwt["workerTemplate"])):
                injected = {"LWS_LEADER_ADDRESS": f"{res['metadata']['name']}-0.{res['metadata']['name']}",
                            "LWS_GROUP_SIZE": str(lwt["size"]), "LWS_WORKER_INDEX": str(index)}
                found.append(Pod(res, template, injected, lwt["size"]))
    return found


def component(pod: Pod) -> str:
    """The pod's tier: gateway, prefill, decode or redis."""
    return pod.labels["app.kubernetes.io/component"]


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's `$(VAR)` expansion; an undefined variable fails the test (the kubelet would leave it)."""
    def one(match: re.Match[str]) -> str:
        assert match.group(1) in env, f"$({match.group(1)}) is not defined in the container's environment"
        return env[match.group(1)]
    return _VAR.sub(one, text)


def container_env(resources: list[Resource], pod: Pod, container: Resource) -> dict[str, str]:
    """The container's environment as the kubelet builds it: injected, envFrom, then env in order."""
    env = dict(pod.injected)
    for source in container.get("envFrom", []):
        (config,) = find(resources, "ConfigMap", source["configMapRef"]["name"])
        env.update(config["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
            continue
        ref = var["valueFrom"]
        if "secretKeyRef" in ref:
            env[var["name"]] = f"secret-{ref['secretKeyRef']['key']}"
        elif "configMapKeyRef" in ref:
            (config,) = find(resources, "ConfigMap", ref["configMapKeyRef"]["name"])
            env[var["name"]] = config["data"][ref["configMapKeyRef"]["key"]]
        else:
            env[var["name"]] = FIELD_VALUES[ref["fieldRef"]["fieldPath"]]
    return env


def gpus(container: Resource) -> int:
    """GPUs the container asks for (requests and limits must agree, as extended resources require)."""
    resources: dict[str, Any] = container.get("resources", {})
    requested = int(resources.get("requests", {}).get("nvidia.com/gpu", 0))
    assert requested == int(resources.get("limits", {}).get("nvidia.com/gpu", 0)), "GPU requests must equal limits"
    return requested


def port_number(container: Resource, port: int | str) -> int:
    """A probe's or Service's port (a number, or the name of one of the container's ports) as a number."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
    return number


def matches(selector: Resource, labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels and In/NotIn/Exists expressions) selects `labels`."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        value, values = labels.get(expr["key"]), expr.get("values", [])
        holds = {"In": value in values, "NotIn": value not in values, "Exists": expr["key"] in labels}
        if not holds[expr["operator"]]:
            return False
    return True
