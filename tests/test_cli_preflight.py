"""What `gateway --check` must catch before serving (settings that break serving, hosts that
cannot be bound, ports taken, instances reached twice), and the warnings serving logs."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import structlog
from _cli_helpers import SETTINGS, run_module, write

from gateway.cli import main
from gateway.config import preflight
from gateway.config.load import Config
from gateway.observe import log
from gateway.process import serve as server

# -------------------------------------------- what --check must catch before serving

UNBINDABLE = "192.0.2.1"  # RFC 5737 TEST-NET-1: never this machine's


@pytest.fixture
def unbindable() -> str:
    """An address this machine cannot listen on (skips where the kernel allows non-local binds)."""
    with socket.socket() as sock:
        try:
            sock.bind((UNBINDABLE, 0))
        except OSError:
            return UNBINDABLE
    pytest.skip(f"this machine can bind {UNBINDABLE} (ip_nonlocal_bind?)")


def with_channel(**fields: object) -> dict[str, object]:
    """SETTINGS with these channel fields."""
    return {**SETTINGS, "channel": fields}


def with_instances(*urls: str) -> dict[str, object]:
    """Settings with these instance URLs."""
    return {"vllm": {"instances": list(urls)}}


@pytest.mark.usefixtures("keyed")
@pytest.mark.parametrize(
    ("settings", "where", "fragment"),
    [
        pytest.param(
            with_channel(headers={"X-Team": "a\r\nX-Evil: 1"}),
            "channel.headers",
            "'X-Team'",
            id="header-crlf",
        ),
        pytest.param(
            with_channel(headers={"X Team": "a"}), "channel.headers", "'X Team'", id="header-name"
        ),
        pytest.param(
            with_instances("http://127.0.0.1:8000/v1"),
            "vllm.instances[0].url",
            "write 'http://127.0.0.1:8000'",
            id="url-path",
        ),
        pytest.param(
            with_instances("http://localhost:8000", "http://127.0.0.1:8000"),
            "vllm.instances",
            "listed twice",
            id="loopback-alias",
        ),
    ],
)
def test_check_fails_on_settings_that_break_serving(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    settings: object,
    where: str,
    fragment: str,
) -> None:
    """`--check` exits 2 naming settings.json and the field for settings that would fail serving."""
    config = write(tmp_path, settings=settings)
    assert main(["--config", str(config), "--check"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "configuration error" in err
    assert str(tmp_path / "settings.json") in err
    assert where in err
    assert fragment in err


@pytest.mark.usefixtures("keyed")
def test_check_fails_on_a_listen_host_that_cannot_be_bound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], unbindable: str
) -> None:
    """`--check` exits 2 naming `[gateway] host` (or `--host`) when the host cannot be bound."""
    config = write(tmp_path, f'[gateway]\nhost = "{unbindable}"\n')
    assert main(["--config", str(config), "--check"]) == 2
    err = capsys.readouterr().err
    assert f"{config}: [gateway] host: cannot listen on '{unbindable}'" in err
    assert main(["--config", str(write(tmp_path / "b")), "--host", unbindable, "--check"]) == 2
    assert f"--host: cannot listen on '{unbindable}'" in capsys.readouterr().err


@pytest.mark.usefixtures("keyed")
def test_check_passes_with_a_warning_when_the_port_is_taken(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A configured port in use (say, by the running gateway) warns but `--check` still passes."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        config = write(tmp_path, f"[gateway]\nport = {port}\n")
        assert main(["--config", str(config), "--check"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("ok")
    assert f"warning: {config}: [gateway] port: port {port} on '127.0.0.1'" in err


@pytest.mark.usefixtures("keyed")
def test_check_warns_when_two_host_names_resolve_to_one_instance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--check` passes but warns on stderr when two instance names resolve to one address."""
    monkeypatch.setattr(preflight, "_getaddrinfo", lambda name: ["10.9.8.7"])
    config = write(tmp_path, settings=with_instances("http://gpu-a:8000", "http://gpu-b:8000"))
    assert main(["--config", str(config), "--check"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("ok")
    assert "warning:" in err
    assert "'http://gpu-b:8000' and [0] 'http://gpu-a:8000' both reach 10.9.8.7" in err


def test_serving_on_an_unbindable_host_exits_2_with_one_line(
    tmp_path: Path, unbindable: str
) -> None:
    """`python -m gateway` on an unbindable host exits 2 with one line naming `[gateway] host`."""
    config = write(tmp_path, f'[gateway]\nhost = "{unbindable}"\n')
    proc = run_module("--config", str(config))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert "[gateway] host: cannot listen on" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.usefixtures("keyed")
def test_start_logs_each_warning_as_config_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Serving (not only `--check`) logs a `config_warning` event for each preflight warning."""
    monkeypatch.setattr(preflight, "_getaddrinfo", lambda name: ["10.9.8.7"])
    monkeypatch.setattr(log, "configure", lambda *a, **k: None)  # keep structlog as the test has it
    served: list[Config] = []

    async def serve(config: Config, *, simulate: bool, **_: object) -> None:
        served.append(config)

    monkeypatch.setattr(server, "serve", serve)
    config = write(tmp_path, settings=with_instances("http://gpu-a:8000", "http://gpu-b:8000"))
    with structlog.testing.capture_logs() as events:
        assert main(["--config", str(config)]) == 0
    assert len(served) == 1
    (warning,) = [e for e in events if e["event"] == "config_warning"]
    assert warning["log_level"] == "warning"
    assert "both reach 10.9.8.7" in warning["problem"]


@pytest.mark.parametrize(
    ("key", "why"), [("change-me", "a placeholder"), ("a", "1 characters, under 16")]
)
def test_check_warns_about_a_weak_key_without_quoting_it(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    key: str,
    why: str,
) -> None:
    """A placeholder such as `change-me` or a one-letter key passes `--check` with a warning."""
    monkeypatch.setenv("GATEWAY_API_KEY", key)
    assert main(["--config", str(write(tmp_path)), "--check"]) == 0
    err = capsys.readouterr().err
    assert f"the unified key #1 is weak ({why}" in err
    assert f"'{key}'" not in err


@pytest.mark.usefixtures("keyed")
def test_check_fails_on_an_admin_host_that_cannot_be_bound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An admin listener on an address this machine does not have fails --check, named."""
    config = write(tmp_path, '[gateway]\nadmin_port = 18081\nadmin_host = "192.0.2.77"\n')
    assert main(["--config", str(config), "--check"]) == 2
    assert "[gateway] admin_host: cannot listen on '192.0.2.77'" in capsys.readouterr().err
