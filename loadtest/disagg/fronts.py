"""What a disaggregation benchmark sends its load through: a front before some instances.

A front is a function that, given the instances (URL and role), starts whatever stands
before them and yields the base URL to send to (without /v1); leaving the context stops it.
The roles are the gateway's (`vllm.instances[].role` in settings.json): `prefill` and
`decode` for a disaggregated fleet, `both` for instances that do it all.

- `direct`: one instance, nothing in between;
- `vllm-router-pd`: vLLM's Rust router in its PD mode (`--vllm-pd-disaggregation`): a
  request's prefill leg to a prefill instance (max_tokens 1, kv_transfer_params
  do_remote_decode), then its decode leg, with the params the prefill answered, to a decode
  instance, both picked round robin; it waits for every instance's /health at start;
- `vllm-router`: the same router in its plain mode, round robin over `both` instances;
- `gateway`: ours, `least_busy`, with each instance's role in its settings (a prefill and
  decode fleet disaggregates selectively; `both` instances colocate), judged by the same
  objectives as the benchmark (`[slo]`), every default feature on;
- `gateway-defaults`: ours with the roles and nothing else set: no `[slo]`, the default
  strategy and health interval.

A front that is not installed raises `baselines.Unavailable` before anything starts. The
gateway's front is one more entry in `FRONTS`.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from loadtest import baselines, harness
from loadtest.harness import _stop, free_port

Role = Literal["prefill", "decode", "both"]


@dataclass(frozen=True)
class Instance:
    url: str
    role: Role = "both"


Front = Callable[[Sequence[Instance]], contextlib.AbstractAsyncContextManager[str]]


def _urls(instances: Sequence[Instance], role: Role) -> list[str]:
    return [i.url for i in instances if i.role == role]


@contextlib.asynccontextmanager
async def direct(instances: Sequence[Instance]) -> AsyncIterator[str]:
    """One instance's own URL."""
    if len(instances) != 1:
        raise ValueError(f"the direct front takes one instance, got {len(instances)}")
    yield instances[0].url


@contextlib.asynccontextmanager
async def _router(args: Sequence[str]) -> AsyncIterator[str]:
    """vllm-router with `args` on a free loopback port, its log in a temp folder."""
    binary = baselines._vllm_router()
    if binary is None:
        raise baselines.Unavailable(baselines.missing("vllm-router") or "vllm-router")
    with tempfile.TemporaryDirectory(prefix="loadtest-router-") as tmp:
        port = free_port()
        log = Path(tmp) / "router.log"
        command = [
            binary,
            *args,
            "--host", "127.0.0.1",
            "--port", str(port),
            "--worker-startup-check-interval", "1",
            "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(free_port()),
            "--log-level", "warning",
        ]  # fmt: skip
        with log.open("wb") as sink:
            proc = await asyncio.create_subprocess_exec(
                *command, stdout=sink, stderr=asyncio.subprocess.STDOUT
            )
        try:
            url = f"http://127.0.0.1:{port}"
            await baselines._wait_http(url + "/health", proc, log)
            yield url
        finally:
            await _stop(proc)


def vllm_router_pd(instances: Sequence[Instance]) -> contextlib.AbstractAsyncContextManager[str]:
    """vllm-router's PD mode over the prefill and decode instances, round robin in each."""
    prefill, decode = _urls(instances, "prefill"), _urls(instances, "decode")
    if not prefill or not decode or len(prefill) + len(decode) != len(instances):
        raise ValueError("vllm-router-pd takes prefill and decode instances, at least one each")
    args = ["--vllm-pd-disaggregation", "--policy", "round_robin"]
    for url in prefill:
        args += ["--prefill", url]
    for url in decode:
        args += ["--decode", url]
    return _router(args)


def vllm_router(instances: Sequence[Instance]) -> contextlib.AbstractAsyncContextManager[str]:
    """vllm-router's plain mode, round robin over instances that do prefill and decode."""
    if not instances or any(i.role != "both" for i in instances):
        raise ValueError("vllm-router (round robin) takes `both` instances only")
    return _router(["--policy", "round_robin", "--worker-urls", *(i.url for i in instances)])


# The gateway's objectives: Figure 1's, and for the mixed workload's long prompts (the long
# lane, over 4,096 tokens) a first token within 2 s: their prefill alone takes about 1 s.
GATEWAY_SLO = {"ttft": 0.4, "tpot": 0.04, "long_ttft": 2.0, "long_tpot": 0.04}


@contextlib.asynccontextmanager
async def _ours(
    instances: Sequence[Instance], source: Path | None, **settings: dict[str, Any]
) -> AsyncIterator[str]:
    """The gateway before `instances`, each with its role and 64 slots, ready when all are
    up; `source`: the gateway package to run (`harness.exported_gateway`), else this one."""
    async with harness.gateway_process(
        [i.url for i in instances],
        source=source,
        strategy="least_busy",
        max_num_seqs=64,
        roles=[i.role for i in instances],
        **settings,
    ) as gw:
        yield gw.url


def gateway(
    instances: Sequence[Instance], source: Path | None = None
) -> contextlib.AbstractAsyncContextManager[str]:
    """Ours judged by the benchmark's own objectives (`[slo]`), rounds every 5 s."""
    return _ours(
        instances,
        source,
        slo=GATEWAY_SLO,
        gateway={"max_connections": 512},
        dispatch={"health_check_interval": 5.0},
    )


def gateway_defaults(
    instances: Sequence[Instance], source: Path | None = None
) -> contextlib.AbstractAsyncContextManager[str]:
    """Ours as a user first runs it: the roles and each instance's slots, nothing else set
    (no `[slo]`)."""
    return _ours(instances, source)


# The fronts that run our gateway: they also take the `source` to run it from.
GATEWAYS = {"gateway": gateway, "gateway-defaults": gateway_defaults}

FRONTS: dict[str, Front] = {
    "gateway": gateway,
    "gateway-defaults": gateway_defaults,
    "direct": direct,
    "vllm-router-pd": vllm_router_pd,
    "vllm-router": vllm_router,
}
