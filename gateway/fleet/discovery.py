"""Instances found by DNS: an entry with `"discover": "dns"` stands for every address its
URL's host name resolves to.

`{"url": "http://vllm-headless.ns.svc:8000", "discover": "dns", "role": "decode"}` is, every
`[dispatch] discovery_interval` seconds, one instance per address the name has (a Kubernetes
headless Service answers with its ready pods' addresses), each with the entry's other
fields, named by its address and port (`10.0.0.5:8000`, or `decode@10.0.0.5:8000` for an
entry named `decode`) in logs, metrics and /admin/instances. The rules, as Envoy's
STRICT_DNS cluster and nginx's `resolve` have them:

- an address that appears is added as a reload adds an instance: probed at once, traffic
  once up; one that goes away takes no new request and its streams in flight finish;
- a resolver that fails (timeout, SERVFAIL, no network) keeps the entry's last good set:
  counted, logged once when it starts and once when it ends, shown in /admin/instances;
- an empty answer (the name has no address: every pod gone, or NXDOMAIN) empties the
  entry only once it has held for `EMPTY_ROUNDS` rounds in a row: a rollout's brief gap,
  or one resolver's stale answer, does not drop the fleet;
- the system's resolver (getaddrinfo: /etc/hosts, the pod's resolv.conf search domains)
  unless a test injects its own. A host named as SRV records are, `_service._proto.name`
  (RFC 2782: no host name starts with `_`), is looked up as SRV (with the `dns` extra,
  dnspython, which reads the same resolv.conf): each target's addresses with the record's
  port, so instances on different ports are found too. SRV's priority and weight are not
  read: every target is an instance (the entry's `weight` is each one's). A cache in
  front of the resolver (nscd, systemd-resolved, a node-local DNS cache) may hold an
  answer up to the record's TTL (Kubernetes: 30 s by default) beyond the interval.

Under `--workers` each worker resolves on its own, and with `[shared]` each replica: all
see the same addresses within an interval, as they all ask the same DNS.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import ipaddress
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from gateway.config.load import Config
from gateway.config.schema import InstanceConfig
from gateway.config.urls import endpoint, without_credentials
from gateway.observe import log

_log = log.get("gateway.discovery")

EMPTY_ROUNDS = 3  # rounds in a row an empty answer must hold before it empties an entry
MAX_ADDRESSES = 256  # per entry: a name that answers more is cut (and says so)

HostPort = tuple[str, int]


class ResolveFailed(Exception):
    """The resolver could not answer (timeout, server failure): not "no such address"."""


# (host, port) -> the addresses and ports it stands for now; [] when the name has none.
Resolver = Callable[[str, int], Awaitable[list[HostPort]]]


async def system_resolver(host: str, port: int) -> list[HostPort]:
    """getaddrinfo, as every other client on the machine resolves (an SRV name's records
    through `srv_lookup`): [] for a name with no address (NXDOMAIN, NODATA), ResolveFailed
    for a resolver that did not answer."""
    if is_srv_name(host):
        return await srv_lookup(host)
    return await address_lookup(host, port)


def is_srv_name(host: str) -> bool:
    """`_service._proto.name`: an SRV record's name (RFC 2782); no host name starts so."""
    return host.startswith("_")


async def srv_lookup(host: str, dns_resolver: Any = None) -> list[HostPort]:
    """The SRV records of `host`: each target's addresses (getaddrinfo), with its port.
    `dns_resolver`: a dnspython asyncresolver.Resolver (default: the host's resolv.conf)."""
    import dns.asyncresolver  # the `dns` extra: config.load refuses an SRV name without it
    import dns.exception
    import dns.resolver

    resolver = dns_resolver or _default_dns_resolver()
    try:
        answer = await resolver.resolve(host, "SRV", search=True)
    except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
        return []
    except dns.exception.DNSException as exc:
        raise ResolveFailed(str(exc) or type(exc).__name__) from exc
    found: set[HostPort] = set()
    for record in answer:
        target = record.target.to_text(omit_final_dot=True)
        if target in ("", "."):  # "." says: no such service here (RFC 2782)
            continue
        found.update(await address_lookup(target, int(record.port)))
    return sorted(found)


@functools.cache
def _default_dns_resolver() -> Any:
    import dns.asyncresolver

    return dns.asyncresolver.Resolver()  # reads /etc/resolv.conf once


async def address_lookup(host: str, port: int) -> list[HostPort]:
    """getaddrinfo's addresses of `host`, each with `port`."""
    no_address = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in no_address:
            return []
        raise ResolveFailed(str(exc)) from exc
    except OSError as exc:
        raise ResolveFailed(str(exc)) from exc
    return sorted({(str(info[4][0]), int(info[4][1])) for info in infos})


@dataclass(frozen=True)
class EntryState:
    """What one discovered entry stands for now, and how its resolution goes."""

    addresses: tuple[HostPort, ...] = ()
    empty_rounds: int = 0  # empty answers in a row (the set stays until EMPTY_ROUNDS)
    error: str | None = None  # the resolver's failure while it lasts
    failing_since: float | None = None  # wall clock
    failures_total: int = 0
    resolved_at: float | None = None  # wall clock of the last answer, empty or not


def next_state(
    state: EntryState, answer: Sequence[HostPort] | ResolveFailed, now: float
) -> EntryState:
    """The entry after one round's answer (pure)."""
    if isinstance(answer, ResolveFailed):
        return dataclasses.replace(
            state,
            error=str(answer) or type(answer).__name__,
            failing_since=state.failing_since if state.failing_since is not None else now,
            failures_total=state.failures_total + 1,
        )
    healed = dataclasses.replace(state, error=None, failing_since=None, resolved_at=now)
    if answer:
        return dataclasses.replace(healed, addresses=tuple(sorted(set(answer))), empty_rounds=0)
    empty = state.empty_rounds + 1
    kept = state.addresses if empty < EMPTY_ROUNDS else ()
    return dataclasses.replace(healed, addresses=kept, empty_rounds=empty)


def host_port(address: HostPort) -> str:
    host, port = address
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    return f"{host}:{port}"


def instances_of(
    entries: Sequence[InstanceConfig], states: dict[str, EntryState]
) -> list[InstanceConfig]:
    """The instances the entries stand for now: a static one as it is, a discovered one once
    per address (pure). An address that another entry already lists is not listed twice."""
    out: list[InstanceConfig] = []
    seen = {endpoint(e.url) for e in entries if e.discover is None}
    for entry in entries:
        if entry.discover is None:
            out.append(entry)
            continue
        state = states.get(entry.url, EntryState())
        parts = urlsplit(entry.url)
        userinfo = parts.netloc.rpartition("@")[0]
        for address in state.addresses[:MAX_ADDRESSES]:
            where = host_port(address)
            url = urlunsplit(
                (parts.scheme, f"{userinfo}@{where}" if userinfo else where, "", "", "")
            )
            if endpoint(url) in seen:
                continue
            seen.add(endpoint(url))
            name = f"{entry.name}@{where}" if entry.name else where
            out.append(entry.model_copy(update={"url": url, "name": name, "discover": None}))
    return out


class Discovery:
    """Resolves the discovered entries every `interval` and hands each new instance list
    to `on_change` (the app applies it as a reload applies one)."""

    def __init__(
        self,
        entries: Sequence[InstanceConfig],
        interval: float,
        resolver: Resolver = system_resolver,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.entries = list(entries)
        self.interval = interval
        self.resolver = resolver
        self.clock = clock
        self.states: dict[str, EntryState] = {}
        self.on_change: Callable[[list[InstanceConfig]], None] | None = None
        self.on_failure: Callable[[InstanceConfig], None] | None = None  # counts it
        self._current = instances_of(self.entries, self.states)
        self._wake = asyncio.Event()  # a round now rather than at the interval

    @property
    def active(self) -> bool:
        return any(e.discover is not None for e in self.entries)

    def instances(self) -> list[InstanceConfig]:
        return list(self._current)

    def entry_states(self) -> list[tuple[InstanceConfig, EntryState]]:
        """Each discovered entry and how its resolution goes, for /admin/instances."""
        return [
            (e, self.states.get(e.url, EntryState()))
            for e in self.entries
            if e.discover is not None
        ]

    def apply(self, config: Config) -> None:
        """A reload's entries (`vllm.instances`) and `dispatch.discovery_interval`: an entry
        that stays (by URL) keeps what it resolved; `instances()` is the list now."""
        self.entries, self.interval = list(config.instances), config.dispatch.discovery_interval
        urls = {e.url for e in self.entries if e.discover is not None}
        if urls - self.states.keys():
            self._wake.set()  # a new entry stands for nothing until it is resolved
        self.states = {url: s for url, s in self.states.items() if url in urls}
        self._current = instances_of(self.entries, self.states)

    async def run_round(self) -> bool:
        """Resolve every discovered entry once; whether the instance list changed."""
        discovered = [e for e in self.entries if e.discover is not None]
        answers = await asyncio.gather(*(self._resolve(e) for e in discovered))
        now = self.clock()
        for entry, answer in zip(discovered, answers, strict=True):
            before = self.states.get(entry.url, EntryState())
            after = next_state(before, answer, now)
            self.states[entry.url] = after
            self._log_transition(entry, before, after)
        current = instances_of(self.entries, self.states)
        if current == self._current:
            return False
        added = sorted({i.label for i in current} - {i.label for i in self._current})
        removed = sorted({i.label for i in self._current} - {i.label for i in current})
        self._current = current
        _log.info("instances_discovered", added=added, removed=removed, instances=len(current))
        if self.on_change is not None:
            self.on_change(self.instances())
        return True

    async def run_forever(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval):
                    await self._wake.wait()
            self._wake.clear()
            try:
                await self.run_round()
            except Exception:  # never the end of discovery; the last set stays
                _log.exception("discovery_round_failed")

    async def _resolve(self, entry: InstanceConfig) -> list[HostPort] | ResolveFailed:
        host, port = _name_and_port(entry.url)
        try:
            async with asyncio.timeout(max(1.0, min(self.interval, 10.0))):
                return list(await self.resolver(host, port))
        except ResolveFailed as exc:
            return exc
        except TimeoutError:
            return ResolveFailed("timed out")

    def _log_transition(self, entry: InstanceConfig, before: EntryState, after: EntryState) -> None:
        where = without_credentials(entry.url)
        if after.error is not None:
            if self.on_failure is not None:
                self.on_failure(entry)
            if before.error is None:
                _log.warning(
                    "discovery_failed", entry=where, error=after.error, kept=len(after.addresses)
                )
        elif before.error is not None:
            _log.info("discovery_recovered", entry=where, addresses=len(after.addresses))
        if after.empty_rounds == 1 and before.addresses:
            _log.warning(
                "discovery_empty", entry=where, kept=len(after.addresses), rounds=EMPTY_ROUNDS
            )


def _name_and_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    host = parts.hostname or ""
    return host, parts.port or (443 if parts.scheme == "https" else 80)
