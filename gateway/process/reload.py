"""SIGHUP: read `config.toml` and `settings.json` again and apply them without a restart.

A reload never drops a request. The new files are read and validated first; if either
is bad, the old configuration stays and `reload_failed` says why. Otherwise each component
a reload changes takes the new `Config` through its own `apply(config)`: the proxy (and the
parts it builds: intake, relay, recorder), the upstream (and its pools), the token counter
and discovery; what they read per request changes from the next request on. Then
app.py's `apply_instances` hands the instance list to those it concerns: the dispatcher
(with the limits and health policy; the scheduler keeps the state of instances that stay),
the prober, the KV events listeners and the metrics.

Under `--workers` the supervisor reads and validates the files, once, and hands each
worker what it read through a pipe, which the worker applies as it arrives (`reload_from`):
every worker, and every worker it restarts later, serves the one configuration the
supervisor holds; a worker's own SIGHUP reads nothing behind the supervisor's back. The
same pipe carries the supervisor's liveness pings (`Ping`), which the worker's loop sends
straight back.

Some settings are fixed at start (the listening socket, the app's body limit, the
upstream pool, the strategy and its clock, metric names): a change to one of those is
logged as `reload_needs_restart` and the running value stays.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from aiohttp import web

from gateway.config.load import Config, ConfigError, load
from gateway.config.schema import ConfigFile, Settings
from gateway.fleet.drains import DrainTable
from gateway.observe import log
from gateway.server.app import apply_instances
from gateway.server.resources import (
    DISCOVERY,
    DISPATCHER,
    DRAINS,
    PROXY,
    TOKEN_COUNTER,
    UPSTREAM,
)

_log = log.get("gateway.reload")

# What the supervisor hands a worker on SIGHUP: the configuration to serve, or why the
# files were refused (the worker then counts a failed reload, as a single process would).
Pushed = Config | str

# Dotted paths (a prefix covers what is under it) that only a restart changes.
RESTART_ONLY = (
    "gateway.host",
    "gateway.port",
    "gateway.admin_host",
    "gateway.admin_port",
    "gateway.workers",  # the supervisor's
    "gateway.base_url",
    "gateway.max_connections",
    "gateway.max_body_bytes",
    "gateway.header_timeout",
    "gateway.idle_timeout",
    "gateway.max_client_connections",
    "dispatch.strategy",
    "dispatch.health_check_interval",
    "dispatch.prefix_index_blocks",
    "prefill.tag",
    "prefill.tokenizer",
    "slo",
    "channel.base_url",
    "vllm.tensor_parallel_size",
    "shared",  # the Redis connection and its keys are made once, at start
    "tracing",  # the span exporter likewise
)


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and path != "channel.headers":
            out.update(_flat(value, path + "."))
        else:
            out[path] = value
    return out


def _restart_only(path: str) -> bool:
    return any(path == p or path.startswith(p + ".") for p in RESTART_ONLY)


def _set(data: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for part in parents:
        data = data[part]
    data[last] = value


def merge(old: Config, new: Config) -> tuple[Config, list[str], list[str]]:
    """The configuration to run: `new`, but with the running value of what needs a restart.

    Returns it, the dotted paths that change live, and those that would need a restart.
    A listen address given on the command line still overrides the file's.
    """
    new = new.with_listen(*old.listen_override).with_workers(old.workers_override)
    old_file, new_file = old.file.model_dump(), new.file.model_dump()
    old_settings, new_settings = old.settings.model_dump(), new.settings.model_dump()
    old_flat = _flat(old_file) | _flat(old_settings)
    new_flat = _flat(new_file) | _flat(new_settings)
    changed = sorted(
        p for p in old_flat.keys() | new_flat.keys() if old_flat.get(p) != new_flat.get(p)
    )
    restart = [p for p in changed if _restart_only(p)]
    for path in restart:
        _set(new_file if path.split(".")[0] in new_file else new_settings, path, old_flat[path])
    config = new.model_copy(
        update={
            "file": ConfigFile.model_validate(new_file),
            "settings": Settings.model_validate(new_settings),
        }
    )
    return config, [p for p in changed if p not in restart], restart


def read_again(old: Config) -> Config:
    """Both files read and validated again (ConfigError if either is bad)."""
    # Started without a key means started with --open: a reload keeps that.
    return load(old.config_path, old.settings_path, allow_no_key=not old.keyed)


def reload(app: web.Application, pushed: Pushed | None = None) -> bool:
    """Apply the files read again (or what the supervisor `pushed`); False if they are bad.

    On False the running configuration stays.
    """
    proxy = app[PROXY]
    old = proxy.config
    try:
        if isinstance(pushed, str):
            raise ConfigError(pushed)
        new = read_again(old) if pushed is None else pushed
        config, changed, restart = merge(old, new)
    except (ConfigError, ValueError) as exc:
        _log.error("reload_failed", error=str(exc), kept="the running configuration")
        proxy.metrics.config_reloads.labels("failed").inc()
        proxy.metrics.config_last_reload_successful.set(0)
        return False
    if restart:
        _log.warning("reload_needs_restart", settings=restart, kept="the running values")
    before = app[DISPATCHER].instance_names()
    # Each component a reload changes takes its own part of `config` (docs/architecture.md).
    proxy.apply(config)
    app[UPSTREAM].apply(config)
    app[TOKEN_COUNTER].apply(config)
    # The discovered entries keep what they resolved; new ones resolve at the next round.
    app[DISCOVERY].apply(config)
    instances = app[DISCOVERY].instances()
    apply_instances(app, instances)
    names = {i.label for i in instances}
    proxy.metrics.config_reloads.labels("applied").inc()
    # The files on disk are not what runs while a setting waits for a restart: not a
    # success to alert on (docs/operations.md, Reload).
    proxy.waiting_for_restart = restart
    proxy.metrics.config_last_reload_successful.set(0 if restart else 1)
    proxy.metrics.serving(config.digest())
    _log.info(
        "reloaded",
        changed=changed,
        instances_added=sorted(names - before),
        instances_removed=sorted(before - names),
        instances=len(names),
    )
    return True


def reload_on_signal(app: web.Application) -> Callable[[], None]:
    """The SIGHUP handler: a reload runs on the event loop, between two requests' steps."""

    def handler() -> None:
        reload(app)

    return handler


@dataclass(frozen=True)
class Ping:
    """The supervisor asking a worker whether its event loop still turns: the loop that
    serves requests sends it straight back up the pipe, so a worker stuck in a loop (or
    stopped) does not answer and is replaced (workers.py)."""

    seq: int


def reload_from(app: web.Application, inbox: Connection) -> Callable[[], None]:
    """A worker's side of its pipe: a ping answered at once, the supervisor's drains and
    a reload applied on arrival (the newest, if several came); EOF (the supervisor is
    gone) stops listening."""

    def on_message() -> None:
        newest: Pushed | None = None
        try:
            while inbox.poll():
                message = inbox.recv()
                if isinstance(message, Ping):
                    inbox.send(message)
                elif isinstance(message, DrainTable):
                    app[DRAINS].apply_table(message.drained)
                else:
                    newest = message
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(inbox.fileno())
        if newest is not None:
            reload(app, newest)

    return on_message
