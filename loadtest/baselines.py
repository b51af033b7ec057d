"""Fronts other than the gateway, started on loopback by the `prefix` benchmark.

- `sticky`: our re-implementation of the routers' `cache_aware` rule (loadtest/sticky.py);
- `nginx`: nginx's `least_conn` upstream, as a user of Debian's `nginx-light` would set it
  up (one process, keep-alive to the instances, no buffering of the streams);
- `vllm-router`: vLLM's Rust router from `pip install vllm-router`, `--policy cache_aware`
  with its default thresholds; `vllm-router-rr`: the same router's cheapest policy,
  `round_robin`, what a user picks who wants only a fast front;
- `floor-aiohttp`, `floor-httptools`: not fronts to pick but the least a Python forwarder
  on our HTTP client costs, on aiohttp's server and on a bare httptools one
  (loadtest/floor.py), for `overhead`.

Each is its own process (pinned where the gateway would be) and yields its base URL
(without /v1). One that is not installed raises `Unavailable` before anything starts:
the benchmark says so in one line and goes on without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from loadtest.harness import _stop, free_port, pin_prefix

_STARTUP_LIMIT = 30.0
BASELINES = ("sticky", "nginx", "vllm-router", "vllm-router-rr", "floor-aiohttp", "floor-httptools")


class Unavailable(RuntimeError):
    """A baseline that is not installed here."""


def _nginx() -> str | None:
    found = shutil.which("nginx")
    if found:
        return found
    return next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).exists()), None)


def _vllm_router() -> str | None:
    beside = Path(sys.executable).parent / "vllm-router"
    return str(beside) if beside.exists() else shutil.which("vllm-router")


def missing(name: str) -> str | None:
    """Why the baseline `name` cannot run here, or None when it can."""
    if name == "nginx" and _nginx() is None:
        return "nginx is not installed (apt-get install nginx-light)"
    if name.startswith("vllm-router") and _vllm_router() is None:
        return "vllm-router is not installed (pip install -e '.[baselines]')"
    return None


def _tail(log: Path | None) -> str:
    return log.read_text(errors="replace")[-1500:] if log and log.exists() else ""


async def _wait_http(url: str, proc: asyncio.subprocess.Process, log: Path | None) -> None:
    """Until GET url answers 200 (bounded by _STARTUP_LIMIT)."""
    deadline = time.monotonic() + _STARTUP_LIMIT
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            if proc.returncode is not None:
                tail = _tail(log)
                raise RuntimeError(f"{url} exited with status {proc.returncode}: {tail}")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with http.get(url) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} was not ready within {_STARTUP_LIMIT} s")


@contextlib.asynccontextmanager
async def python_front(
    module: str,
    options: Sequence[str],
    instances: Sequence[str],
    *,
    core: int | None,
    pids: list[int] | None = None,
) -> AsyncIterator[str]:
    """`python -m <module> <options> --instances ...`, which prints its URL once serving;
    yields that URL."""
    args = [*pin_prefix(core), sys.executable, "-m", module, *options]
    proc = await asyncio.create_subprocess_exec(
        *args, "--instances", *instances, stdout=asyncio.subprocess.PIPE
    )
    if pids is not None:  # taskset execs the interpreter: the pid is the front's
        pids.append(proc.pid)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), _STARTUP_LIMIT)
        if not line:
            raise RuntimeError(f"{module} exited with status {await proc.wait()}")
        url = line.decode().strip()
        await _wait_http(url + "/health", proc, None)
        yield url
    finally:
        await _stop(proc)


def nginx_conf(folder: Path, port: int, instances: Sequence[str]) -> str:
    """One nginx process, `least_conn` over `instances`, streams passed on unbuffered."""
    servers = "\n".join(f"        server {urlsplit(u).netloc};" for u in instances)
    return f"""
daemon off;
master_process off;
worker_processes 1;
pid {folder}/nginx.pid;
error_log {folder}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {folder}/body;
    proxy_temp_path {folder}/proxy;
    client_max_body_size 64m;
    client_body_buffer_size 1m;
    upstream fleet {{
        least_conn;
{servers}
        keepalive 256;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://fleet;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 600s;
            add_header X-Gateway-Instance $upstream_addr always;
        }}
    }}
}}
"""


@contextlib.asynccontextmanager
async def nginx_process(
    instances: Sequence[str],
    *,
    core: int | None,
    pids: list[int] | None = None,
    port: int | None = None,
) -> AsyncIterator[str]:
    """nginx with `least_conn` before `instances` on `port` (a free one by default), config
    in a temp folder; yields its URL."""
    binary = _nginx()
    if binary is None:
        raise Unavailable(missing("nginx") or "nginx")
    with tempfile.TemporaryDirectory(prefix="loadtest-nginx-") as tmp:
        folder = Path(tmp)
        port = port or free_port()
        conf = folder / "nginx.conf"
        conf.write_text(nginx_conf(folder, port, instances))
        log = folder / "error.log"
        args = [*pin_prefix(core), binary, "-p", tmp, "-c", str(conf), "-e", str(log)]
        proc = await asyncio.create_subprocess_exec(
            *args, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
        )
        if pids is not None:  # taskset execs the binary: the pid is nginx's
            pids.append(proc.pid)
        try:
            url = f"http://127.0.0.1:{port}"
            await _wait_http(url + "/health", proc, log)
            yield url
        finally:
            await _stop(proc)


@contextlib.asynccontextmanager
async def vllm_router_process(
    instances: Sequence[str],
    *,
    core: int | None,
    pids: list[int] | None = None,
    policy: str = "cache_aware",
    port: int | None = None,
) -> AsyncIterator[str]:
    """vLLM's Rust router, `--policy <policy>` with its defaults, on `port` (a free one by
    default); yields its URL."""
    binary = _vllm_router()
    if binary is None:
        raise Unavailable(missing("vllm-router") or "vllm-router")
    with tempfile.TemporaryDirectory(prefix="loadtest-router-") as tmp:
        port = port or free_port()
        log = Path(tmp) / "router.log"
        args = [
            *pin_prefix(core),
            binary,
            "--host", "127.0.0.1",
            "--port", str(port),
            "--policy", policy,
            "--worker-startup-check-interval", "1",
            "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(free_port()),
            "--log-level", "warning",
            "--worker-urls", *instances,
        ]  # fmt: skip
        with log.open("wb") as sink:
            proc = await asyncio.create_subprocess_exec(
                *args, stdout=sink, stderr=asyncio.subprocess.STDOUT
            )
        if pids is not None:
            pids.append(proc.pid)
        try:
            url = f"http://127.0.0.1:{port}"
            await _wait_http(url + "/health", proc, log)
            yield url
        finally:
            await _stop(proc)


def front(
    name: str,
    instances: Sequence[str],
    *,
    core: int | None,
    seed: int,
    pids: list[int] | None = None,
    port: int | None = None,
) -> contextlib.AbstractAsyncContextManager[str]:
    """The context manager that starts baseline `name` before `instances`; the process id
    of nginx, vllm-router and the floors is appended to `pids` (for their CPU time).
    `port`: where nginx or vllm-router listens (a front started again keeps its address);
    the Python fronts take a free one and refuse a `port`."""
    if port is not None and name not in ("nginx", "vllm-router", "vllm-router-rr"):
        raise ValueError(f"baseline {name!r} takes no port: it cannot be started again in place")
    if name == "sticky":
        return python_front("loadtest.sticky", ["--seed", str(seed)], instances, core=core)
    if name.startswith("floor-"):
        server = ["--server", name.removeprefix("floor-")]
        return python_front("loadtest.floor", server, instances, core=core, pids=pids)
    if name == "nginx":
        return nginx_process(instances, core=core, pids=pids, port=port)
    if name == "vllm-router":
        return vllm_router_process(instances, core=core, pids=pids, port=port)
    if name == "vllm-router-rr":
        return vllm_router_process(instances, core=core, pids=pids, policy="round_robin", port=port)
    raise ValueError(f"unknown baseline {name!r}; known: {', '.join(BASELINES)}")
