"""Start a simulated fleet and a gateway as separate processes on 127.0.0.1, and watch them.

Scenarios run the system under test the way an operator would: `python -m loadtest.fleet`
and `python -m gateway --config ... --settings ...`, each its own process (optionally
pinned to a core with `taskset`), with the gateway's log in a file so a full pipe never
stalls it. `/proc/<pid>` gives the CPU time and peak memory of a process.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from gateway.sim.sim_engine import SimConfig
from gateway.sim.sim_fleet import kv_endpoints

KEY = "sk-loadtest-local"
_STARTUP_LIMIT = 30.0
# More fields of every instance entry of settings.json, or one dict per instance.
InstanceFields = dict[str, Any] | Sequence[dict[str, Any]] | None


def pin_prefix(core: int | Sequence[int] | None) -> list[str]:
    """`taskset -c core[,core...]` when pinning is asked for and possible, else nothing."""
    if core is None or shutil.which("taskset") is None:
        return []
    chosen = [core] if isinstance(core, int) else list(core)
    if not chosen or max(chosen) >= (os.cpu_count() or 1):
        return []
    return ["taskset", "-c", ",".join(map(str, chosen))]


def _git(*args: str) -> str:
    try:
        done = subprocess.run(
            ["git", *args], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout


def source_state(ref: str | None = None) -> dict[str, Any]:
    """The commit the measured gateway runs from and, for the working tree, its edits."""
    if ref is not None:
        return {"ref": ref, "commit": _git("rev-parse", "--short", ref).strip() or None}
    changed = _git("status", "--porcelain", "--", "gateway")
    return {
        "ref": "working tree",
        "commit": _git("rev-parse", "--short", "HEAD").strip() or None,
        "gateway_changes": [line[3:] for line in changed.splitlines() if line.strip()],
    }


def pin_ref(ref: str | None) -> str | None:
    """`ref` as the commit it names now (HEAD moves while a benchmark runs; the report
    must name the commit that ran, not the one HEAD reached when it was written)."""
    if ref is None:
        return None
    return _git("rev-parse", "--short", ref).strip() or ref


@contextlib.contextmanager
def exported_gateway(ref: str | None) -> Iterator[Path | None]:
    """The gateway package as committed at `ref`, in a temp folder; None: the working tree.

    Running from a snapshot keeps a benchmark off files someone is editing meanwhile.
    """
    if ref is None:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="loadtest-src-") as tmp:
        archive = subprocess.run(
            ["git", "archive", "--format=tar", ref, "gateway"], capture_output=True, check=False
        )
        if archive.returncode != 0:
            raise RuntimeError(f"git archive {ref!r} failed: {archive.stderr.decode()[-300:]}")
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(tmp, filter="data")
        yield Path(tmp)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def free_port_run(count: int, tries: int = 50) -> int:
    """The first of `count` consecutive loopback ports that are free now (a fleet's KV
    event sockets). Drawn below the ephemeral range, where no outgoing connection takes
    one of them between this check and the bind."""
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32_768  # Linux's default
    rng = random.Random()
    for _ in range(tries):
        base = rng.randrange(10_000, max(10_001, ephemeral - count))
        with contextlib.ExitStack() as held:
            try:
                for port in range(base, base + count):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return base
    raise RuntimeError(f"found no {count} consecutive free ports in {tries} tries")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/<pid>/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_tree(root: int) -> list[int]:
    """`root` and every live process below it, from the parent pid of each in /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                children.setdefault(int(_stat(int(entry.name))[1]), []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds of `root` and its descendants: utime + stime of each live one, plus the
    cutime + cstime of children they have waited for (a restarted worker still counts)."""
    ticks = 0
    for pid in process_tree(root):
        with contextlib.suppress(OSError):  # exited since the listing
            ticks += sum(int(f) for f in _stat(pid)[11:15])
    return ticks / os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat from the state field on (the name may hold spaces)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2 :].split()


def memory_kib(pid: int) -> dict[str, int]:
    """VmHWM (peak resident) and VmRSS of a process, in KiB, from /proc/<pid>/status."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmHWM", "VmRSS"):
            out[name] = int(value.split()[0])
    return out


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()


KV_EVENTS_TOPIC = SimConfig.kv_events_topic  # the simulator's (vLLM's default is empty)


@dataclass
class FleetProc:
    proc: asyncio.subprocess.Process
    urls: list[str]
    kv_events_port: int = 0  # instance i publishes on this + 2i, replays on + 2i + 1

    def kv_event_fields(self) -> list[dict[str, Any]]:
        """Each instance's `kv_events` field of settings.json, in fleet order (none
        without KV events)."""
        port = self.kv_events_port
        if not port:
            return [{} for _ in self.urls]
        out = []
        for i in range(len(self.urls)):
            endpoint, replay = kv_endpoints(port, i)  # the fleet's own layout
            events = {"endpoint": endpoint, "replay_endpoint": replay, "topic": KV_EVENTS_TOPIC}
            out.append({"kv_events": events})
        return out


@contextlib.asynccontextmanager
async def fleet_process(
    speeds: Sequence[float],
    *,
    max_num_seqs: int,
    seed: int,
    instant: bool = False,
    core: int | None = None,
    prefix_cache_blocks: int = 0,
    max_num_batched_tokens: int | None = None,
    decode_slowdown: float | None = None,
    prefill_tokens_per_s: float | None = None,
    decode_s_per_token: float | None = None,
    kv_transfer: bool = False,
    kv_bytes_per_token: int | None = None,
    kv_link_bytes_per_s: float | None = None,
    scheduling_policy: str | None = None,
    kv_events: bool = False,
    prompt_tokens_details: bool = False,
) -> AsyncIterator[FleetProc]:
    """`python -m loadtest.fleet` on free loopback ports; yields the instance URLs.

    prefix_cache_blocks > 0 turns on the simulated prefix cache, that many blocks each;
    kv_events (with it) has every instance publish vLLM's KV cache events on free ports
    (FleetProc.kv_event_fields says where). prompt_tokens_details: each answer's usage
    says its prompt tokens found cached (vLLM's --enable-prompt-tokens-details).
    kv_transfer runs every instance with vLLM's NixlConnector (kv_both): the instances of
    one fleet process can read each other's KV blocks. scheduling_policy: vLLM's
    --scheduling-policy (fcfs, priority). None: the simulator's default.
    """
    args = [
        *pin_prefix(core),
        sys.executable,
        "-m",
        "loadtest.fleet",
        "--speeds",
        ",".join(str(s) for s in speeds),
        "--base-port",
        "0",
        "--max-num-seqs",
        str(max_num_seqs),
        "--seed",
        str(seed),
    ]
    if instant:
        args.append("--instant")
    if prefix_cache_blocks:
        args += ["--prefix-cache-blocks", str(prefix_cache_blocks)]
    if max_num_batched_tokens:
        args += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    if decode_slowdown is not None:
        args += ["--decode-slowdown", str(decode_slowdown)]
    if prefill_tokens_per_s is not None:
        args += ["--prefill-tokens-per-s", str(prefill_tokens_per_s)]
    if decode_s_per_token is not None:
        args += ["--decode-s-per-token", str(decode_s_per_token)]
    if kv_transfer:
        args.append("--kv-transfer")
    if kv_bytes_per_token is not None:
        args += ["--kv-bytes-per-token", str(kv_bytes_per_token)]
    if kv_link_bytes_per_s is not None:
        args += ["--kv-link-bytes-per-s", str(kv_link_bytes_per_s)]
    if scheduling_policy is not None:
        args += ["--scheduling-policy", scheduling_policy]
    if prompt_tokens_details:
        args.append("--enable-prompt-tokens-details")
    kv_port = free_port_run(2 * len(speeds)) if kv_events else 0
    if kv_port:
        args += ["--kv-events-port", str(kv_port)]
    proc = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        urls = []
        for _ in speeds:
            line = await asyncio.wait_for(proc.stdout.readline(), _STARTUP_LIMIT)
            if not line:
                raise RuntimeError(f"the fleet exited early with status {await proc.wait()}")
            urls.append(line.decode().strip())
        yield FleetProc(proc, urls, kv_port)
    finally:
        await _stop(proc)


def gateway_files(
    folder: Path,
    port: int,
    instances: Sequence[str],
    *,
    strategy: str,
    max_num_seqs: int,
    dispatch: dict[str, Any] | None = None,
    gateway: dict[str, Any] | None = None,
    slo: dict[str, Any] | None = None,
    extra: dict[str, dict[str, Any]] | None = None,
    roles: Sequence[str] | None = None,
    channel: dict[str, Any] | None = None,
    instance_fields: InstanceFields = None,
) -> tuple[Path, Path]:
    """Write the config.toml and settings.json a scenario's gateway runs with.

    `extra`: more sections (e.g. `shared`), written as they are; `roles`: each instance's
    prefill/decode role, in order (none: every instance "both"); `channel`: more fields of
    the channel block (e.g. named `keys`); `instance_fields`: more fields of every
    instance object (e.g. `scheduling_policy`), or a list of them, one per instance in
    order (e.g. each instance's own `kv_events` ports).
    """
    sections: dict[str, dict[str, Any]] = {
        "gateway": {"host": "127.0.0.1", "port": port, **(gateway or {})},
        "dispatch": {
            "strategy": strategy,
            "health_check_interval": 1.0,
            "max_num_seqs": max_num_seqs,
            **(dispatch or {}),
        },
    }
    if slo:  # the operator's objectives, as the load generator judges them
        sections["slo"] = slo
    sections.update(extra or {})
    lines = []
    for name, values in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    config = folder / "config.toml"
    config.write_text("\n".join(lines) + "\n")
    settings = folder / "settings.json"
    fields = (
        [instance_fields or {}] * len(instances)
        if instance_fields is None or isinstance(instance_fields, dict)
        else list(instance_fields)
    )
    if len(fields) != len(instances):
        raise ValueError(f"{len(instances)} instances but {len(fields)} instance_fields")
    body = {
        "channel": {
            "api_key": "${GATEWAY_API_KEY}",
            "default_model": "sim-model",
            "headers": {"X-Request-Tag": "loadtest"},
            **(channel or {}),
        },
        "vllm": {
            "instances": [
                {
                    "url": u,
                    "max_num_seqs": max_num_seqs,
                    **({"role": r} if r else {}),
                    **f,
                }
                for u, r, f in zip(instances, roles or [""] * len(instances), fields, strict=True)
            ]
        },
    }
    settings.write_text(json.dumps(body, indent=2))
    return config, settings


@dataclass
class GatewayProc:
    proc: asyncio.subprocess.Process
    url: str
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def base_url(self) -> str:
        return self.url + "/v1"


async def _wait_ready(url: str, instances: int, proc: asyncio.subprocess.Process) -> None:
    """Until /admin/instances shows every instance up (bounded by _STARTUP_LIMIT)."""
    deadline = time.monotonic() + _STARTUP_LIMIT
    headers = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            if proc.returncode is not None:
                raise RuntimeError(f"the gateway exited with status {proc.returncode}")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with http.get(url + "/admin/instances", headers=headers) as resp:
                    if resp.status == 200:
                        body = await resp.json()
                        if sum(i["available"] for i in body["instances"]) == instances:
                            return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"the gateway at {url} was not ready within {_STARTUP_LIMIT} s")


@contextlib.asynccontextmanager
async def gateway_process(
    instances: Sequence[str],
    *,
    strategy: str,
    max_num_seqs: int,
    core: int | Sequence[int] | None = None,  # several: a worker per core (`--workers`)
    dispatch: dict[str, Any] | None = None,
    gateway: dict[str, Any] | None = None,
    source: Path | None = None,
    slo: dict[str, Any] | None = None,
    extra: dict[str, dict[str, Any]] | None = None,
    roles: Sequence[str] | None = None,
    channel: dict[str, Any] | None = None,
    instance_fields: InstanceFields = None,
    port: int | None = None,
) -> AsyncIterator[GatewayProc]:
    """`python -m gateway` before `instances`, ready when every instance is up.

    `source`: a folder holding the `gateway` package to run (see exported_gateway);
    by default the one this interpreter imports. `port`: where it listens (a free one by
    default; a restarted gateway is given its predecessor's).
    """
    with tempfile.TemporaryDirectory(prefix="loadtest-gw-") as tmp:
        folder = Path(tmp)
        port = port or free_port()
        config, settings = gateway_files(
            folder,
            port,
            instances,
            strategy=strategy,
            max_num_seqs=max_num_seqs,
            dispatch=dispatch,
            gateway=gateway,
            slo=slo,
            extra=extra,
            roles=roles,
            channel=channel,
            instance_fields=instance_fields,
        )
        log = folder / "gateway.log"
        env = {**os.environ, "GATEWAY_API_KEY": KEY}
        args = [
            *pin_prefix(core),
            sys.executable,
            "-m",
            "gateway",
            "--config",
            str(config),
            "--settings",
            str(settings),
        ]
        with log.open("wb") as sink:
            # `python -m` puts the working folder first on sys.path: the snapshot wins.
            proc = await asyncio.create_subprocess_exec(
                *args, env=env, stdout=sink, stderr=asyncio.subprocess.STDOUT, cwd=source
            )
        try:
            url = f"http://127.0.0.1:{port}"
            try:
                await _wait_ready(url, len(instances), proc)
            except RuntimeError as exc:
                tail = log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{exc}; gateway log:\n{tail}") from None
            yield GatewayProc(proc, url, log)
        finally:
            await _stop(proc)


def gateway_accepts(
    source: Path | None,
    *,
    extra: dict[str, dict[str, Any]] | None = None,
    channel: dict[str, Any] | None = None,
    instance_fields: dict[str, Any] | None = None,
) -> str | None:
    """None when `gateway --check` (from `source`, see gateway_process) accepts these
    configuration files, else the last line it printed: whether the gateway under test
    knows a setting a scenario wants."""
    with tempfile.TemporaryDirectory(prefix="loadtest-check-") as tmp:
        config, settings = gateway_files(
            Path(tmp),
            free_port(),
            ["http://127.0.0.1:9"],
            strategy="least_busy",
            max_num_seqs=1,
            extra=extra,
            channel=channel,
            instance_fields=instance_fields,
        )
        done = subprocess.run(
            [sys.executable, "-m", "gateway", "--config", str(config), "--settings", str(settings),
             "--check"],
            env={**os.environ, "GATEWAY_API_KEY": KEY}, cwd=source, capture_output=True,
            text=True, timeout=60, check=False,
        )  # fmt: skip
    if done.returncode == 0:
        return None
    lines = (done.stderr or done.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit status {done.returncode}"
