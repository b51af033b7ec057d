"""The checks that need the machine: `gateway.preflight` (listen host, instance host names)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from gateway.config import preflight
from gateway.config.load import Config, ConfigError, load

KEY = "sk-preflight-test-key"
# RFC 5737 TEST-NET-1: never assigned to a machine, so binding it fails.
UNBINDABLE = "192.0.2.1"


def config_with(tmp_path: Path, instances: list[str], toml: str = "") -> Config:
    """Load a configuration with these instance URLs and this config.toml text."""
    (tmp_path / "config.toml").write_text(toml)
    (tmp_path / "settings.json").write_text(json.dumps({"vllm": {"instances": instances}}))
    return load(tmp_path / "config.toml", environ={"GATEWAY_API_KEY": KEY})


def table(**names: list[str]) -> preflight.Resolve:
    """A resolver answering from a table; a name not in it fails as DNS would."""

    def resolve(name: str) -> Iterable[str]:
        if name not in names:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return names[name]

    return resolve


@pytest.fixture
def unbindable() -> str:
    """An address this machine cannot listen on (skips where the kernel allows non-local binds)."""
    with socket.socket() as sock:
        try:
            sock.bind((UNBINDABLE, 0))
        except OSError:
            return UNBINDABLE
    pytest.skip(f"this machine can bind {UNBINDABLE} (ip_nonlocal_bind?)")


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port something is listening on for the test."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


# ------------------------------------------------------------------ listen host


def test_loopback_on_port_0_can_be_bound() -> None:
    """127.0.0.1 is bindable, so it has no problem."""
    assert preflight.bind_problem("127.0.0.1", 0) is None


def test_unbindable_host_fails_naming_where_it_came_from(tmp_path: Path, unbindable: str) -> None:
    """A listen host that is not this machine's raises ConfigError naming its source and value."""
    config = config_with(tmp_path, ["http://127.0.0.1:8000"], f'[gateway]\nhost = "{unbindable}"\n')
    with pytest.raises(ConfigError) as info:
        preflight.check(config, host_from="config.toml: [gateway] host")
    message = str(info.value)
    assert message.startswith("config.toml: [gateway] host: cannot listen on '192.0.2.1'")
    assert "assign" in message.lower()


def test_unresolvable_host_fails(tmp_path: Path) -> None:
    """A listen host name that does not resolve fails the check too."""
    config = config_with(
        tmp_path, ["http://127.0.0.1:8000"], '[gateway]\nhost = "no-such.invalid"\n'
    )
    with pytest.raises(ConfigError, match="cannot resolve"):
        preflight.check(config)


def test_taken_port_is_a_warning_only_when_asked(tmp_path: Path, taken_port: int) -> None:
    """A configured port already in use warns under `port_from` and is not checked without it."""
    config = config_with(tmp_path, ["http://127.0.0.1:8000"], f"[gateway]\nport = {taken_port}\n")
    assert preflight.check(config) == []
    (warning,) = preflight.check(config, port_from="[gateway] port")
    assert warning.startswith(f"[gateway] port: port {taken_port} on '127.0.0.1'")
    assert "in use" in warning


# ---------------------------------------------------------- instance host names


def test_two_names_for_one_address_and_port_warn(tmp_path: Path) -> None:
    """Two host names resolving to one address, on one port, give one warning naming both."""
    config = config_with(tmp_path, ["http://gpu-a:8000", "http://gpu-b:8000", "http://gpu-c:8000"])
    resolve = table(
        **{"gpu-a": ["10.0.0.7"], "gpu-b": ["10.0.0.8", "10.0.0.7"], "gpu-c": ["10.1.1.1"]}
    )
    (warning,) = preflight.check(config, resolve=resolve)
    assert "vllm.instances[1] 'http://gpu-b:8000' and [0] 'http://gpu-a:8000'" in warning
    assert "10.0.0.7 port 8000" in warning
    assert str(tmp_path / "settings.json") in warning


def test_a_name_for_an_address_listed_as_such_warns(tmp_path: Path) -> None:
    """A host name resolving to an IP address that is also listed as an instance warns."""
    config = config_with(tmp_path, ["http://10.0.0.7:8000", "http://gpu-a:8000"])
    (warning,) = preflight.check(config, resolve=table(**{"gpu-a": ["10.0.0.7"]}))
    assert "[1] 'http://gpu-a:8000' and [0] 'http://10.0.0.7:8000'" in warning


def test_a_name_for_this_machine_beside_a_loopback_url_warns(tmp_path: Path) -> None:
    """A host name resolving to 127.0.1.1 (Debian's own hostname) is the loopback instance."""
    config = config_with(tmp_path, ["http://127.0.0.1:8000", "http://myhost:8000"])
    (warning,) = preflight.check(config, resolve=table(myhost=["127.0.1.1"]))
    assert "'http://myhost:8000'" in warning


def test_same_address_on_different_ports_does_not_warn(tmp_path: Path) -> None:
    """Two names for one machine on different ports are two instances: no warning."""
    config = config_with(tmp_path, ["http://gpu-a:8000", "http://gpu-b:8001"])
    resolve = table(**{"gpu-a": ["10.0.0.7"], "gpu-b": ["10.0.0.7"]})
    assert preflight.check(config, resolve=resolve) == []


def test_failing_dns_never_fails_the_check(tmp_path: Path) -> None:
    """When no name resolves the check passes without warnings: DNS may differ where it runs."""
    config = config_with(tmp_path, ["http://gpu-a:8000", "http://gpu-b:8000"])
    assert preflight.check(config, resolve=table()) == []


def test_a_hanging_resolver_is_abandoned_at_the_timeout(tmp_path: Path) -> None:
    """A lookup that never returns is left behind at the timeout; the names that answered count."""
    config = config_with(tmp_path, ["http://gpu-a:8000", "http://gpu-b:8000"])
    release = threading.Event()

    def resolve(name: str) -> Iterable[str]:
        if name == "gpu-b":
            release.wait()
        return ["10.0.0.7"]

    try:
        found = preflight.resolve_all(config.instances, resolve, timeout=0.2)
    finally:
        release.set()
    assert found == {"gpu-a": frozenset({"10.0.0.7"})}


def test_addresses_and_loopback_are_not_looked_up(tmp_path: Path) -> None:
    """IP literals and loopback names never reach the resolver."""
    config = config_with(
        tmp_path, ["http://10.0.0.7:8000", "http://localhost:8001", "http://[::2]:1"]
    )
    asked: list[str] = []

    def resolve(name: str) -> Iterable[str]:
        asked.append(name)
        return []

    assert preflight.resolve_all(config.instances, resolve) == {}
    assert asked == []
