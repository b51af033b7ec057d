"""deploy/kubernetes as a cluster would take it: strict schemas, and the files agreeing.

Every object `kubectl apply -k deploy/kubernetes` creates is validated against the
Kubernetes API's own OpenAPI schemas by kubernetes-validate, strictly (an unknown or
misspelt field fails, as `kubectl apply --validate=strict` would), offline: the package
ships the schemas. The ServiceMonitor, a CRD those schemas lack, is checked against the
part of the Prometheus Operator's schema it uses, also with unknown fields refused.

Then the cross-checks no schema can make: the ports of the ConfigMap's config.toml
(port, admin_port) are the container's, the probes', the Services', the ServiceMonitor's
and the NetworkPolicy's; the NetworkPolicy lets the gateway reach the instances of
settings.json, Redis and DNS; no Secret ships a value, and the docs create every one the
pods read; Redis asks for the password the gateway's redis_url sends.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import redis
import yaml
from deploykit import (
    DEPLOY,
    K8S,
    NEW_GATEWAY_KEYS,
    config_toml,
    configmap_file,
    container_ports,
    deployment_guide,
    gateway_container,
    gateway_deployment,
    kustomizations,
    loader_knows,
    named,
    objects,
    render,
)
from redis_server import _binary as redis_binary
from redis_server import free_port

from gateway.config.load import load

# A release still supported, and the newest kubernetes-validate knows (the dev extra asks
# for 1.37 or later): a field removed or renamed between them fails one of the two.
KUBERNETES_VERSIONS = ("1.33.0", "1.37.0")

# The part of the Prometheus Operator's ServiceMonitor CRD (monitoring.coreos.com/v1) this
# kit uses or might, with the CRD's own names, types and patterns; any other field fails.
_DURATION = (
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"matchLabels": _LABELS, "matchExpressions": {"type": "array"}},
}
SERVICEMONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name"],
            "properties": {"name": {"type": "string"}, "labels": _LABELS},
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": _SELECTOR,
                "namespaceSelector": {"type": "object"},
                "jobLabel": {"type": "string"},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": _DURATION},
                            "scrapeTimeout": {"type": "string", "pattern": _DURATION},
                            "honorLabels": {"type": "boolean"},
                            "relabelings": {"type": "array"},
                            "metricRelabelings": {"type": "array"},
                        },
                    },
                },
            },
        },
    },
}
KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources"}


def _id(doc: dict[str, Any]) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


# ---------------------------------------------------------------- schemas


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_passes_the_kubernetes_schema_strictly(version: str) -> None:
    """Each object but the ServiceMonitor (a CRD) validates against Kubernetes `version`'s
    schema with unknown fields refused; none is left unchecked by a missing schema."""
    unchecked = []
    for doc in render():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            unchecked.append(_id(doc))
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{_id(doc)} against Kubernetes {version}: {error.message}")
    assert unchecked == ["ServiceMonitor/vllm-gateway"]


def test_the_strict_validation_refuses_a_misspelt_field_and_a_wrong_type() -> None:
    """The validator really is strict: a typo and a port given as a string both fail."""
    deployment = gateway_deployment()
    typo = json.loads(json.dumps(deployment))
    typo["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 45
    text = json.loads(json.dumps(deployment))
    text["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "8080"
    for broken in (typo, text):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


def test_the_servicemonitor_passes_the_operators_schema_strictly() -> None:
    """The ServiceMonitor's fields are the Prometheus Operator's (names, types, duration
    syntax), with anything else refused."""
    (monitor,) = objects("ServiceMonitor")
    jsonschema.validate(monitor, SERVICEMONITOR_SCHEMA)
    broken = json.loads(json.dumps(monitor))
    broken["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, SERVICEMONITOR_SCHEMA)


def test_the_kustomizations_only_list_resources_that_exist() -> None:
    """Each kustomization.yaml uses `resources` alone (so deploykit.render() is what
    kustomize builds), each naming a file or a folder with its own kustomization.yaml."""
    for folder, kustomization in kustomizations():
        assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
        assert kustomization["kind"] == "Kustomization"
        assert set(kustomization) <= KUSTOMIZATION_KEYS, folder
        for entry in kustomization["resources"]:
            path = folder / entry
            assert path.is_file() or (path / "kustomization.yaml").is_file(), path
    ids = [_id(d) for d in render()]
    assert len(ids) == len(set(ids))


@pytest.mark.slow  # runs kubectl
def test_kubectl_kustomize_builds_the_same_objects() -> None:
    """`kubectl kustomize` (kustomize itself, offline) builds exactly deploykit.render()."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the kustomizations' keys are checked instead")
    done = subprocess.run(
        [kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    built = [d for d in yaml.safe_load_all(done.stdout) if d is not None]

    def whole(doc: dict[str, Any]) -> str:  # order-free comparison of whole objects
        return json.dumps(doc, sort_keys=True)

    assert sorted(map(whole, built)) == sorted(map(whole, render()))


# ---------------------------------------------------------------- the admin port


def _service_target(service: dict[str, Any], port_name: str) -> str:
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == port_name]
    target: str = port["targetPort"]
    return target


def test_ports_probes_services_monitor_and_policy_agree_with_the_config() -> None:
    """config.toml's port is the container's `http`, the only port of the Service
    vllm-gateway; its admin_port is `admin`, where both probes go, which the admin Service
    exposes and the ServiceMonitor scrapes, and which the NetworkPolicy opens only to
    Prometheus while it opens `http` to clients."""
    gateway = config_toml()["gateway"]
    assert gateway["admin_port"] != gateway["port"]
    assert gateway.get("admin_host", gateway["host"]) == "0.0.0.0"  # the kubelet, Prometheus
    ports = container_ports(gateway_container())
    assert ports == {"http": gateway["port"], "admin": gateway["admin_port"]}

    container = gateway_container()
    for probe in ("readinessProbe", "livenessProbe"):
        assert ports[container[probe]["httpGet"]["port"]] == gateway["admin_port"]

    api = named("Service", "vllm-gateway")
    assert [p["targetPort"] for p in api["spec"]["ports"]] == ["http"]  # the API only

    (monitor,) = objects("ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "admin"
    selected = [
        s
        for s in objects("Service")
        if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
    ]
    assert [s["metadata"]["name"] for s in selected] == ["vllm-gateway-admin"]
    (admin,) = selected
    assert admin["spec"]["clusterIP"] == "None"  # each pod scraped on its own endpoint
    assert ports[_service_target(admin, endpoint["port"])] == gateway["admin_port"]

    policy = named("NetworkPolicy", "vllm-gateway")
    opened = {}
    for rule in policy["spec"]["ingress"]:
        for port in rule["ports"]:
            assert port.get("protocol", "TCP") == "TCP"
            number = ports.get(port["port"], port["port"])  # a name resolves on the pod
            opened[number] = rule.get("from")
    assert set(opened) == {gateway["port"], gateway["admin_port"]}
    assert opened[gateway["port"]] is None  # clients, wherever they are: the key guards it
    prometheus = opened[gateway["admin_port"]]
    assert prometheus  # not everyone: /metrics takes no key
    assert all(peer["podSelector"]["matchLabels"] for peer in prometheus)


def test_the_gateway_loader_accepts_the_configmap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway's own loader takes the ConfigMap's config.toml whole, with the issue 33
    keys, and reads the ports the manifests use."""
    unknown = [k for k in NEW_GATEWAY_KEYS if not loader_knows(k)]
    if unknown:
        pytest.skip(
            f"this gateway's loader does not know [gateway] {', '.join(unknown)} yet (issue 33, "
            "written in parallel): the manifests are checked against the parsed TOML instead"
        )
    (tmp_path / "config.toml").write_text(configmap_file("config.toml"))
    (tmp_path / "settings.json").write_text(configmap_file("settings.json"))
    monkeypatch.setenv("GATEWAY_API_KEY", "sk-test-deploy")
    monkeypatch.setenv("REDIS_PASSWORD", "0123456789abcdef")
    gateway = load(tmp_path / "config.toml").gateway
    ports = container_ports(gateway_container())
    assert (gateway.port, getattr(gateway, "admin_port", None)) == (ports["http"], ports["admin"])


# ---------------------------------------------------------------- NetworkPolicy


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return bool(selector["matchLabels"].items() <= labels.items())


def _pod_labels(name: str) -> dict[str, str]:
    labels: dict[str, str] = named("Deployment", name)["spec"]["template"]["metadata"]["labels"]
    return labels


def test_the_network_policy_lets_the_gateway_reach_instances_redis_and_dns() -> None:
    """Egress: every instance port of settings.json, the Redis pods on their container
    port, DNS over UDP and TCP; nothing else. Ingress to Redis: the gateway pods only."""
    policy = named("NetworkPolicy", "vllm-gateway")
    assert _selects(policy["spec"]["podSelector"], _pod_labels("vllm-gateway"))
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    anywhere: set[tuple[str, int]] = set()
    to_redis: set[int] = set()
    redis_pods = _pod_labels("vllm-gateway-redis")
    for rule in policy["spec"]["egress"]:
        reached = {(p.get("protocol", "TCP"), p["port"]) for p in rule["ports"]}
        if "to" not in rule:
            anywhere |= reached
        else:
            assert all(_selects(peer["podSelector"], redis_pods) for peer in rule["to"])
            to_redis |= {port for _, port in reached}
    instances = json.loads(configmap_file("settings.json"))["vllm"]["instances"]
    instance_ports = {urlsplit(u if isinstance(u, str) else u["url"]).port for u in instances}
    dns = {("UDP", 53), ("TCP", 53)}
    assert anywhere == dns | {("TCP", p) for p in instance_ports}
    (redis_container,) = named("Deployment", "vllm-gateway-redis")["spec"]["template"]["spec"][
        "containers"
    ]
    assert to_redis == set(container_ports(redis_container).values())
    assert urlsplit(config_toml()["shared"]["redis_url"]).port in to_redis  # the Service's

    guard = named("NetworkPolicy", "vllm-gateway-redis")
    assert _selects(guard["spec"]["podSelector"], redis_pods)
    (rule,) = guard["spec"]["ingress"]
    assert [_selects(p["podSelector"], _pod_labels("vllm-gateway")) for p in rule["from"]] == [True]
    assert [container_ports(redis_container)[p["port"]] for p in rule["ports"]] == [6379]
    assert "egress" not in guard["spec"]  # with Egress in policyTypes: Redis reaches nothing
    assert "Egress" in guard["spec"]["policyTypes"]


# ---------------------------------------------------------------- availability


def test_the_disruption_budget_keeps_one_replica_and_lets_one_go() -> None:
    """minAvailable 1 of the Deployment's replicas: a drain evicts one pod at a time, and
    never finds the budget blocking every eviction."""
    (budget,) = objects("PodDisruptionBudget")
    assert budget["apiVersion"] == "policy/v1"
    replicas = gateway_deployment()["spec"]["replicas"]
    assert budget["spec"]["minAvailable"] == 1 < replicas
    assert _selects(budget["spec"]["selector"], _pod_labels("vllm-gateway"))


def test_the_replicas_spread_over_nodes_and_zones() -> None:
    """Hard spread over nodes, soft over zones, each counting the gateway's own pods (of one
    rollout); and a soft anti-affinity on the node."""
    spec = gateway_deployment()["spec"]["template"]["spec"]
    labels = _pod_labels("vllm-gateway")
    rules = {c["topologyKey"]: c for c in spec["topologySpreadConstraints"]}
    assert rules["kubernetes.io/hostname"]["whenUnsatisfiable"] == "DoNotSchedule"
    assert rules["topology.kubernetes.io/zone"]["whenUnsatisfiable"] == "ScheduleAnyway"
    for rule in rules.values():
        assert rule["maxSkew"] == 1
        assert _selects(rule["labelSelector"], labels)
        assert rule["matchLabelKeys"] == ["pod-template-hash"]
    (preferred,) = spec["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert preferred["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert _selects(preferred["podAffinityTerm"]["labelSelector"], labels)
    assert (
        "requiredDuringSchedulingIgnoredDuringExecution" not in spec["affinity"]["podAntiAffinity"]
    )


def test_the_root_filesystem_is_read_only_with_a_writable_tmp() -> None:
    """readOnlyRootFilesystem stays on; /tmp is an emptyDir (size-limited)."""
    container = gateway_container()
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    volumes = {v["name"]: v for v in gateway_deployment()["spec"]["template"]["spec"]["volumes"]}
    (tmp,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert "readOnly" not in tmp
    assert volumes[tmp["name"]]["emptyDir"]["sizeLimit"]


# ---------------------------------------------------------------- Secrets


_CREATE = re.compile(
    r"kubectl create secret generic ([a-z0-9-]+)[\s\\#]*"
    r"--from-literal=([A-Z0-9_]+)=\"?\$\(openssl rand -hex \d+\)"
)


def _secret_refs() -> set[tuple[str, str]]:
    refs = set()
    for deployment in objects("Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert not ref.get("optional", False), ref  # a missing one stops the pod
                    refs.add((ref["name"], ref["key"]))
    return refs


def test_no_secret_value_ships_and_the_docs_create_every_secret_the_pods_read() -> None:
    """deploy/kubernetes holds no Secret (nor `change-me`); each Secret key a pod reads is
    created, with a random value, by a `kubectl create secret` line of docs/deployment.md and
    of kustomization.yaml's comment."""
    assert not objects("Secret")
    for path in DEPLOY.rglob("*"):
        if path.is_file():
            assert "change-me" not in path.read_text(encoding="utf-8", errors="replace"), path
    refs = _secret_refs()
    assert refs == {("vllm-gateway", "GATEWAY_API_KEY"), ("vllm-gateway-redis", "REDIS_PASSWORD")}
    assert set(_CREATE.findall(deployment_guide())) == refs
    assert set(_CREATE.findall((K8S / "kustomization.yaml").read_text())) == refs


def test_redis_asks_for_the_password_the_gateway_sends() -> None:
    """Redis' --requirepass and the gateway's REDIS_PASSWORD, which fills redis_url's
    password, come from the same Secret key."""
    (redis_container,) = named("Deployment", "vllm-gateway-redis")["spec"]["template"]["spec"][
        "containers"
    ]
    args = redis_container["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"  # the kubelet fills it
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in redis_container["env"]}
    gateway_env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in gateway_container()["env"]}
    assert env["REDIS_PASSWORD"] == gateway_env["REDIS_PASSWORD"]
    url = urlsplit(config_toml()["shared"]["redis_url"])
    assert (url.username, url.password) == ("", "${REDIS_PASSWORD}")


def _kubelet_args(container: dict[str, Any], env: dict[str, str]) -> list[str]:
    """The container's args with `$(VAR)` replaced as the kubelet does."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["args"]]


@pytest.mark.slow  # a real redis-server
def test_a_real_redis_with_the_manifests_args_takes_the_configmaps_url_only() -> None:
    """redis-server, started with the manifest's arguments and a password, refuses a client
    without it and answers one that uses redis_url with ${REDIS_PASSWORD} filled in."""
    (container,) = named("Deployment", "vllm-gateway-redis")["spec"]["template"]["spec"][
        "containers"
    ]
    password = "0123456789abcdef0123456789abcdef0123456789abcdef"  # openssl rand -hex 24
    port = free_port()
    argv = [redis_binary(), *_kubelet_args(container, {"REDIS_PASSWORD": password})]
    argv += ["--port", str(port), "--bind", "127.0.0.1"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = config_toml()["shared"]["redis_url"].replace("${REDIS_PASSWORD}", password)
        url = url.replace("vllm-gateway-redis:6379", f"127.0.0.1:{port}")
        client = redis.Redis.from_url(url, socket_timeout=2, retry=None)
        anonymous = redis.Redis(port=port, socket_timeout=2, retry=None)
        deadline = time.monotonic() + 10
        while True:
            try:
                assert client.ping() is True
                break
            except redis.ConnectionError:
                assert proc.poll() is None, "redis-server refused the manifest's arguments"
                assert time.monotonic() < deadline, "redis-server did not answer"
                time.sleep(0.05)
        with pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        client.close()
        anonymous.close()
    finally:
        proc.kill()
        proc.wait(10)


# ---------------------------------------------------------------- the vLLM fleet by DNS


def test_the_vllm_example_is_a_headless_service_the_configmaps_entry_discovers() -> None:
    """deploy/kubernetes/vllm: a Deployment and a headless Service over its pods, strictly
    valid; the ConfigMap's instance entry discovers that Service's name on its port, and the
    pods are ready by vLLM's /health (what the Service's DNS answer follows)."""
    docs = render(K8S / "vllm")
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSIONS[-1], strict=True)
    (service,) = objects("Service", docs)
    (deployment,) = objects("Deployment", docs)
    assert service["spec"]["clusterIP"] == "None"
    pod = deployment["spec"]["template"]
    assert _selects({"matchLabels": service["spec"]["selector"]}, pod["metadata"]["labels"])
    (container,) = pod["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    (entry,) = json.loads(configmap_file("settings.json"))["vllm"]["instances"]
    assert entry["discover"] == "dns"
    url = urlsplit(entry["url"])
    assert url.hostname == service["metadata"]["name"]
    assert url.port == service["spec"]["ports"][0]["port"]
    assert f"--port={container_ports(container)['http']}" in container["args"]
    # Not applied with the gateway: the fleet is the user's own.
    assert "vllm" not in [e.rstrip("/") for _, k in kustomizations() for e in k["resources"]]
