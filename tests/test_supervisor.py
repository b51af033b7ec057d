"""The supervisor's pure parts and its setting: restart backoff, port reservation, `workers`."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.process.workers import MAX_RESTART_DELAY, MIN_UPTIME, Slot, reserve_port, restart_delay

SETTINGS = {"channel": {"api_key": "k"}, "vllm": {"instances": ["http://127.0.0.1:9"]}}


def test_restart_delay_backs_off_a_crash_loop() -> None:
    """A first death restarts at once; deaths in a row double the wait up to the cap."""
    delays = [restart_delay(n) for n in range(12)]
    assert delays[:8] == [0, 0, 0.5, 1, 2, 4, 8, 16]
    assert delays[8:] == [MAX_RESTART_DELAY] * 4


def test_reserved_port_0_becomes_a_port_workers_can_share() -> None:
    """Port 0 becomes a real port that two SO_REUSEPORT listeners bind beside the reservation."""

    async def two_listeners(port: int) -> list[int]:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.close()

        servers = [
            await asyncio.start_server(handle, "127.0.0.1", port, reuse_port=True) for _ in range(2)
        ]
        bound = [s.sockets[0].getsockname()[1] for s in servers]
        for server in servers:
            server.close()
            await server.wait_closed()
        return bound

    reservation = reserve_port("127.0.0.1", 0)
    try:
        port = reservation.getsockname()[1]
        assert port != 0
        assert asyncio.run(two_listeners(port)) == [port, port]
    finally:
        reservation.close()


def test_reservation_takes_no_connection() -> None:
    """The reserved socket does not listen: a connection to it alone is refused."""
    reservation = reserve_port("127.0.0.1", 0)
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(reservation.getsockname(), timeout=2).close()
    finally:
        reservation.close()


def test_a_port_taken_without_reuse_port_fails_the_reservation() -> None:
    """A port held by another program (no SO_REUSEPORT) fails before any worker starts."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        with pytest.raises(OSError, match="in use"):
            reserve_port("127.0.0.1", other.getsockname()[1]).close()


def _write(folder: Path, toml: str) -> Path:
    (folder / "config.toml").write_text(toml)
    (folder / "settings.json").write_text(json.dumps(SETTINGS))
    return folder / "config.toml"


@pytest.mark.parametrize("workers", ["0", "-1", "257"])
def test_workers_flag_out_of_range_is_a_config_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], workers: str
) -> None:
    """`--workers` outside 1..256 exits 2 naming the setting."""
    config = _write(tmp_path, "")
    assert main(["--config", str(config), "--check", "--workers", workers]) == 2
    err = capsys.readouterr().err
    assert f"--workers {workers}: workers: Input should be" in err


def test_workers_setting_is_validated(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`[gateway] workers = 0` in the file exits 2 naming the field."""
    config = _write(tmp_path, "[gateway]\nworkers = 0\n")
    assert main(["--config", str(config), "--check"]) == 2
    assert "gateway.workers" in capsys.readouterr().err


def test_a_slot_backs_off_only_while_its_workers_die_young() -> None:
    """Deaths within MIN_UPTIME of the start count up the backoff; a long life resets it."""
    slot = Slot(0, started_at=0.0)
    delays = []
    now = 0.0
    for lived in (3.0, 1.0, 1.0, 1.0, MIN_UPTIME + 1, 1.0):
        now += lived
        delays.append(slot.died(now))
        assert slot.restart_at == now + delays[-1]
        now += delays[-1]
        slot.started_at = now  # restarted when due
    assert delays == [0, 0.5, 1, 2, 0, 0]


def test_check_reports_the_workers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--check --workers 3` validates the count and says how many workers would serve."""
    config = _write(tmp_path, "[gateway]\nport = 0\n")
    assert main(["--config", str(config), "--check", "--workers", "3"]) == 0
    assert "would listen on 127.0.0.1:0 (any free port) with 3 workers" in capsys.readouterr().out
