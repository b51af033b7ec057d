"""`[gateway] reload_on_change`: reload when the configuration's files change on disk.

A Kubernetes ConfigMap (or Secret) volume updates by a symlink swap: `config.toml` is a
link to `..data/config.toml`, and the kubelet writes the new files into a fresh
`..2026_...` folder and replaces the `..data` link with `rename(2)`. No inotify event
reaches a watch on `config.toml` itself, and the new file's mtime may be older than the
old one's, so the watcher polls (no dependency, no thread): every `POLL_INTERVAL` s it
reads each watched path through its links, and notes where it resolves to and a digest of
its bytes. Content, not mtime: an edit of the same size within one mtime tick is seen,
and a file written again unchanged is not a change.

A change is acted on once it has settled, the same on two looks in a row, so a file
caught half-written by an editor is not reloaded (and refused) first. Acting is what
SIGHUP does: one process calls `reload(app)` (reload.py); under `--workers` the
supervisor watches and runs its SIGHUP path (workers.py), and the workers never watch.
A bad file is refused as on SIGHUP and the running configuration stays; it is read again
only when it changes again.

Watched: `config.toml`, `settings.json` and each named key's `key_file`, as the running
configuration names them (a reload that adds a key file adds it to the watch).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from pathlib import Path

from aiohttp import web

from gateway.config.load import Config
from gateway.observe import log
from gateway.process.reload import reload
from gateway.server.resources import PROXY

POLL_INTERVAL = 1.0  # seconds between looks: a ConfigMap change is seen within about 2 s

_log = log.get("gateway.watch")

# Per watched path: where it resolves to and the SHA-256 of its bytes (None: unreadable,
# which a swap never shows but a deleted file does).
Stamp = Mapping[str, tuple[str, str | None]]


def watched(config: Config) -> list[str]:
    """The files a reload reads: both configuration files and every named key's file."""
    folder = Path(config.settings_path).parent
    key_files = [str(folder / e.key_file) for e in config.settings.channel.keys if e.key_file]
    return [config.config_path, config.settings_path, *key_files]


def stamp(paths: Iterable[str]) -> dict[str, tuple[str, str | None]]:
    """Each path's target (links followed) and content digest, as of now."""
    out: dict[str, tuple[str, str | None]] = {}
    for path in paths:
        target = os.path.realpath(path)
        try:
            with open(path, "rb") as f:
                digest: str | None = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            digest = None
        out[path] = (target, digest)
    return out


def changed(before: Stamp, now: Stamp) -> list[str]:
    """The paths of both stamps that differ. A path only `now` has is new to the watch (a
    reload added it), not a change."""
    return [p for p in now if p in before and before[p] != now[p]]


class Watcher:
    """Polls the files `paths()` names and calls `on_change` once a change has settled.

    `enabled()` is read on every look, so a reload may turn the watch on or off; while it
    is off nothing is read, and turning it on takes the files as they are then.
    """

    def __init__(
        self,
        paths: Callable[[], list[str]],
        on_change: Callable[[], object],
        enabled: Callable[[], bool],
    ) -> None:
        self.paths = paths
        self.on_change = on_change
        self.enabled = enabled
        self.applied: Stamp | None = None  # the files as last acted on (or first seen)
        self.pending: Stamp | None = None  # a change seen once, waiting to settle

    def __repr__(self) -> str:
        state = (
            "off"
            if self.applied is None
            else "settling"
            if self.pending is not None
            else "watching"
        )
        return f"<Watcher {state} files={0 if self.applied is None else len(self.applied)}>"

    def poll(self) -> bool:
        """One look; True if it called `on_change`."""
        if not self.enabled():
            self.applied = self.pending = None
            return False
        now = stamp(self.paths())
        if self.applied is None or not changed(self.applied, now):
            self.applied, self.pending = now, None  # first look, or paths added by a reload
            return False
        if self.pending is None or changed(self.pending, now):
            self.pending = now  # wait one more look: it may still be being written
            return False
        _log.info("config_changed", files=changed(self.applied, now))
        self.applied, self.pending = now, None
        self.on_change()
        return True

    async def run_forever(self, interval: float = POLL_INTERVAL) -> None:
        while True:
            # Reading a few small files takes microseconds: not worth a thread.
            self.poll()
            await asyncio.sleep(interval)


def reloading(
    interval: float = POLL_INTERVAL,
) -> Callable[[web.Application], AsyncIterator[None]]:
    """The app's cleanup_ctx for a single process: watch the running configuration's files
    and `reload(app)` on a change. Appended after the app's own resources (PROXY)."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        proxy = app[PROXY]
        watcher = Watcher(
            lambda: watched(proxy.config),
            lambda: reload(app),
            lambda: proxy.config.gateway.reload_on_change,
        )
        task = asyncio.create_task(watcher.run_forever(interval), name="config-watch")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    return ctx
