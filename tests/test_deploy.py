"""deploy/: what can be checked without a container runtime or a cluster.

The manifests parse and point at routes and ports the real app has; the grace periods
cover drain_delay + drain_timeout of the config they ship; the Dockerfile's command and
the systemd unit's ExecStart are run (with --check) against that config. The schema
validation of every manifest, the admin port's agreement across them, the NetworkPolicy,
the Secrets and the image's lock file are in test_deploy_manifests.py and test_image.py.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from aiohttp import web
from deploykit import (
    DEPLOY,
    K8S,
    ROOT,
    config_toml,
    configmap_file,
    container_ports,
    dockerfile_cmd,
    dockerfile_instructions,
    gateway_container,
    gateway_deployment,
    loader_compatible,
    named,
    objects,
    render,
)
from fakes import fleet, gateway_with

from gateway.config.load import load
from gateway.config.schema import GatewaySection
from gateway.server.app import build_app
from gateway.sim.sim_vllm import SimConfig

UNIT = DEPLOY / "systemd" / "vllm-gateway.service"
GATEWAY_BIN = Path(sys.executable).parent / "gateway"  # the console script of this install
# Values for the variables the Secrets give the pods (nothing in deploy/ ships one).
SECRET_ENV = {"GATEWAY_API_KEY": "sk-test-deploy", "REDIS_PASSWORD": "0123456789abcdef"}


@pytest.fixture
def shipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The ConfigMap's two files, written to a folder, with the Secrets' variables in the
    environment. config.toml loses only the issue 33 keys this gateway's loader does not
    know yet (deploykit.loader_compatible); test_deploy_manifests.py says when it does."""
    (tmp_path / "config.toml").write_text(loader_compatible(configmap_file("config.toml")))
    (tmp_path / "settings.json").write_text(configmap_file("settings.json"))
    for name, value in SECRET_ENV.items():
        monkeypatch.setenv(name, value)
    return tmp_path / "config.toml"


def _gateway() -> GatewaySection:
    """[gateway] of the ConfigMap, with the defaults for what it leaves out (the loader's
    model, on the keys it knows)."""
    known = {k: v for k, v in config_toml()["gateway"].items() if k in GatewaySection.model_fields}
    return GatewaySection(**known)


def _get_routes(shipped: Path) -> set[str]:
    """The GET paths the real app's router serves for the shipped configuration on one
    listener: without admin_port, where every path stays on the main port (as before
    issue 33), so the set does not depend on how the admin listener splits the routes."""
    single = shipped.with_name("single.toml")
    single.write_text(loader_compatible(shipped.read_text(), drop=("admin_host", "admin_port")))
    app = build_app(load(single))
    return {
        r.resource.canonical
        for r in app.router.routes()
        if r.method == "GET" and isinstance(r.resource, web.Resource)
    }


def _check(argv: list[str], config: Path) -> subprocess.CompletedProcess[str]:
    """Run a deploy file's command line with --check, against `config` and this install."""
    argv = [str(GATEWAY_BIN) if a == "gateway" or a.endswith("/bin/gateway") else a for a in argv]
    argv = [str(config) if a.endswith("config.toml") else a for a in argv]
    if "--check" not in argv:
        argv.append("--check")
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


# ---------------------------------------------------------------- kubernetes


def test_every_manifest_parses_and_kustomization_lists_them_all() -> None:
    """Each YAML file parses into named Kubernetes objects; kustomization.yaml lists every file."""
    kinds = {d["kind"] for d in render()}
    assert kinds >= {
        "ConfigMap",
        "Deployment",
        "Service",
        "ServiceMonitor",
        "PodDisruptionBudget",
        "NetworkPolicy",
    }
    for doc in render():
        assert doc["apiVersion"]
        assert doc["metadata"]["name"].startswith("vllm-gateway")
    (kustomization,) = yaml.safe_load_all((K8S / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    # Every folder but the example vLLM fleet, which is the user's own to run (vllm/).
    folders = {p.parent.name for p in K8S.glob("*/kustomization.yaml")} - {"vllm"}
    assert listed == ({p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}) | folders


def test_the_replicas_share_their_view_through_the_redis_deployed_beside_them() -> None:
    """The ConfigMap's [shared] redis_url names the Redis Service and port of deploy/.../redis."""
    docs = render(K8S / "redis")
    service = named("Service", "vllm-gateway-redis", docs)
    deployment = named("Deployment", "vllm-gateway-redis", docs)
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    parts = urlsplit(config_toml()["shared"]["redis_url"])
    assert (parts.hostname, parts.port) == (
        service["metadata"]["name"],
        service["spec"]["ports"][0]["port"],
    )
    assert gateway_deployment()["spec"]["replicas"] >= 2  # why the view is shared at all


def test_probes_point_at_routes_and_the_port_the_app_serves(shipped: Path) -> None:
    """Readiness asks /readyz and liveness /healthz, on the container port of the listener
    that serves them: admin_port when the config sets one, else port."""
    container = gateway_container()
    routes = _get_routes(shipped)
    ports = container_ports(container)
    gateway = config_toml()["gateway"]
    assert gateway["host"] == "0.0.0.0"  # reachable from outside the pod
    assert gateway.get("admin_host", gateway["host"]) == "0.0.0.0"  # and by the kubelet
    probed = gateway.get("admin_port", gateway["port"])
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = container[probe]["httpGet"]
        assert get["path"] == path
        assert get["path"] in routes
        assert ports[get["port"]] == probed


def test_service_and_servicemonitor_reach_the_pods_metrics(shipped: Path) -> None:
    """The Services select the pods and target their ports; the ServiceMonitor scrapes
    /metrics through a Service port that exists."""
    pod_labels = gateway_deployment()["spec"]["template"]["metadata"]["labels"]
    names = set(container_ports(gateway_container()))
    services = [s for s in objects("Service") if s["metadata"]["name"] != "vllm-gateway-redis"]
    for service in services:
        assert service["spec"]["selector"].items() <= pod_labels.items()
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= names
    (monitor,) = objects("ServiceMonitor")
    selected = [
        s
        for s in services
        if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
    ]
    assert selected
    (endpoint,) = monitor["spec"]["endpoints"]
    for service in selected:
        assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] in _get_routes(shipped)


def test_grace_period_covers_prestop_drain_delay_and_drain_timeout() -> None:
    """terminationGracePeriodSeconds is at least preStop's sleep + drain_delay + drain_timeout."""
    spec = gateway_deployment()["spec"]["template"]["spec"]
    command = gateway_container()["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    gateway = _gateway()
    needed = float(command[1]) + gateway.drain_delay + gateway.drain_timeout
    assert spec["terminationGracePeriodSeconds"] >= needed + 1


def test_drain_delay_outlasts_the_readiness_probe_seeing_the_drain() -> None:
    """Readiness tolerates one missed probe (failureThreshold 2 or more), and drain_delay
    (503 from /readyz, still serving) lasts until the kubelet has seen enough of them:
    failureThreshold probes, periodSeconds apart, each allowed timeoutSeconds."""
    readiness = gateway_container()["readinessProbe"]
    assert readiness["failureThreshold"] >= 2
    # The API's defaults where the manifest leaves a field out.
    unready_after = readiness["failureThreshold"] * readiness.get(
        "periodSeconds", 10
    ) + readiness.get("timeoutSeconds", 1)
    assert _gateway().drain_delay >= unready_after


def test_the_key_comes_from_the_secret_and_the_files_from_the_configmap() -> None:
    """The container reads the key variable the config names from a Secret, and mounts the
    ConfigMap where the image's command looks for config.toml."""
    container = gateway_container()
    env = {e["name"]: e for e in container["env"]}
    key = env[config_toml()["gateway"]["api_key_env"]]
    assert key["valueFrom"]["secretKeyRef"] == {"name": "vllm-gateway", "key": key["name"]}
    volumes = gateway_deployment()["spec"]["template"]["spec"]["volumes"]
    (config,) = [v["name"] for v in volumes if v.get("configMap", {}).get("name")]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == config]
    assert mount["readOnly"] is True
    assert Path(mount["mountPath"], "config.toml") == Path(dockerfile_cmd()[-1])
    assert "command" not in container  # the image's CMD runs
    assert "args" not in container


# ---------------------------------------------------------------- Dockerfile


def test_dockerfile_is_slim_and_runs_as_a_non_root_user() -> None:
    """The image starts from a slim Python and runs as a numeric non-root user."""
    instructions = dict(dockerfile_instructions())
    assert "slim" in instructions["FROM"]
    assert instructions["USER"].isdigit()
    assert int(instructions["USER"]) != 0


@pytest.mark.slow  # runs the CLI as a process
def test_dockerfile_command_checks_the_shipped_configuration(shipped: Path) -> None:
    """The Dockerfile's CMD, run with --check against the ConfigMap's files, says ok."""
    argv = dockerfile_cmd()
    assert argv[:2] == ["gateway", "--config"]
    done = _check(argv, shipped)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok:")


def _healthcheck() -> tuple[list[str], Path]:
    """The HEALTHCHECK's command, and the file of this repository it runs (from its COPY)."""
    (check,) = [rest for word, rest in dockerfile_instructions() if word == "HEALTHCHECK"]
    argv = json.loads(check.split(" CMD ", 1)[1])
    assert argv[0] == "python"  # the standard library: the slim image has no curl
    copies = [rest.split() for word, rest in dockerfile_instructions() if word == "COPY"]
    (source,) = [c[0] for c in copies if len(c) == 2 and c[1] == argv[1]]
    return argv, ROOT / source


def _healthcheck_module() -> Any:
    _, script = _healthcheck()
    spec = importlib.util.spec_from_file_location("gateway_healthcheck", script)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dockerfile_healthcheck_asks_the_port_the_config_serves_healthz_on() -> None:
    """The HEALTHCHECK reads the config the CMD runs (not a port written in the Dockerfile):
    admin_port when it is set, else port; an all-interfaces address is asked on loopback."""
    check = _healthcheck_module()
    assert dockerfile_cmd()[-1] == check.CONFIG
    assert (
        check.url(config_toml())
        == f"http://127.0.0.1:{config_toml()['gateway']['admin_port']}/healthz"
    )
    defaults = GatewaySection()
    assert check.url({}) == f"http://{defaults.host}:{defaults.port}/healthz"
    assert (
        check.url({"gateway": {"host": "0.0.0.0", "port": 8081}}) == "http://127.0.0.1:8081/healthz"
    )
    admin = {"host": "0.0.0.0", "port": 8080, "admin_host": "::", "admin_port": 9091}
    assert check.url({"gateway": admin}) == "http://[::1]:9091/healthz"
    assert check.url({"gateway": {"host": "10.1.2.3", "admin_port": 9092}}) == (
        "http://10.1.2.3:9092/healthz"
    )


@pytest.mark.slow  # a gateway and instances on loopback
async def test_dockerfile_healthcheck_passes_against_a_running_gateway(tmp_path: Path) -> None:
    """The HEALTHCHECK command exits 0 against a live gateway's /healthz, at the port its
    config file names, and 1 when nothing answers there."""
    argv, script = _healthcheck()
    config = tmp_path / "config.toml"
    async with fleet(SimConfig()) as sims, gateway_with(sims) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        config.write_text(f'[gateway]\nhost = "127.0.0.1"\nport = {port}\n')
        ok = await _run([sys.executable, str(script), *argv[2:]], config)
    assert ok == 0
    config.write_text('[gateway]\nhost = "127.0.0.1"\nport = 9\n')
    assert await _run([sys.executable, str(script), *argv[2:]], config) != 0


async def _run(argv: list[str], config: Path) -> int:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "GATEWAY_CONFIG": str(config)},
    )
    return await asyncio.wait_for(proc.wait(), 30)


# ---------------------------------------------------------------- systemd


def _unit() -> dict[str, list[str]]:
    values: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            values.setdefault(key.strip(), []).append(value.strip())
    return values


def test_systemd_unit_reloads_drains_and_runs_unprivileged() -> None:
    """The unit reloads with SIGHUP, stops with SIGTERM within a TimeoutStopSec that covers
    the default drain, runs as a dynamic user, and reads the key from an EnvironmentFile."""
    unit = _unit()
    assert unit["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert unit["KillSignal"] == ["SIGTERM"]
    defaults = GatewaySection()
    assert float(unit["TimeoutStopSec"][0]) >= defaults.drain_delay + defaults.drain_timeout + 1
    assert unit["DynamicUser"] == ["yes"] or unit.get("User", ["root"]) != ["root"]
    assert unit["EnvironmentFile"]


@pytest.mark.slow  # runs the CLI as a process
def test_systemd_execstart_checks_the_shipped_configuration(shipped: Path) -> None:
    """The unit's ExecStart (and ExecStartPre) parse, and run with --check against the
    shipped files they say ok."""
    unit = _unit()
    for line in unit["ExecStartPre"] + unit["ExecStart"]:
        argv = shlex.split(line)
        assert argv[0].endswith("/bin/gateway")
        assert argv[1] == "--config"
        done = _check(argv, shipped)
        assert done.returncode == 0, (line, done.stderr)


@pytest.mark.slow  # runs systemd-analyze
def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    """`systemd-analyze verify` finds nothing wrong with the unit (paths moved to this install)."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed: the unit's ExecStart is checked by parsing")
    env_file = tmp_path / "gateway.env"
    env_file.write_text("GATEWAY_API_KEY=sk-test\n")
    text = UNIT.read_text().replace("/opt/vllm-gateway/bin/gateway", str(GATEWAY_BIN))
    text = text.replace("/etc/vllm-gateway/gateway.env", str(env_file))
    unit = tmp_path / UNIT.name
    unit.write_text(text)
    done = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    ours = [line for line in done.stderr.splitlines() if UNIT.name in line]
    assert not ours, ours
