"""`gateway --workers N`: N processes serving one port, and the parent that supervises them.

One Python event loop relays about one core's worth of streams; N workers use N cores.
Like uvicorn's and gunicorn's workers:

- The parent validates the configuration once (cli.py), reserves the port (a socket
  bound with SO_REUSEPORT but not listening: port 0 becomes a real port every worker
  binds, and nobody else takes the port while a worker restarts), then starts N workers.
  Each runs the single-process server (process/serve.py) on that host and port with
  SO_REUSEPORT: the kernel spreads new connections among the listening workers.
  Without SO_REUSEPORT (Windows) `--workers` above 1 is refused at start with a message
  (`WorkersUnsupported`): handing one listening socket to every worker would work there,
  but untested code on a platform we do not run is worse than a clear refusal.
- Workers are started with multiprocessing's "spawn" context, the validated `Config`
  passed to each as an argument (pickled through a pipe: secrets never reach argv or the
  environment). Spawn rather than fork: a fresh interpreter shares no event loop, thread
  or open connection with the parent; rather than re-running `python -m gateway` with an
  internal flag: the workers serve exactly the configuration the parent checked, with no
  second command line to keep in step.
- A worker that dies (any exit while the parent is not stopping) is logged
  (`worker_died`, with its exit code: negative is the signal that killed it) and
  restarted (`worker_started`), after `restart_delay` when it died young, so a worker
  that crashes at start does not spin.
- A worker whose event loop stops turning is replaced too: the parent pings each worker
  down its pipe every `PING_INTERVAL` s; one that leaves a ping unanswered for
  `PING_TIMEOUT` s (`STARTUP_GRACE` for its first) is logged (`worker_unresponsive`) and
  killed, then restarted as a worker that died.
- SIGTERM or SIGINT: forwarded to every worker as SIGTERM; each drains as a single
  process does (readiness 503, listener closed, `drain_timeout` for streams). The parent
  waits for them and exits 0 if every worker exited 0, else 1. A second SIGTERM/SIGINT is
  forwarded too, and each worker ends its drain as a single process does (in-band errors,
  access lines, exit 0); only `drain_timeout` + `KILL_GRACE` seconds without all of them
  gone sends SIGKILL.
- SIGHUP, or with `[gateway] reload_on_change` a change of the files it watches
  (watch.py): the parent reads and validates both files once, keeps the result as the
  configuration it owns and hands what it read to every worker through that worker's
  pipe; each worker applies it as it arrives, as a single process applies a reload
  (reload.py), and a worker that was starting applies it once it serves. A worker
  restarted later starts from the configuration the parent owns now, never from an older
  one. Each worker exports `gateway_config_info{hash}`, so workers that serve different
  configurations show it.

Workers share dispatch state only through `[shared] redis_url` (shared.py). Without it
each worker dispatches on its own view (its own in-flight counts, its own queue and
limits), and the parent logs `workers_without_shared_state` at start.

`/metrics` answers for all workers whichever one the scrape reaches (peer_metrics.py),
through one private loopback port per slot that the parent reserves here. Nothing is
written to disk: the gateway runs under a read-only root file system.
With `--simulate` the simulated fleet runs once, in a thread of the parent, not per worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import structlog

from gateway.config.load import Config, ConfigError
from gateway.fleet.drains import DrainOrder, DrainTable, ordered
from gateway.observe import log
from gateway.observe.peer_metrics import PORTS_ENV, SLOT_ENV
from gateway.process.reload import Ping, Pushed, merge, read_again
from gateway.process.watch import POLL_INTERVAL, Watcher, watched

MIN_UPTIME = 10.0  # seconds: a worker that died sooner died young and its restart backs off
MAX_RESTART_DELAY = 30.0
KILL_GRACE = 10.0  # seconds past drain_timeout before workers still running get SIGKILL
# Liveness, as uvicorn's supervisor checks it: a ping down each worker's pipe this often,
# answered by the loop that serves requests. A worker that has answered before and then
# leaves one unanswered for PING_TIMEOUT is stuck (a loop that never yields, a SIGSTOP)
# and is killed, then restarted as one that died; a starting worker (imports, first
# probes) has STARTUP_GRACE for its first answer.
PING_INTERVAL = 2.0
PING_TIMEOUT = 10.0
STARTUP_GRACE = 60.0

_log = log.get("gateway.workers")


class WorkersUnsupported(Exception):
    """This platform cannot run several workers on one port."""


def restart_delay(young_deaths: int) -> float:
    """Seconds before restarting a worker whose predecessors died young this many times in a row.

    0, 0, 0.5, 1, 2, 4, 8, 16, 30, 30, ... for 0, 1, 2, ... young deaths: a worker that
    ran a while, or crashed once, comes back at once; a crash loop slows to one try in 30 s.
    """
    if young_deaths <= 1:
        return 0.0
    return min(MAX_RESTART_DELAY, 0.5 * 2.0 ** (young_deaths - 2))


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to host:port with SO_REUSEPORT, not listening: it takes no connection.

    It fixes port 0 to one real port for every worker, and it fails here, before any
    worker starts, if the port is taken (OSError).
    """
    reuse_port = getattr(socket, "SO_REUSEPORT", None)
    if reuse_port is None:
        raise WorkersUnsupported(
            "--workers above 1 needs SO_REUSEPORT (Linux, the BSDs, macOS), which this "
            "platform lacks; run one gateway per port behind a load balancer instead"
        )
    family, kind, proto, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, reuse_port, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def _worker_main(
    config: Config, log_level: str, ports: list[int], slot: int, inbox: Connection
) -> None:
    """A worker process: the single-process server, on the reserved port with SO_REUSEPORT."""
    # Until serve() installs its handlers there is nothing to drain: a stop signal ends
    # the worker quietly, and SIGHUP (whose default kills) is ignored.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_quietly)
    hup = getattr(signal, "SIGHUP", None)
    if hup is not None:
        signal.signal(hup, signal.SIG_IGN)
    os.environ[PORTS_ENV] = ",".join(map(str, ports))
    os.environ[SLOT_ENV] = str(slot)
    log.configure(log_level)
    # Every line this worker logs says which worker it is (requests clear the contextvars,
    # so this is a processor, first in the chain log.configure set up).
    processors = structlog.get_config()["processors"]
    structlog.configure(processors=[_add_worker_pid, *processors])
    from gateway.process.serve import serve_here

    sys.exit(serve_here(config, inbox=inbox))


def _add_worker_pid(logger: object, method: str, event: MutableMapping[str, Any]) -> Any:
    event.setdefault("worker_pid", os.getpid())
    return event


def _exit_quietly(signum: int, frame: object) -> None:
    raise SystemExit(0)


@dataclass
class Slot:
    """One of the N places a worker runs in, across its restarts."""

    index: int
    process: BaseProcess | None = None
    inbox: Connection | None = None  # our end of its worker's pipe: reloads and pings
    started_at: float = 0.0
    young_deaths: int = 0
    restart_at: float | None = None
    pinged: int = 0  # the last ping's number
    ping_sent: float | None = None  # when the unanswered ping went; None: all answered
    answered: bool = False  # its worker answered a ping since it started

    def died(self, now: float) -> float:
        """Note that its worker died at `now`; returns the seconds to wait before a restart."""
        young = now - self.started_at < MIN_UPTIME
        self.young_deaths = self.young_deaths + 1 if young else 0
        delay = restart_delay(self.young_deaths)
        self.process, self.restart_at = None, now + delay
        return delay

    def __repr__(self) -> str:
        pid = self.process.pid if self.process is not None else None
        return f"<Slot {self.index} pid={pid} young_deaths={self.young_deaths}>"


@dataclass
class Supervisor:
    """Starts the workers, restarts those that die, forwards signals, waits for the drain."""

    config: Config
    log_level: str
    simulate: bool = False
    slots: list[Slot] = field(default_factory=list)
    stopping: bool = False
    kill_at: float | None = None
    exit_codes: list[int] = field(default_factory=list)  # of workers that exited on a stop
    # The operator's drains (fleet/drains.py), held here so that every worker, and every
    # worker started later, applies the same ones.
    drained: dict[str, float] = field(default_factory=dict)
    _signals: list[int] = field(default_factory=list)

    def run(self) -> int:
        gateway = self.config.gateway
        try:
            reservation = reserve_port(gateway.host, gateway.port)
        except WorkersUnsupported as exc:
            print(f"gateway: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"gateway: cannot listen: {exc}", file=sys.stderr)
            return 1
        port = int(reservation.getsockname()[1])
        self.config = self.config.with_listen(None, port)
        if self.config.file.shared.redis_url is None:
            _log.warning(
                "workers_without_shared_state",
                workers=gateway.workers,
                hint="each worker dispatches on its own view; set [shared] redis_url",
            )
        # One private metrics port per slot, held as the public one is (peer_metrics.py).
        metric_ports = [reserve_port("127.0.0.1", 0) for _ in range(gateway.workers)]
        ports = [int(sock.getsockname()[1]) for sock in metric_ports]
        simulation = _Simulation(self.config) if self.simulate else None
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)
        handled = [signal.SIGTERM, signal.SIGINT]
        hup = getattr(signal, "SIGHUP", None)
        if hup is not None:
            handled.append(hup)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in handled}
        previous_wakeup = signal.set_wakeup_fd(wake_w.fileno())
        try:
            if simulation is not None:
                simulation.start()
            context = multiprocessing.get_context("spawn")
            self.slots = [Slot(i) for i in range(gateway.workers)]
            _log.info("supervising", workers=gateway.workers, url=f"http://{gateway.host}:{port}")
            for slot in self.slots:
                self._start(slot, context, ports)
            # [gateway] reload_on_change: the files are watched here, and a change takes
            # SIGHUP's path; the workers never watch (watch.py).
            watcher = Watcher(
                lambda: watched(self.config),
                self._reload,
                lambda: self.config.gateway.reload_on_change,
            )
            next_look = 0.0
            while True:
                self._wait(wake_r)
                self._handle_signals()
                self._reap()
                if not self.stopping and time.monotonic() >= next_look:
                    watcher.poll()
                    next_look = time.monotonic() + POLL_INTERVAL
                if self.stopping:
                    if not self._alive():
                        break
                    if self.kill_at is not None and time.monotonic() >= self.kill_at:
                        _log.warning("workers_killed", reason="drain took too long")
                        self._send_all(signal.SIGKILL)
                        self.kill_at = None
                    continue
                now = time.monotonic()
                for slot in self.slots:
                    self._check_alive(slot, now)
                for slot in self.slots:
                    due = slot.restart_at is not None and now >= slot.restart_at
                    if slot.process is None and due:
                        self._start(slot, context, ports)
        finally:
            signal.set_wakeup_fd(previous_wakeup)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._send_all(signal.SIGKILL)  # only workers still running: none after a drain
            for slot in self.slots:
                if slot.process is not None:
                    slot.process.join()
            wake_r.close()
            wake_w.close()
            reservation.close()
            for sock in metric_ports:
                sock.close()
            for slot in self.slots:
                if slot.inbox is not None:
                    slot.inbox.close()
            if simulation is not None:
                simulation.stop()
        clean = all(code == 0 for code in self.exit_codes)
        _log.info("stopped", clean=clean, exit_codes=self.exit_codes)
        return 0 if clean else 1

    def _on_signal(self, signum: int, frame: object) -> None:
        # Only note it: the loop, woken by the wakeup fd, acts (and logs) outside the handler.
        self._signals.append(signum)

    def _handle_signals(self) -> None:
        while self._signals:
            signum = self._signals.pop(0)
            if signum == getattr(signal, "SIGHUP", None):
                self._reload()
            elif not self.stopping:
                self.stopping = True
                self.kill_at = time.monotonic() + self.config.gateway.drain_timeout + KILL_GRACE
                _log.info("workers_stopping", signal=signal.Signals(signum).name)
                self._send_all(signal.SIGTERM)
            else:
                # As a single process: the drain ends at once, what still runs ends in-band.
                _log.warning("workers_forced", reason="second stop signal")
                self._send_all(signal.SIGTERM)

    def _reload(self) -> None:
        """SIGHUP: the files read and validated once, here; every worker gets the result."""
        pushed: Pushed
        try:
            pushed = read_again(self.config)
            # What a worker restarted from now on starts with. The workers get the files
            # as read, and merge them as a single process does: each then logs, counts and
            # shows (/admin/config) what waits for a restart.
            self.config, _, _ = merge(self.config, pushed)
        except (ConfigError, ValueError) as exc:
            pushed = str(exc)  # each worker logs and counts the failure; all keep theirs
        for slot in self.slots:
            if slot.inbox is not None and slot.process is not None:
                with contextlib.suppress(OSError):  # a worker that just died
                    slot.inbox.send(pushed)
        _log.info("sighup_forwarded", workers=len(self._alive()), digest=self.config.digest())

    def _drain_order(self, order: DrainOrder) -> None:
        """A worker took a drain or resume order: every worker applies the new table."""
        self.drained = ordered(self.drained, order)
        table = DrainTable(dict(self.drained))
        for slot in self.slots:
            if slot.inbox is not None and slot.process is not None:
                with contextlib.suppress(OSError):  # a worker that just died
                    slot.inbox.send(table)
        _log.info("drains_forwarded", drained=sorted(self.drained))

    def _check_alive(self, slot: Slot, now: float) -> None:
        """Read `slot`'s worker's answers; ping it when due; kill it if it is stuck."""
        process, pipe = slot.process, slot.inbox
        if process is None or pipe is None or process.pid is None:
            return
        try:
            while pipe.poll():
                answer = pipe.recv()
                if isinstance(answer, Ping) and answer.seq == slot.pinged:
                    slot.ping_sent, slot.answered = None, True
                elif isinstance(answer, DrainOrder):
                    self._drain_order(answer)
            if slot.ping_sent is None:
                if now - slot.started_at >= PING_INTERVAL * slot.pinged:
                    slot.pinged += 1
                    pipe.send(Ping(slot.pinged))
                    slot.ping_sent = now
                return
        except (EOFError, OSError):
            return  # it is dying: _reap sees it
        waited = now - slot.ping_sent
        if waited < (PING_TIMEOUT if slot.answered else STARTUP_GRACE):
            return
        _log.warning(
            "worker_unresponsive", worker=slot.index, pid=process.pid, waited_s=round(waited, 1)
        )
        slot.ping_sent = None  # one kill; _reap restarts it
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)

    def _start(
        self, slot: Slot, context: multiprocessing.context.SpawnContext, ports: list[int]
    ) -> None:
        inbox, outbox = context.Pipe(duplex=True)
        process = context.Process(
            target=_worker_main,
            args=(self.config, self.log_level, ports, slot.index, inbox),
            name=f"gateway-worker-{slot.index}",
        )
        process.start()
        inbox.close()  # the worker's end, now in the worker
        if slot.inbox is not None:
            slot.inbox.close()
        slot.inbox = outbox
        slot.process, slot.started_at, slot.restart_at = process, time.monotonic(), None
        slot.pinged, slot.ping_sent, slot.answered = 0, None, False
        if self.drained:  # read by the worker once it serves
            outbox.send(DrainTable(dict(self.drained)))
        _log.info("worker_started", worker=slot.index, pid=process.pid)

    def _alive(self) -> list[BaseProcess]:
        return [s.process for s in self.slots if s.process is not None]

    def _wait(self, wake: socket.socket) -> None:
        sentinels: list[object] = [p.sentinel for p in self._alive()]
        wait([wake, *sentinels], timeout=0.25)  # type: ignore[list-item]
        with contextlib.suppress(BlockingIOError):
            while wake.recv(64):
                pass

    def _send_all(self, signum: int) -> None:
        for process in self._alive():
            if process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signum)

    def _reap(self) -> None:
        now = time.monotonic()
        for slot in self.slots:
            process = slot.process
            if process is None or process.is_alive():
                continue
            process.join()
            code = process.exitcode if process.exitcode is not None else -1
            slot.process = None
            if self.stopping:
                self.exit_codes.append(code)
                _log.info("worker_exited", worker=slot.index, pid=process.pid, exit_code=code)
                continue
            delay = slot.died(now)
            _log.warning(
                "worker_died",
                worker=slot.index,
                pid=process.pid,
                exit_code=code,
                restart_in_s=delay,
            )

    def __repr__(self) -> str:
        state = "stopping" if self.stopping else "running"
        return f"<Supervisor {state} slots={self.slots}>"


class _Simulation:
    """`--simulate` with workers: the simulated fleet runs once, in a thread of the parent."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="simulation")
        self.sims: list[object] = []

    def start(self) -> None:
        from gateway.process.serve import start_simulated

        self.thread.start()
        future = asyncio.run_coroutine_threadsafe(start_simulated(self.config), self.loop)
        self.sims = future.result(timeout=30)
        for sim in self.sims:
            _log.info("simulated_instance_started", url=getattr(sim, "url", "?"))

    def stop(self) -> None:
        from gateway.sim.sim_fleet import stop_fleet

        if self.sims:
            done = asyncio.run_coroutine_threadsafe(stop_fleet(self.sims), self.loop)  # type: ignore[arg-type]
            done.result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


def supervise(config: Config, log_level: str, *, simulate: bool = False) -> int:
    """Run `config.gateway.workers` workers until a stop signal; the process's exit status."""
    return Supervisor(config, log_level, simulate=simulate).run()
