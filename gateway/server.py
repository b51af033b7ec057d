"""Runs the gateway: bind, serve, and drain on SIGINT/SIGTERM; SIGHUP is logged and ignored.

Shutdown order: readiness turns 503 and the listening socket closes; requests still
queued in the gateway get 503 with Retry-After; streams already started get up to
`drain_timeout` seconds to finish; then resources close.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable
from urllib.parse import urlsplit

from . import log
from .app import DISPATCHER, LIFECYCLE, PROXY, build_app
from .config import Config
from .runner import make_runner

_log = log.get("gateway.server")


async def start_simulated(config: Config) -> list[object]:
    """One simulated vLLM instance per configured URL, on that URL's loopback port."""
    from loadtest.fleet import start_fleet  # only --simulate needs the simulator
    from loadtest.sim_vllm import SimConfig

    configs, ports = [], []
    for spec in config.instances:
        parts = urlsplit(spec.url)
        host = parts.hostname or ""
        if host not in ("127.0.0.1", "localhost", "::1") and not host.startswith("127."):
            raise SystemExit(f"--simulate binds only loopback addresses; {spec.url} is not one")
        ports.append(parts.port or 80)
        tp = config.settings.vllm.tensor_parallel_size
        configs.append(
            SimConfig(
                model=config.channel.default_model or "sim-model",
                max_num_seqs=spec.max_num_seqs or config.dispatch.max_num_seqs,
                # A tensor-parallel group of N cards prefills about N times faster.
                prefill_tokens_per_s=SimConfig.prefill_tokens_per_s * tp,
            )
        )
    return list(await start_fleet(configs, ports=ports))


def _sighup_ignored() -> None:
    _log.warning("sighup_ignored", reason="reload is not supported yet; SIGTERM stops")


async def serve(
    config: Config,
    *,
    simulate: bool = False,
    on_ready: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    # SIGHUP's default action kills the process mid-stream. Until it reloads the
    # configuration, a terminal closing or a stray `kill -HUP` must change nothing.
    hup = getattr(signal, "SIGHUP", None)  # absent on Windows
    if hup is not None:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(hup, _sighup_ignored)
    sims = await start_simulated(config) if simulate else []
    for sim in sims:
        _log.info("simulated_instance_started", url=getattr(sim, "url", "?"))
    app = build_app(config)
    runner = make_runner(app, config.gateway.drain_timeout)
    await runner.setup()
    try:
        host, port = await runner.listen(
            config.gateway.host, config.gateway.port, reuse_port=config.gateway.workers > 1
        )
        url = f"http://{host}:{port}"
        _log.info("listening", url=url, instances=len(config.instances))
        if on_ready:
            on_ready(url)
        await stop.wait()
        _log.info("draining", drain_timeout_s=config.gateway.drain_timeout)
        app[LIFECYCLE].draining = True
        runner.stop_listening()  # no new connections; open ones finish their requests
        app[DISPATCHER].close()
        ended = await app[PROXY].drain(config.gateway.drain_timeout)
        _log.info("drained", ended_at_deadline=ended)
    finally:
        await runner.cleanup()
        if sims:
            from loadtest.fleet import stop_fleet

            await stop_fleet(sims)  # type: ignore[arg-type]
        _log.info("stopped")
