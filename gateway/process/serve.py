"""Runs the gateway: bind, serve, reload on SIGHUP (or a file change: watch.py), and drain
on SIGINT/SIGTERM.

Shutdown order: readiness turns 503 for `drain_delay` seconds while everything is still
served and new connections are still accepted; then the listening socket closes,
requests still queued in the gateway get 503 with Retry-After, and requests in progress
get up to `drain_timeout` seconds to finish; then resources close. A second SIGTERM or
SIGINT during the drain ends it at once (what is still running is ended as at the
deadline).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from urllib.parse import urlsplit

from aiohttp import web

from gateway.config.load import Config
from gateway.lifecycle import Lifecycle
from gateway.observe import log
from gateway.process import watch
from gateway.process.reload import reload_from, reload_on_signal
from gateway.server.app import build_app
from gateway.server.resources import DISPATCHER, DRAINS, PROXY
from gateway.server.runner import GatewayRunner, make_runner

_log = log.get("gateway.server")
SIMULATED_CACHE_TOKENS = 450_000


async def start_simulated(config: Config) -> list[object]:
    """One simulated vLLM instance per configured URL, on that URL's loopback port."""
    from gateway.sim.sim_fleet import start_fleet  # only --simulate needs the simulator
    from gateway.sim.sim_vllm import SimConfig

    configs, ports = [], []
    # A fleet with prefill and decode roles runs vLLM's KV connector on every instance (kv_both,
    # as vLLM's disaggregated deployments do): without it a prefill hop gets no
    # kv_transfer_params back and every long prompt falls back to one hop (no_params).
    disaggregated = any(spec.role != "both" for spec in config.instances)
    for spec in config.instances:
        parts = urlsplit(spec.url)
        host = parts.hostname or ""
        if host not in ("127.0.0.1", "localhost", "::1") and not host.startswith("127."):
            raise SystemExit(f"--simulate binds only loopback addresses; {spec.url} is not one")
        ports.append(parts.port or 80)
        tp = config.settings.vllm.tensor_parallel_size
        # An entry that listens to KV events gets an instance that publishes them, from a
        # prefix cache (an 8B model's on one 80 GB card: about 450k tokens), so the gateway's
        # listener and index run against vLLM's wire as they would in production.
        events = spec.kv_events
        configs.append(
            SimConfig(
                prefix_cache_blocks=0 if events is None else SIMULATED_CACHE_TOKENS // 16,
                kv_events_endpoint=None if events is None else events.endpoint,
                kv_events_replay_endpoint=None if events is None else events.replay_endpoint,
                kv_events_topic="" if events is None else events.topic,
                model=config.channel.default_model or "sim-model",
                max_num_seqs=spec.max_num_seqs or config.dispatch.max_num_seqs,
                scheduling_policy=spec.scheduling_policy,
                # A tensor-parallel group of N cards prefills about N times faster.
                prefill_tokens_per_s=SimConfig.prefill_tokens_per_s * tp,
                kv_transfer=disaggregated,
                # vLLM's limit for a request that names none (Codex CLI sends no
                # max_output_tokens): the rest of the context; answers end on their own.
                default_max_tokens=None,
            )
        )
    return list(await start_fleet(configs, ports=ports))


def _a_workers_sighup() -> None:
    _log.info("reload_skipped", reason="a worker applies what the supervisor hands it")


def _too_early() -> None:
    _log.warning("reload_skipped", reason="SIGHUP before the gateway finished starting")


async def serve(
    config: Config,
    *,
    simulate: bool = False,
    on_ready: Callable[[str], None] | None = None,
    lifecycle: Lifecycle | None = None,
    inbox: Connection | None = None,
) -> None:
    """Serve until a stop signal; `inbox` (a worker's): the supervisor's reloads."""
    lifecycle = lifecycle or Lifecycle()
    # SIGHUP's default action kills the process: handle it from the start, and reload
    # once there is something to reload.
    on_hup: list[Callable[[], None]] = [_too_early]
    with lifecycle.signals(on_hup=lambda: on_hup[0]()):
        sims = await start_simulated(config) if simulate else []
        for sim in sims:
            _log.info("simulated_instance_started", url=getattr(sim, "url", "?"))
        app = build_app(config, lifecycle)
        if inbox is None:  # a worker's files are watched by its supervisor
            app.cleanup_ctx.append(watch.reloading())
        runner = make_runner(app, config.gateway.drain_timeout)
        await runner.setup()
        if inbox is None:
            on_hup[0] = reload_on_signal(app)
        else:
            on_hup[0] = _a_workers_sighup
            if config.file.shared.redis_url is None:
                # The supervisor holds the drains then; with [shared], Redis does.
                app[DRAINS].upward = inbox.send
            apply = reload_from(app, inbox)
            asyncio.get_running_loop().add_reader(inbox.fileno(), apply)
            apply()  # what came while this worker was starting
        try:
            host, port = await runner.listen(
                config.gateway.host, config.gateway.port, reuse_port=config.gateway.workers > 1
            )
            url = f"http://{host}:{port}"
            _log.info("listening", url=url, instances=len(config.instances))
            gateway = config.gateway
            if gateway.admin_port is not None:
                admin_host, admin_port = await runner.listen_admin(
                    gateway.admin_host or gateway.host,
                    gateway.admin_port,
                    reuse_port=gateway.workers > 1,
                )
                _log.info("listening_admin", url=f"http://{admin_host}:{admin_port}")
            if on_ready:
                on_ready(url)
            await lifecycle.stopping.wait()
            await _drain(app, runner, lifecycle)
        finally:
            on_hup[0] = _too_early
            await runner.cleanup()
            if sims:
                from gateway.sim.sim_fleet import stop_fleet

                await stop_fleet(sims)  # type: ignore[arg-type]
            _log.info("stopped")


async def _drain(app: web.Application, runner: GatewayRunner, lifecycle: Lifecycle) -> None:
    """The drain after the first stop signal; a second one ends it at once.

    For `drain_delay` s only readiness changes (503), so a load balancer stops sending
    before anything is refused; then the listener closes, queued requests get 503, and
    requests in progress get `drain_timeout` s.
    """
    gateway = app[PROXY].config.gateway  # as reloaded: the drain times may have changed
    _log.info("draining", drain_delay_s=gateway.drain_delay, drain_timeout_s=gateway.drain_timeout)
    lifecycle.draining = True
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(gateway.drain_delay):
            await lifecycle.forced.wait()
    runner.stop_listening()  # no new connections; open ones finish their requests
    _log.info("listener_closed")
    app[DISPATCHER].close()
    ended = await lifecycle.drain(gateway.drain_timeout)
    if lifecycle.forced.is_set():
        _log.warning("drain_forced", reason="a second stop signal")
    _log.info("drained", ended_at_deadline=ended)


def serve_here(
    config: Config,
    *,
    simulate: bool = False,
    inbox: Connection | None = None,
) -> int:
    """Serve in this process until a stop signal; the process's exit status."""
    main = serve(config, simulate=simulate, inbox=inbox)
    try:
        import uvloop

        uvloop.run(main)
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        asyncio.run(main)
    except OSError as exc:
        print(f"gateway: cannot listen: {exc}", file=sys.stderr)
        return 1
    return 0
