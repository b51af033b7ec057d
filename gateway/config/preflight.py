"""Checks that need the machine, not just the files: run by `--check` and before serving.

`schema.py` sees only what the files say. Two things only the operating system knows
make a valid configuration fail once it serves: a listen host this machine cannot bind,
and two instance host names that are one server. The first is an error; the second a
warning, since DNS may be down, slow or different where the gateway will run.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from gateway.config.load import Config, ConfigError
from gateway.config.schema import InstanceConfig
from gateway.config.urls import LOOPBACK, host_key, is_address

# A host name lookup at start-up waits no longer than this, all names together.
RESOLVE_TIMEOUT_S = 2.0

Resolve = Callable[[str], Iterable[str]]


def check(
    config: Config,
    *,
    host_from: str = "[gateway] host",
    port_from: str | None = None,
    resolve: Resolve | None = None,
) -> list[str]:
    """Raise `ConfigError` if the listen host cannot be bound; return warnings to show.

    The host is bound on port 0, so a gateway already serving on the configured port
    does not fail the check. `host_from` names where the host came from (the file's
    `[gateway] host` or `--host`). Given `port_from` (as `--check` does), a configured
    port that cannot be bound now is a warning, named by it. `resolve` stands in for
    getaddrinfo when instance host names are looked up.
    """
    host, port = config.gateway.host, config.gateway.port
    problem = bind_problem(host, 0)
    if problem:
        raise ConfigError(f"{host_from}: cannot listen on {host!r}: {problem}")
    warnings = []
    if port_from and port:
        problem = bind_problem(host, port)
        if problem:
            warnings.append(
                f"{port_from}: port {port} on {host!r} cannot be bound now: {problem}; "
                "serving will fail until it is free"
            )
    gateway = config.gateway
    if gateway.admin_port is not None:
        admin_host = gateway.admin_host or host
        problem = bind_problem(admin_host, 0)
        if problem:
            raise ConfigError(f"[gateway] admin_host: cannot listen on {admin_host!r}: {problem}")
        problem = bind_problem(admin_host, gateway.admin_port) if gateway.admin_port else None
        if problem and port_from:
            warnings.append(
                f"[gateway] admin_port: port {gateway.admin_port} on {admin_host!r} cannot "
                f"be bound now: {problem}; serving will fail until it is free"
            )
    where = f"{config.settings_path}: vllm.instances"
    warnings += shared_addresses(config.instances, where, resolve_all(config.instances, resolve))
    warnings += weak_keys(config)
    return warnings


# Shorter keys can be guessed; these are what sample files ship and people forget.
MIN_KEY_LENGTH = 16
PLACEHOLDER_KEYS = frozenset(
    {"change-me", "changeme", "change_me", "secret", "password", "your-key", "your-api-key",
     "sk-local", "sk-xxx", "test", "example", "key"}
)  # fmt: skip


def weak_keys(config: Config) -> list[str]:
    """A warning for each key that is a known placeholder or shorter than MIN_KEY_LENGTH.

    The warning names a unified key by its position, a `channel.keys` entry by its name,
    never a key by its value.
    """
    keys = [(f"the unified key #{n}", k) for n, k in enumerate(config.api_keys, start=1)]
    keys += [(f"the key {k.entry.name!r}", k.secret) for k in config.named_keys]
    warnings = []
    for whose, secret in keys:
        key = secret.get_secret_value()
        if key.strip().lower() in PLACEHOLDER_KEYS:
            why = "a placeholder from a sample file"
        elif len(key) < MIN_KEY_LENGTH:
            why = f"{len(key)} characters, under {MIN_KEY_LENGTH}"
        else:
            continue
        warnings.append(f"{whose} is weak ({why}): anyone may guess it")
    return warnings


def bind_problem(host: str, port: int) -> str | None:
    """Why a listener on (host, port) cannot be bound here, or None if it can.

    Binds every address the host resolves to, as asyncio's `create_server` does, with
    SO_REUSEADDR as it sets it, and closes them at once.
    """
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        return f"cannot resolve it ({exc.strerror})"
    for family, kind, proto, _, address in infos:
        try:
            sock = socket.socket(family, kind, proto)
        except OSError:
            continue  # a family this machine lacks: asyncio skips it too
        with sock:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
            except OSError as exc:
                reason = exc.strerror or errno.errorcode.get(exc.errno or 0, str(exc))
                return reason if address[0] == host else f"{reason} (address {address[0]})"
    return None


def resolve_all(
    instances: Sequence[InstanceConfig],
    resolve: Resolve | None = None,
    timeout: float = RESOLVE_TIMEOUT_S,
) -> dict[str, frozenset[str]]:
    """The addresses each instance host name resolves to, for those that answer in time.

    IP literals and loopback names need no lookup (`endpoint` already normalised them).
    Each lookup runs in a daemon thread: a resolver that hangs delays start-up by at most
    `timeout` and never keeps the process alive; a name that fails is simply left out.
    """
    lookup = resolve or _getaddrinfo
    names = {spec.endpoint[0] for spec in instances} - {LOOPBACK}
    found: dict[str, frozenset[str]] = {}
    lock = threading.Lock()

    def work(name: str) -> None:
        try:
            addresses = frozenset(host_key(a) for a in lookup(name))
        except (OSError, UnicodeError, ValueError):
            return
        with lock:
            found[name] = addresses

    threads = [
        threading.Thread(target=work, args=(name,), daemon=True, name=f"resolve {name}")
        for name in sorted(names)
        if not is_address(name)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    with lock:
        return dict(found)


def shared_addresses(
    instances: Sequence[InstanceConfig], where: str, resolved: dict[str, frozenset[str]]
) -> list[str]:
    """A warning for each pair of instances whose names resolve to one address and port."""
    warnings = []
    for j, later in enumerate(instances):
        for i, earlier in enumerate(instances[:j]):
            (host_i, port_i), (host_j, port_j) = earlier.endpoint, later.endpoint
            if port_i != port_j or host_i == host_j:
                continue  # the same host and port is an error schema.py already raised
            common = _addresses(host_i, resolved) & _addresses(host_j, resolved)
            if common:
                warnings.append(
                    f"{where}[{j}] {later.url!r} and [{i}] {earlier.url!r} both reach "
                    f"{min(common)} port {port_j}: if they are one instance, list it once "
                    "(it would get twice its share of requests)"
                )
                break
    return warnings


def _addresses(host: str, resolved: dict[str, frozenset[str]]) -> frozenset[str]:
    if host == LOOPBACK or is_address(host):
        return frozenset({host})
    return resolved.get(host, frozenset())


def _getaddrinfo(name: str) -> list[str]:
    infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]
