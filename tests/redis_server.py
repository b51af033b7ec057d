"""A real redis-server on a free loopback port, started and stopped by the test that needs it.

Skipped with a clear message on a developer's machine without the binary; in CI (where
.ci/run installs Debian's redis-server) a missing binary fails the test instead.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is missing: .ci/run installs Debian's redis-server")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    return binary


@dataclass
class RedisServer:
    port: int
    binary: str
    proc: subprocess.Popen[bytes] | None = field(default=None)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock,
            ):
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        """Kill it at once, as a crash would (SIGKILL: no goodbye to its clients)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None


@contextlib.contextmanager
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer(free_port(), _binary())
    server.start()
    try:
        yield server
    finally:
        server.stop()
