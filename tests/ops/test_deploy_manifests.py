"""The Kubernetes manifests under ops/deploy/ agree with the code they run.

Every kustomization (the base and each overlay) is rendered in pure Python
(`kustomize_render`; checked against `kubectl kustomize` where a kubectl exists), and
then each container's command line is expanded the way the kubelet does (`$(VAR)`
from its env, ConfigMap and downward-API values) and parsed by edgeserve's own
argparse parsers (`ops.cli.build_parser`) or torchrun's: a renamed or removed flag, a
bad choice or a flag given to the wrong command fails here. On top of that the
ports, probes, drain timeouts, GPU counts, Service selectors, Secret and ConfigMap
references, NetworkPolicies and Redis hash tags are checked against what the code
does.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.ops.deploy_commands import commands
from tests.ops.k8s_pods import (FIELD_VALUES, Pod, component, container_env, expand, find, gpus, matches, pods,
                                port_number)
from tests.ops.kustomize_render import Resource, render

DEPLOY = Path(__file__).resolve().parents[2] / "ops" / "deploy"
KUSTOMIZATIONS = ["base", "overlays/kimi-k2-8xh200", "overlays/kimi-k2-8xh200-unified", "overlays/kimi-k2-2x8xh100"]
WORKER_SHAPES = ({"prefill", "decode"}, {"unified"})  # disaggregated, or unified workers (components/unified)
SECRET_KEYS = {"worker-token", "redis-password"}
DRAIN_TAIL_S = 10  # after --drain-timeout: 5 s for the ended requests' responses (drain.py) + 5 s server shutdown


@pytest.fixture(scope="module", params=KUSTOMIZATIONS)
def rendered(request: pytest.FixtureRequest) -> list[Resource]:
    return render(DEPLOY / request.param)


@pytest.fixture(scope="module")
def base() -> list[Resource]:
    return render(DEPLOY / "base")


@pytest.fixture(scope="module")
def gateway_get_routes() -> set[str]:
    """The GET paths of the real gateway app (built with no model; its Redis client connects lazily)."""
    from gateway.app import create_gateway_app
    from gateway.config import GatewayConfig

    app = create_gateway_app(GatewayConfig(models=[], redis_url="redis://127.0.0.1:1/0"))
    return {route.path for route in app.routes if "GET" in (getattr(route, "methods", None) or ())}


def test_renders_every_tier_once(rendered: list[Resource]) -> None:
    keys = [(r["kind"], r["metadata"]["name"]) for r in rendered]
    assert len(keys) == len(set(keys))
    assert {"ConfigMap", "Secret", "Service", "Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget",
            "StatefulSet", "NetworkPolicy"} <= {r["kind"] for r in rendered}
    tiers = {component(p) for p in pods(rendered)}
    assert tiers - {"gateway", "redis"} in WORKER_SHAPES and {"gateway", "redis"} <= tiers
    for tier in tiers - {"redis"}:  # one Redis replica: a budget could only block node drains
        assert find(rendered, "PodDisruptionBudget", f"edgeserve-{tier}"), tier


def test_every_edgeserve_command_parses_with_the_cli(rendered: list[Resource], monkeypatch: pytest.MonkeyPatch) -> None:
    tiers = set()
    for pod, _, _, cmd in commands(rendered, monkeypatch):
        tier = component(pod)
        tiers.add(tier)
        assert cmd.subcommand == ("gateway" if tier == "gateway" else "serve"), pod.name
        if cmd.subcommand == "serve":
            assert cmd.args.role == tier, pod.name
        # secrets come from the environment, never argv (visible in `ps`); no worker runs without a token
        flags = {word.split("=", 1)[0] for word in cmd.argv}
        assert not flags & {"--worker-token", "--redis-url", "--insecure-no-worker-token"}, pod.name
    assert tiers == {component(p) for p in pods(rendered)} - {"redis"}


def test_ports_are_the_code_defaults_and_line_up(rendered: list[Resource], monkeypatch: pytest.MonkeyPatch) -> None:
    from urllib.parse import urlsplit

    from ops.cli import build_parser

    for pod, container, _, cmd in commands(rendered, monkeypatch):
        assert cmd.args.port == build_parser(cmd.subcommand).parse_args([cmd.subcommand]).port, pod.name
        assert cmd.args.host == "0.0.0.0", pod.name  # reachable from other pods (the token guards it)
        if pod.injected.get("LWS_WORKER_INDEX", "0") == "0":  # an LWS group's other pods serve no HTTP
            assert port_number(container, "http") == cmd.args.port, pod.name
        if cmd.subcommand == "serve":  # what the worker registers is where it listens
            advertised = urlsplit(cmd.args.advertise_url)
            assert (advertised.hostname, advertised.port) == (FIELD_VALUES["status.podIP"], cmd.args.port)
            assert cmd.args.worker_id == FIELD_VALUES["metadata.name"]


def test_probes_answer_without_credentials_or_redis(rendered: list[Resource], monkeypatch: pytest.MonkeyPatch,
                                                     gateway_get_routes: set[str]) -> None:
    from backend.worker_auth import OPEN_PATHS

    for pod, container, _, cmd in commands(rendered, monkeypatch):
        probes = [container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in container]
        if not container.get("ports"):
            assert not probes, f"{pod.name}: probes on a pod that serves no HTTP"
            continue
        assert {"readinessProbe", "livenessProbe"} <= set(container), pod.name
        for probe in probes:
            get = probe["httpGet"]
            assert port_number(container, get["port"]) == cmd.args.port, pod.name
            if cmd.subcommand == "serve":  # probes carry no worker token: only OPEN_PATHS answer them
                assert get["path"] in OPEN_PATHS, pod.name
            else:  # a real GET route, and not /healthz, which fails while Redis is away
                assert get["path"] in gateway_get_routes and get["path"] != "/healthz", pod.name
        if cmd.subcommand == "gateway":  # readiness follows the drain, liveness does not
            assert (container["readinessProbe"]["httpGet"]["path"],
                    container["livenessProbe"]["httpGet"]["path"]) == ("/readyz", "/livez"), pod.name


def test_termination_outlasts_the_drain(rendered: list[Resource], monkeypatch: pytest.MonkeyPatch) -> None:
    import inspect

    from backend.drain import Drain

    assert inspect.signature(Drain.run).parameters["grace_s"].default + 5 <= DRAIN_TAIL_S
    for pod, container, _, cmd in commands(rendered, monkeypatch):
        drain = cmd.args.drain_timeout
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        sleep = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
        assert pod.spec["terminationGracePeriodSeconds"] >= sleep + drain + DRAIN_TAIL_S, pod.name
        live = container.get("livenessProbe")
        if cmd.subcommand == "serve" and live:  # /health answers 503 "draining": liveness must wait it out
            assert live["periodSeconds"] * live["failureThreshold"] > drain + DRAIN_TAIL_S, pod.name


def test_gpus_match_the_parallelism(rendered: list[Resource], monkeypatch: pytest.MonkeyPatch) -> None:
    for pod, container, env, cmd in commands(rendered, monkeypatch):
        n = gpus(container)
        if cmd.subcommand == "gateway":
            assert n == 0
            continue
        assert n >= 1 and cmd.args.device == "cuda", pod.name
        assert any(t.get("key") == "nvidia.com/gpu" for t in pod.spec.get("tolerations", [])), pod.name
        assert int(cmd.value("--tensor-parallel") or 1) == n * pod.group_size, pod.name
        if cmd.torchrun is not None:  # one torchrun agent per pod, one rank per GPU, node rank = pod index
            assert (int(cmd.torchrun.nproc_per_node), cmd.torchrun.nnodes) == (n, str(pod.group_size)), pod.name
            assert cmd.torchrun.node_rank == int(env["LWS_WORKER_INDEX"]), pod.name
            (leader,) = [p for p in pods(rendered) if p.owner is pod.owner and p.injected["LWS_WORKER_INDEX"] == "0"]
            assert cmd.torchrun.master_port in [p["containerPort"] for p in leader.spec["containers"][0]["ports"]]


def test_environment_is_what_edgeserve_reads(rendered: list[Resource], monkeypatch: pytest.MonkeyPatch) -> None:
    from urllib.parse import urlsplit

    from backend.worker_auth import TOKEN_ENV, resolve_token
    from ops.pull import edgeserve_home

    names, regions = set(), set()
    for pod, container, env, cmd in commands(rendered, monkeypatch):
        (token,) = [v for v in container["env"] if v["name"] == TOKEN_ENV]
        assert token["valueFrom"]["secretKeyRef"] == {"name": "edgeserve-secrets", "key": "worker-token"}
        assert resolve_token(None) == "secret-worker-token"  # the environment parse_command set up
        # --redis-url's default read REDIS_URL: the Redis Service's port, the password from the Secret
        url = urlsplit(cmd.args.redis_url)
        assert cmd.args.redis_url == env["REDIS_URL"] and url.password == "secret-redis-password", pod.name
        (service,) = find(rendered, "Service", url.hostname)
        assert url.port in [p["port"] for p in service["spec"]["ports"]]
        mounts = [m["mountPath"] for m in container.get("volumeMounts", [])]
        assert edgeserve_home() == Path(env["EDGESERVE_HOME"]) and str(edgeserve_home()) in mounts, pod.name
        if cmd.args.model.startswith("/"):  # a model folder must be on a mounted volume
            assert any(cmd.args.model.startswith(m.rstrip("/") + "/") for m in mounts), pod.name
        names.add(cmd.args.served_name)
        regions.add(cmd.args.region)
    assert len(names) == 1 and len(regions) == 1  # gateways route only to workers of the name and region


def test_redis_keeps_its_data_behind_its_password(rendered: list[Resource]) -> None:
    (redis,) = find(rendered, "StatefulSet", "edgeserve-redis")
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    script = " ".join(container["args"])
    assert "--appendonly yes" in script and "--maxmemory-policy noeviction" in script and "requirepass" in script
    assert {"data"} == {t["metadata"]["name"] for t in redis["spec"]["volumeClaimTemplates"]}
    assert {"name": "data", "mountPath": "/data"} in container["volumeMounts"] and "--dir /data" in script
    secret_vars = {v["name"] for v in container["env"] if v["valueFrom"]["secretKeyRef"]["key"] == "redis-password"}
    assert secret_vars == {"REDIS_PASSWORD", "REDISCLI_AUTH"}
    (config,) = find(rendered, "ConfigMap", "edgeserve-config")
    host, port = config["data"]["EDGESERVE_REDIS_ADDRESS"].split("/")[0].split(":")
    (service,) = find(rendered, "Service", host)
    assert matches({"matchLabels": service["spec"]["selector"]}, redis["spec"]["template"]["metadata"]["labels"])
    assert [port_number(container, p["targetPort"]) for p in service["spec"]["ports"]] == [int(port)]


def test_every_reference_resolves(rendered: list[Resource], base: list[Resource]) -> None:
    base_names = {(r["kind"], r["metadata"]["name"]) for r in base}
    secret_keys = set()
    for pod in pods(rendered):
        volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
        templates = {t["metadata"]["name"] for t in pod.owner["spec"].get("volumeClaimTemplates", [])}
        for volume in volumes.values():
            if "persistentVolumeClaim" in volume:
                assert find(rendered, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]), pod.name
        for container in pod.spec["containers"] + pod.spec.get("initContainers", []):
            env = container_env(rendered, pod, container)  # asserts every $(VAR) in env values is defined
            for word in container.get("command", []) + container.get("args", []):
                expand(word, env)
            for source in container.get("envFrom", []):
                assert ("ConfigMap", source["configMapRef"]["name"]) in base_names
            for var in container.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ("Secret", ref["name"]) in base_names, pod.name
                    secret_keys.add(ref["key"])
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes or mount["name"] in templates, f"{pod.name}: {mount['name']}"
    assert secret_keys == SECRET_KEYS
    (secret,) = find(rendered, "Secret", "edgeserve-secrets")
    # the base declares the Secret without values; an overlay's secretGenerator fills every key
    assert set(secret.get("data", {})) == (set() if rendered == base else SECRET_KEYS)


def test_selectors_select_what_exists(rendered: list[Resource]) -> None:
    all_pods = pods(rendered)
    for service in find(rendered, "Service"):
        selected = [p for p in all_pods if matches({"matchLabels": service["spec"]["selector"]}, p.labels)]
        serving = [(p, c) for p in selected for c in p.spec["containers"] if c.get("ports")]
        assert serving, f"Service {service['metadata']['name']} selects no pod with ports"
        for port in service["spec"]["ports"]:  # a named targetPort must exist on every serving pod
            assert all(port_number(c, port["targetPort"]) for _, c in serving)
    for pdb in find(rendered, "PodDisruptionBudget"):
        assert any(matches(pdb["spec"]["selector"], p.labels) for p in all_pods), pdb["metadata"]["name"]
    for pod in all_pods:
        if pod.owner["kind"] in ("Deployment", "StatefulSet"):
            assert matches(pod.owner["spec"]["selector"], pod.labels), pod.name
        if pod.owner["kind"] == "StatefulSet":
            assert find(rendered, "Service", pod.owner["spec"]["serviceName"]), pod.name
        if pod.owner["kind"] == "LeaderWorkerSet":  # the controller makes a headless Service of this name
            assert not find(rendered, "Service", pod.owner["metadata"]["name"]), pod.name
    (hpa,) = find(rendered, "HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    (deployment,) = find(rendered, target["kind"], target["name"])
    assert "replicas" not in deployment["spec"]  # the autoscaler owns it
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    for container in deployment["spec"]["template"]["spec"]["containers"]:  # CPU utilisation needs a request
        assert container["resources"]["requests"]["cpu"]


def test_network_policies_admit_edgeserve_and_guard_workers(rendered: list[Resource]) -> None:
    by_tier: dict[str, list[Pod]] = {}
    for pod in pods(rendered):
        by_tier.setdefault(component(pod), []).append(pod)
    policies = find(rendered, "NetworkPolicy")

    def admits(client: Pod, server: Pod) -> bool:
        guarding = [n for n in policies if matches(n["spec"]["podSelector"], server.labels)]
        return not guarding or any(
            any(matches(peer["podSelector"], client.labels) for peer in rule.get("from", []))
            and all(port_number(server.spec["containers"][0], p["port"]) for p in rule.get("ports", []))
            for n in guarding for rule in n["spec"].get("ingress", []))

    workers = set(by_tier) - {"gateway", "redis"}
    for tier in workers | {"redis"}:  # guarded: only edgeserve's pods get in
        assert all(any(matches(n["spec"]["podSelector"], p.labels) for n in policies) for p in by_tier[tier])
        outsider = Pod({"kind": "Pod", "metadata": {"name": "outsider"}}, {"metadata": {"labels": {}}, "spec": {}}, {})
        assert not any(admits(outsider, p) for p in by_tier[tier])
    # routing, a group's ranks (NCCL), registry and metering, and KV transfer from prefill to decode
    needed = [(c, s) for w in workers for c, s in (("gateway", w), (w, w), (w, "redis"))] + [("gateway", "redis")]
    needed += [("decode", "prefill")] if workers == {"prefill", "decode"} else []
    for client, server in needed:
        assert all(admits(c, s) for c in by_tier[client] for s in by_tier[server]), (client, server)


def test_redis_keys_of_one_tenant_or_model_share_one_cluster_slot() -> None:
    """What the Redis Cluster note in ops/deploy/README.md rests on: every multi-key script or transaction
    touches the keys of one tenant ({t:...}) or one model ({m:...}), and those hash to one slot."""
    from redis.crc import key_slot

    from backend.registration import members_key, record_key
    from gateway import redis_keys as rk
    from prefix_cache import kv_events

    def slots(keys: list[str]) -> set[int]:
        return {key_slot(k.encode()) for k in keys}

    day = rk.utc_day()
    tenant = [rk.tenant("acme"), rk.tenant_keys("acme"), rk.rpm_window("acme"), rk.tokens_day("acme", day),
              rk.usage("acme", day), rk.usage_events("acme"), rk.metered("acme", "req-1")]
    model = [members_key("kimi-k2.6"), record_key("kimi-k2.6", "w-0"), kv_events.block_key("kimi-k2.6", b"\x01" * 16),
             kv_events.worker_blocks_key("kimi-k2.6", "w-0"), kv_events.events_key("kimi-k2.6")]
    assert len(slots(tenant)) == 1 and len(slots(model)) == 1
    assert slots(tenant) != slots([rk.tenant("globex")])  # tenants spread over the cluster's slots


def test_no_secret_value_is_written_down() -> None:
    for path in DEPLOY.rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "Secret":
                assert not doc.get("data") and not doc.get("stringData"), path
            for name, value in _env_values(doc):
                assert not re.search(r"TOKEN|PASSWORD|AUTH", name), f"{path}: {name} has an inline value"
    assert "secrets/" in (DEPLOY / "overlays" / ".gitignore").read_text().split()


def _env_values(node: Any) -> list[tuple[str, str]]:
    """(name, value) of every env entry with a literal value anywhere under `node`."""
    if isinstance(node, dict):
        found = [(node["name"], node["value"])] if {"name", "value"} <= set(node) and len(node) == 2 else []
        return found + [pair for value in node.values() for pair in _env_values(value)]
    if isinstance(node, list):
        return [pair for value in node for pair in _env_values(value)]
    return []


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl here: the Python rendering stands alone")
@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_python_rendering_matches_kubectl_kustomize(name: str, tmp_path: Path) -> None:
    shutil.copytree(DEPLOY, tmp_path / "deploy")
    if name != "base":
        (tmp_path / "deploy" / name / "secrets").mkdir()
        for key in SECRET_KEYS:
            (tmp_path / "deploy" / name / "secrets" / key).write_text(f"test-{key}")
    out = subprocess.run(["kubectl", "kustomize", str(tmp_path / "deploy" / name)], capture_output=True, text=True,
                         timeout=120, check=True).stdout

    def by_key(resources: list[Resource]) -> dict[tuple[str, str], Resource]:
        for res in resources:  # generated values differ (placeholders here): compare the Secret's keys
            if res["kind"] == "Secret" and "data" in res:
                res["data"] = sorted(res["data"])
        return {(r["kind"], r["metadata"]["name"]): r for r in resources}

    assert by_key(render(DEPLOY / name)) == by_key([d for d in yaml.safe_load_all(out) if d])


def test_image_holds_every_package_and_runs_as_the_pods_user(base: list[Resource]) -> None:
    import tomllib

    project = tomllib.loads((DEPLOY.parents[1] / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    copied = {line.split()[1] for line in dockerfile.splitlines() if line.startswith("COPY ")}
    assert packages <= copied, "a package pip installs is missing from the image"
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert all(f"!{p}/" in ignore for p in packages) and "!pyproject.toml" in ignore
    (user,) = [int(line.split()[1]) for line in dockerfile.splitlines() if line.startswith("USER ")]
    for pod in pods(base):
        if component(pod) != "redis":
            assert pod.spec["securityContext"]["runAsUser"] == user, pod.name
