"""deploy/: what can be checked without a container runtime or a cluster.

The manifests parse and point at routes and ports the real app has; the grace periods
cover drain_delay + drain_timeout of the config they ship; the Dockerfile's command and
the systemd unit's ExecStart are run (with --check) against that config.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from aiohttp import web
from fakes import fleet, gateway_with

from gateway.config.load import load
from gateway.config.schema import GatewaySection
from gateway.server.app import build_app
from gateway.sim.sim_vllm import SimConfig

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
UNIT = DEPLOY / "systemd" / "vllm-gateway.service"
GATEWAY_BIN = Path(sys.executable).parent / "gateway"  # the console script of this install


def _docs() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


def _kind(kind: str) -> dict[str, Any]:
    (doc,) = [d for d in _docs() if d["kind"] == kind]
    return doc


def _container() -> dict[str, Any]:
    (container,) = _kind("Deployment")["spec"]["template"]["spec"]["containers"]
    return dict(container)


@pytest.fixture
def shipped(tmp_path: Path) -> Iterator[Path]:
    """The ConfigMap's two files, written to a folder, with the Secret's key in the environment."""
    data = _kind("ConfigMap")["data"]
    for name in ("config.toml", "settings.json"):
        (tmp_path / name).write_text(data[name])
    key = _kind("Secret")["stringData"]["GATEWAY_API_KEY"]
    old = os.environ.get("GATEWAY_API_KEY")
    os.environ["GATEWAY_API_KEY"] = key
    try:
        yield tmp_path / "config.toml"
    finally:
        if old is None:
            os.environ.pop("GATEWAY_API_KEY", None)
        else:
            os.environ["GATEWAY_API_KEY"] = old


def _gateway(shipped: Path) -> GatewaySection:
    return load(shipped).gateway


def _get_routes(shipped: Path) -> set[str]:
    """The GET paths the real app's router serves for the shipped configuration."""
    app = build_app(load(shipped))
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
    kinds = {d["kind"] for d in _docs()}
    assert kinds >= {"ConfigMap", "Secret", "Deployment", "Service", "ServiceMonitor"}
    for doc in _docs():
        if doc["kind"] != "Kustomization":
            assert doc["apiVersion"]
            assert doc["metadata"]["name"] == "vllm-gateway"
    listed = set(_kind("Kustomization")["resources"])
    folders = {p.parent.name for p in K8S.glob("*/kustomization.yaml")}
    assert listed == ({p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}) | folders


def test_the_replicas_share_their_view_through_the_redis_deployed_beside_them(
    shipped: Path,
) -> None:
    """The ConfigMap's [shared] redis_url names the Redis Service and port of deploy/.../redis."""
    docs = [
        d for d in yaml.safe_load_all((K8S / "redis" / "redis.yaml").read_text()) if d is not None
    ]
    (service,) = [d for d in docs if d["kind"] == "Service"]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    url = load(shipped).file.shared.redis_url
    assert url is not None
    parts = urlsplit(url.get_secret_value())
    assert (parts.hostname, parts.port) == (
        service["metadata"]["name"],
        service["spec"]["ports"][0]["port"],
    )
    assert _kind("Deployment")["spec"]["replicas"] >= 2  # why the view is shared at all


def test_probes_point_at_routes_and_the_port_the_app_serves(shipped: Path) -> None:
    """Readiness asks /readyz and liveness /healthz, on the container port the config listens on."""
    container = _container()
    routes = _get_routes(shipped)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    gateway = _gateway(shipped)
    assert gateway.host == "0.0.0.0"  # reachable from outside the pod
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = container[probe]["httpGet"]
        assert get["path"] == path
        assert get["path"] in routes
        assert ports[get["port"]] == gateway.port


def test_service_and_servicemonitor_reach_the_pods_metrics(shipped: Path) -> None:
    """The Service selects the pods and targets their port; the ServiceMonitor scrapes /metrics."""
    pod_labels = _kind("Deployment")["spec"]["template"]["metadata"]["labels"]
    service = _kind("Service")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    names = {p["name"] for p in _container()["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= names
    monitor = _kind("ServiceMonitor")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] in _get_routes(shipped)


def test_grace_period_covers_prestop_drain_delay_and_drain_timeout(shipped: Path) -> None:
    """terminationGracePeriodSeconds is at least preStop's sleep + drain_delay + drain_timeout."""
    spec = _kind("Deployment")["spec"]["template"]["spec"]
    command = _container()["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    gateway = _gateway(shipped)
    needed = float(command[1]) + gateway.drain_delay + gateway.drain_timeout
    assert spec["terminationGracePeriodSeconds"] >= needed + 1


def test_the_key_comes_from_the_secret_and_the_files_from_the_configmap(shipped: Path) -> None:
    """The container reads the key variable the config names from the Secret, and mounts the
    ConfigMap where the image's command looks for config.toml."""
    container = _container()
    (env,) = container["env"]
    assert env["name"] == load(shipped).file.gateway.api_key_env
    assert env["valueFrom"]["secretKeyRef"]["name"] == _kind("Secret")["metadata"]["name"]
    (mount,) = container["volumeMounts"]
    assert Path(mount["mountPath"], "config.toml") == Path(_dockerfile_cmd()[-1])
    assert "command" not in container  # the image's CMD runs
    assert "args" not in container


# ---------------------------------------------------------------- Dockerfile


def _instructions() -> list[tuple[str, str]]:
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _dockerfile_cmd() -> list[str]:
    (cmd,) = [rest for word, rest in _instructions() if word == "CMD"]
    argv = json.loads(cmd)  # exec form: the gateway is PID 1 and gets the signals itself
    assert isinstance(argv, list)
    return [str(a) for a in argv]


def test_dockerfile_is_slim_and_runs_as_a_non_root_user() -> None:
    """The image starts from a slim Python and runs as a numeric non-root user."""
    instructions = dict(_instructions())
    assert "slim" in instructions["FROM"]
    assert instructions["USER"].isdigit()
    assert int(instructions["USER"]) != 0


@pytest.mark.slow  # runs the CLI as a process
def test_dockerfile_command_checks_the_shipped_configuration(shipped: Path) -> None:
    """The Dockerfile's CMD, run with --check against the ConfigMap's files, says ok."""
    argv = _dockerfile_cmd()
    assert argv[:2] == ["gateway", "--config"]
    done = _check(argv, shipped)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok:")


@pytest.mark.slow  # a gateway and instances on loopback
async def test_dockerfile_healthcheck_passes_against_a_running_gateway() -> None:
    """The HEALTHCHECK command (python's stdlib, no curl) exits 0 against a live gateway's
    /healthz, and 1 when nothing answers."""
    (check,) = [rest for word, rest in _instructions() if word == "HEALTHCHECK"]
    argv = json.loads(check.split("CMD", 1)[1])
    assert argv[0] == "python"
    assert "http://127.0.0.1:8080/healthz" in argv[-1]
    async with fleet(SimConfig()) as sims, gateway_with(sims) as gw:
        port = gw.url.rsplit(":", 1)[1]
        live = [sys.executable, *argv[1:-1], argv[-1].replace(":8080/", f":{port}/")]
        ok = await _run(live)
    assert ok == 0
    assert await _run([sys.executable, *argv[1:-1], argv[-1].replace(":8080/", ":9/")]) != 0


async def _run(argv: list[str]) -> int:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
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
