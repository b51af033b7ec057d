"""The command line, `gateway.cli.main` and `python -m gateway`: --check, --config and
--settings, --version, overrides and exit codes, --help, and the log flags. What --check
must catch before serving: test_cli_preflight.py."""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path

import pytest
import structlog
from _cli_helpers import run_module, write

import gateway
from gateway import __version__
from gateway.cli import main
from gateway.config.load import Config
from gateway.observe import log
from gateway.process import serve as server


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def keyless(monkeypatch: pytest.MonkeyPatch) -> None:
    """No variable the default configuration reads a key from is set."""
    monkeypatch.delenv("GATEWAY_API_KEY", raising=False)


@pytest.mark.usefixtures("keyed")
def test_check_prints_ok_for_a_valid_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--check` on a valid configuration prints ok to stdout and returns 0."""
    config = write(tmp_path, "[gateway]\nport = 8181\n")
    assert main(["--config", str(config), "--check"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("ok")
    assert str(config) in out
    assert "2 instance(s)" in out
    assert "1 key(s)" in out
    assert "127.0.0.1:8181" in out
    assert err == ""


@pytest.mark.usefixtures("keyed")
def test_explicit_settings_path_is_used(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--settings` points at a settings file that is not beside the config file."""
    config = write(tmp_path / "a")
    other = write(tmp_path / "b", settings={"vllm": {"instances": ["http://10.0.0.1:1"]}})
    settings = other.parent / "settings.json"
    assert main(["--config", str(config), "--settings", str(settings), "--check"]) == 0
    out = capsys.readouterr().out
    assert str(settings) in out
    assert "1 instance(s)" in out


@pytest.mark.usefixtures("keyed")
def test_bad_config_exits_2_before_binding(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad config returns 2 at once with the field path on stderr, and binds no port."""
    port = free_port()
    config = write(tmp_path, f'[gateway]\nport = {port}\n[dispatch]\nstrategy = "fastest"\n')
    started = time.monotonic()
    assert main(["--config", str(config)]) == 2
    assert time.monotonic() - started < 2
    out, err = capsys.readouterr()
    assert "configuration error" in err
    assert "dispatch.strategy" in err
    assert "'fastest'" in err
    assert out == ""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


@pytest.mark.usefixtures("keyed")
def test_missing_config_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A --config path that does not exist returns 2 and names the file."""
    missing = tmp_path / "nope.toml"
    assert main(["--config", str(missing), "--check"]) == 2
    err = capsys.readouterr().err
    assert "configuration error" in err
    assert str(missing) in err


def test_version_prints_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    """`--version` prints the package version and exits 0."""
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"gateway {__version__}"


def test_bad_port_argument_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """A non-numeric --port is rejected by argparse with exit status 2."""
    with pytest.raises(SystemExit) as info:
        main(["--port", "eighty", "--check"])
    assert info.value.code == 2
    assert "--port" in capsys.readouterr().err


@pytest.mark.usefixtures("keyed")
def test_host_and_port_overrides_show_in_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--host` and `--port` override the file's listen address, as `--check` reports."""
    config = write(tmp_path, '[gateway]\nhost = "127.0.0.1"\nport = 8080\n')
    assert main(["--config", str(config), "--host", "0.0.0.0", "--port", "9123", "--check"]) == 0
    assert "would listen on 0.0.0.0:9123" in capsys.readouterr().out
    assert main(["--config", str(config), "--port", "9124", "--check"]) == 0
    assert "would listen on 127.0.0.1:9124" in capsys.readouterr().out


@pytest.mark.usefixtures("keyed")
def test_check_says_what_it_checked_of_the_addresses_and_starts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--check` never claims to listen: it says each address serving would use, whether
    it can be bound now (a taken one also warns), and that nothing was started."""
    port, admin_port = free_port(), free_port()
    config = write(tmp_path, f"[gateway]\nport = {port}\nadmin_port = {admin_port}\n")
    assert main(["--config", str(config), "--check"]) == 0
    out = capsys.readouterr().out
    assert "listening on" not in out
    assert out.rstrip().endswith(
        f"would listen on 127.0.0.1:{port} (free now) and admin 127.0.0.1:{admin_port} "
        "(free now); nothing was started"
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        assert main(["--config", str(config), "--check"]) == 0
    out, err = capsys.readouterr()
    assert f"127.0.0.1:{port} (cannot be bound now)" in out
    assert f"port {port} on '127.0.0.1' cannot be bound now" in err


@pytest.mark.usefixtures("keyed")
def test_out_of_range_port_override_is_a_config_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--port 70000` is rejected like `port = 70000` in the file (exit 2), not reported ok."""
    config = write(tmp_path)
    assert main(["--config", str(config), "--port", "70000", "--check"]) == 2
    assert "port" in capsys.readouterr().err


@pytest.mark.usefixtures("keyless")
def test_open_allows_no_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without a key `--check` fails naming --open; with `--open` it passes with zero keys."""
    config = write(tmp_path)
    assert main(["--config", str(config), "--check"]) == 2
    err = capsys.readouterr().err
    assert "GATEWAY_API_KEY" in err
    assert "--open" in err
    assert main(["--config", str(config), "--open", "--check"]) == 0
    assert "0 key(s)" in capsys.readouterr().out


@pytest.mark.usefixtures("keyed")
def test_without_config_uses_packaged_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --config the CLI uses the package's defaults, even if ./config.toml exists."""
    write(tmp_path, '[dispatch]\nstrategy = "fastest"\n')
    monkeypatch.chdir(tmp_path)
    assert main(["--check"]) == 0
    out = capsys.readouterr().out
    assert str(Path(gateway.__file__).parent / "defaults" / "config.toml") in out
    assert "2 instance(s)" in out


@pytest.mark.slow  # runs the CLI as a process
def test_module_check_exits_0(tmp_path: Path) -> None:
    """`python -m gateway --config ... --check` exits 0 and prints ok for a valid config."""
    proc = run_module("--config", str(write(tmp_path)), "--check")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok")


@pytest.mark.slow  # runs the CLI as a process
def test_module_check_exits_2_on_a_bad_file(tmp_path: Path) -> None:
    """`python -m gateway --config ... --check` exits 2 with the error on stderr for a bad file."""
    config = write(tmp_path, "[gateway]\nport = 70000\n")
    proc = run_module("--config", str(config), "--check")
    assert proc.returncode == 2
    assert "configuration error" in proc.stderr
    assert "gateway.port" in proc.stderr
    assert proc.stdout == ""


@pytest.mark.usefixtures("keyed")
@pytest.mark.parametrize(
    ("flags", "level", "as_json"),
    [
        ([], "info", None),
        (["--log-format", "json", "--log-level", "debug"], "debug", True),
        (["--log-format", "console"], "info", False),
    ],
)
def test_log_flags_choose_the_level_and_format(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    flags: list[str],
    level: str,
    as_json: bool | None,
) -> None:
    """--log-level and --log-format reach log.configure; without --log-format it decides."""
    calls: list[tuple[str, bool | None]] = []
    monkeypatch.setattr(log, "configure", lambda lvl, *, json=None: calls.append((lvl, json)))

    async def serve(config: Config, *, simulate: bool, **_: object) -> None:
        return None

    monkeypatch.setattr(server, "serve", serve)
    assert main(["--config", str(write(tmp_path)), *flags]) == 0
    assert calls == [(level, as_json)]


def test_help_shows_the_log_flags_and_their_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    """`gateway --help` lists --log-format's choices and --log-level's default."""
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--log-format {json,console}" in out
    assert "default: info" in out
    assert "default: console on a terminal, json otherwise" in out


class _Terminal:
    """A stream that says it is a terminal (as under `docker run -t`) and keeps what it got."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.lines.append(text)
        return len(text)

    def flush(self) -> None:
        return None


@pytest.mark.parametrize("as_json", [True, None])
def test_json_log_format_is_json_even_on_a_terminal(as_json: bool | None) -> None:
    """json=True writes JSON lines to a terminal; left to decide, a terminal gets console lines."""
    terminal = _Terminal()
    try:
        log.configure("info", stream=terminal, json=as_json)  # type: ignore[arg-type]
        structlog.get_logger("test").info("hello", answer=42)
    finally:
        structlog.reset_defaults()
    text = "".join(terminal.lines)
    if as_json:
        event = json.loads(text)
        assert (event["event"], event["answer"], event["level"]) == ("hello", 42, "info")
    else:
        assert "hello" in text
        assert not text.lstrip().startswith("{")


def test_help_names_the_environment_variables_and_every_flag_with_its_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`gateway --help` names the key variable, ${VAR} expansion, the signals, and every flag
    with a default."""
    from gateway.cli import _parser

    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for needle in ("GATEWAY_API_KEY", "${VAR}", "${VAR:-default}", "SIGHUP", "SIGTERM"):
        assert needle in text, needle
    flat = " ".join(text.split())
    for action in _parser()._actions:
        if action.dest in ("help", "version"):
            continue
        flag = action.option_strings[-1]
        assert flag in text, flag
        shown = flat.split(flag, 2)[-1].split(" --", 1)[0]  # the flag's own help entry
        assert "default" in shown, (flag, shown)


def test_help_points_at_doc_sections_that_exist(capsys: pytest.CaptureFixture[str]) -> None:
    """Each "see <Section> in <file>" of `gateway --help` names a heading of that file."""
    with pytest.raises(SystemExit):
        main(["--help"])
    flat = " ".join(capsys.readouterr().out.split())
    pointers = re.findall(r"see ([A-Z][\w -]*?) in ([\w/]+\.md)", flat)
    assert ("Workers", "docs/operations.md") in pointers
    root = Path(__file__).resolve().parents[1]
    for section, page in pointers:
        headings = re.findall(r"^#+ (.+)$", (root / page).read_text(), re.MULTILINE)
        assert section in headings, (section, page)
