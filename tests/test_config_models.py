"""The frozen models `gateway.config.load` returns: instances, channel headers, route
prefixes, `with_listen`."""

from __future__ import annotations

from pathlib import Path

import pytest
from _config_helpers import ENV, URLS, channel, load_error, load_ok
from pydantic import ValidationError

from gateway.config.load import ConfigError

# ------------------------------------------------------------------ instances


def test_instance_objects_carry_all_fields(tmp_path: Path) -> None:
    """An instance object may give url, name, lane, api_key_env, weight and max_num_seqs."""
    spec = {
        "url": "https://gpu-3.internal:8443/",
        "name": "gpu3",
        "lane": "long",
        "api_key_env": "GPU3_KEY",
        "weight": 2.5,
        "max_num_seqs": 48,
    }
    config = load_ok(
        tmp_path, settings={"vllm": {"instances": [spec]}}, environ={**ENV, "GPU3_KEY": "x"}
    )
    (instance,) = config.instances
    assert instance.url == "https://gpu-3.internal:8443"
    assert instance.name == "gpu3"
    assert instance.label == "gpu3"
    assert instance.lane == "long"
    assert instance.api_key_env == "GPU3_KEY"
    assert instance.weight == 2.5
    assert instance.max_num_seqs == 48


def test_string_and_object_instances_mix(tmp_path: Path) -> None:
    """String and object instance entries mix; strings get the defaults (lane any, weight 1)."""
    settings = {
        "vllm": {
            "instances": [
                "http://127.0.0.1:8000",
                {"url": "http://127.0.0.1:8001", "lane": "short"},
                "http://10.1.2.3:9000/",
            ]
        }
    }
    config = load_ok(tmp_path, settings=settings)
    assert [s.url for s in config.instances] == [
        "http://127.0.0.1:8000",
        "http://127.0.0.1:8001",
        "http://10.1.2.3:9000",
    ]
    assert [s.lane for s in config.instances] == ["any", "short", "any"]
    assert [s.weight for s in config.instances] == [1.0, 1.0, 1.0]
    assert [s.max_num_seqs for s in config.instances] == [None, None, None]


def test_label_is_host_port_without_a_name(tmp_path: Path) -> None:
    """An instance without a name is labelled host:port."""
    config = load_ok(tmp_path)
    assert [s.label for s in config.instances] == ["127.0.0.1:8000", "127.0.0.1:8001"]


def test_label_never_contains_url_credentials(tmp_path: Path) -> None:
    """An instance URL carrying user:password@ is labelled host:port, without the credentials."""
    settings = {"vllm": {"instances": ["http://admin:hunter2@10.0.0.5:8000"]}}
    config = load_ok(tmp_path, settings=settings)
    assert config.instances[0].label == "10.0.0.5:8000"


@pytest.mark.parametrize(
    ("url", "root"),
    [
        ("http://127.0.0.1:8000/v1", "'http://127.0.0.1:8000'"),
        ("http://127.0.0.1:8000/v1/", "'http://127.0.0.1:8000'"),
        ("https://gpu-1.internal/vllm/v1", "'https://gpu-1.internal'"),
        ("http://10.0.0.5:8000/health", "'http://10.0.0.5:8000'"),
    ],
)
def test_instance_url_with_a_path_is_rejected_with_the_fix(
    tmp_path: Path, url: str, root: str
) -> None:
    """An instance URL with a path (probes would miss /health) fails naming the root to write."""
    message = load_error(tmp_path, settings={"vllm": {"instances": [URLS[0], url]}})
    assert str(tmp_path / "settings.json") in message
    assert "vllm.instances[1].url" in message
    assert "must not have a path" in message
    assert f"write {root}" in message


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("http://localhost:8000", "http://127.0.0.1:8000"),
        ("http://127.0.0.1:8000", "http://[::1]:8000"),
        ("http://127.0.0.2:8000", "http://LOCALHOST:8000/"),
        ("http://[::ffff:127.0.0.1]:8000", "http://127.0.0.1:8000"),
        ("http://Gpu-1.Internal:80", "http://gpu-1.internal/"),
        ("https://gpu-1.internal", "https://gpu-1.internal:443"),
        ("http://[2001:db8::1]:8000", "http://[2001:db8:0:0:0:0:0:1]:8000"),
    ],
)
def test_one_instance_under_two_spellings_is_rejected(
    tmp_path: Path, first: str, second: str
) -> None:
    """Two URLs for the same host and port (case, default port, loopback alias) are an error."""
    message = load_error(tmp_path, settings={"vllm": {"instances": [first, URLS[1], second]}})
    assert "vllm.instances" in message
    assert "[2]" in message
    assert "listed twice" in message
    assert "same instance as [0]" in message


def test_loopback_alias_error_says_why(tmp_path: Path) -> None:
    """The error for localhost beside 127.0.0.1 says that loopback names are one machine."""
    settings = {"vllm": {"instances": ["http://localhost:8000", "http://127.0.0.1:8000"]}}
    assert "are all this machine" in load_error(tmp_path, settings=settings)


def test_loopback_names_on_different_ports_are_different_instances(tmp_path: Path) -> None:
    """localhost, 127.0.0.1 and ::1 on different ports load as three instances."""
    urls = ["http://localhost:8000", "http://127.0.0.1:8001", "http://[::1]:8002"]
    config = load_ok(tmp_path, settings={"vllm": {"instances": urls}})
    assert [s.url for s in config.instances] == urls


# ------------------------------------------------------------ channel headers


@pytest.mark.parametrize(
    "value",
    ["tag\r\nX-Injected: 1", "line\nbreak", "carriage\rreturn", "nul\x00byte", "del\x7f"],
)
def test_header_value_with_a_control_character_is_rejected(tmp_path: Path, value: str) -> None:
    """A channel header value with CR, LF or another control character fails naming the header."""
    secret = "Bearer sk-secret-in-header"
    message = load_error(
        tmp_path, settings=channel(headers={"X-Team": "ok", "X-Auth": f"{secret} {value}"})
    )
    assert str(tmp_path / "settings.json") in message
    assert "channel.headers" in message
    assert "'X-Auth'" in message
    assert "control character" in message
    assert secret not in message


@pytest.mark.parametrize("name", ["X Team", "X-Team:", "", "X-Téam", "X-Team\n"])
def test_header_name_that_is_not_a_token_is_rejected(tmp_path: Path, name: str) -> None:
    """A channel header name that is not an HTTP token (a space, a colon, empty) fails naming it."""
    message = load_error(tmp_path, settings=channel(headers={name: "v"}))
    assert "channel.headers" in message
    assert f"header name {name!r}" in message


def test_header_error_under_taotoken_names_the_taotoken_block(tmp_path: Path) -> None:
    """A bad header in the seed's `taotoken` block is reported as taotoken.headers."""
    settings = {"taotoken": {"headers": {"X A": "v"}}, "vllm": {"instances": URLS}}
    assert "taotoken.headers" in load_error(tmp_path, settings=settings)


def test_sendable_headers_load(tmp_path: Path) -> None:
    """Token names and values with spaces, tabs and non-ASCII text load unchanged."""
    headers = {"X-Request-Tag": "prefill-bench", "X_Odd.Name~1": "a b\tc", "X-Name": "Zoë"}
    assert load_ok(tmp_path, settings=channel(headers=headers)).channel.headers == headers


# ------------------------------------------------------------- route prefixes


def test_route_prefixes_without_base_url(tmp_path: Path) -> None:
    """Without any base_url only /v1 and the bare form are served."""
    assert load_ok(tmp_path).route_prefixes == ("/v1", "")


def test_route_prefixes_with_a_v1_base_url(tmp_path: Path) -> None:
    """A base_url whose path ends in /v1 adds just that path."""
    config = load_ok(tmp_path, '[gateway]\nbase_url = "http://h:1/api/v1/"\n')
    assert config.route_prefixes == ("/v1", "", "/api/v1")


# ------------------------------------------------------ with_listen and frozen


def test_with_listen_overrides_only_what_is_given(tmp_path: Path) -> None:
    """with_listen replaces host and/or port in a copy and leaves the original unchanged."""
    config = load_ok(tmp_path, '[gateway]\nhost = "127.0.0.1"\nport = 8080\n')
    only_port = config.with_listen(None, 9999)
    only_host = config.with_listen("0.0.0.0", None)
    both = config.with_listen("::1", 0)
    assert (only_port.gateway.host, only_port.gateway.port) == ("127.0.0.1", 9999)
    assert (only_host.gateway.host, only_host.gateway.port) == ("0.0.0.0", 8080)
    assert (both.gateway.host, both.gateway.port) == ("::1", 0)
    assert config.with_listen(None, None) == config
    assert (config.gateway.host, config.gateway.port) == ("127.0.0.1", 8080)
    assert only_port.instances == config.instances
    assert only_port.api_keys == config.api_keys
    assert only_port.dispatch == config.dispatch


def test_with_listen_validates_the_port(tmp_path: Path) -> None:
    """with_listen rejects a port outside 0-65535 like the file would."""
    config = load_ok(tmp_path)
    with pytest.raises((ConfigError, ValidationError)):
        config.with_listen(None, 70000)


def test_models_are_frozen(tmp_path: Path) -> None:
    """Assigning a field on the config or any nested model raises."""
    config = load_ok(tmp_path)
    with pytest.raises(ValidationError):
        config.gateway.port = 1  # type: ignore[misc]
    with pytest.raises(ValidationError):
        config.api_keys = ()  # type: ignore[misc]
    with pytest.raises(ValidationError):
        config.instances[0].url = "http://x:1"  # type: ignore[misc]
    with pytest.raises(ValidationError):
        config.channel.retry.max_attempts = 9  # type: ignore[misc]
    with pytest.raises(ValidationError):
        config.dispatch.health.rise = 9  # type: ignore[misc]
    assert config.gateway.port == 8080
