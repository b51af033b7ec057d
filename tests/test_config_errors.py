"""How `gateway.config.load` reports a bad configuration: one ConfigError naming the file,
the field path and the value, and never a key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _config_helpers import ENV, KEY, URLS, channel, load_error, load_ok, write

from gateway.config.load import ConfigError, load

# ------------------------------------------------------------ bad configurations

CASES: list[Any] = [
    pytest.param(
        "[gateway\nport = 1\n", None, "config.toml", ["invalid TOML", "line 1"], id="toml"
    ),
    pytest.param(
        "[gateway]\nport = 1\nport = 2\n", None, "config.toml", ["invalid TOML"], id="toml-dup"
    ),
    pytest.param(
        "",
        '{"vllm": {\n  "instances": [,]\n}}',
        "settings.json",
        ["invalid JSON", "line 2 column"],
        id="json",
    ),
    pytest.param("", "[1, 2]", "settings.json", ["JSON object", "list"], id="json-list"),
    pytest.param(
        "[dispatch]\nmax_queue_per_instanse = 32\n",
        None,
        "config.toml",
        ["dispatch.max_queue_per_instanse", "32"],
        id="unknown-toml-key",
    ),
    pytest.param(
        "",
        {"vllm": {"instances": URLS, "tensor_paralel_size": 2}},
        "settings.json",
        ["vllm.tensor_paralel_size", "2"],
        id="unknown-json-key",
    ),
    pytest.param(
        "",
        channel(retry={"max_attempt": 3}),
        "settings.json",
        ["channel.retry.max_attempt", "3"],
        id="unknown-nested-json-key",
    ),
    pytest.param(
        '[gateway]\nport = "eighty"\n',
        None,
        "config.toml",
        ["gateway.port", "'eighty'"],
        id="port-type",
    ),
    pytest.param(
        "[prefill]\nlane_split = true\n",
        None,
        "config.toml",
        ["prefill.lane_split", "True"],
        id="removed-setting",
    ),
    # Removed with no measurement behind them (docs/decisions/0017-unmeasured-settings.md).
    pytest.param(
        '[tracing]\nservice_name = "gw"\n',
        None,
        "config.toml",
        ["tracing.service_name", "'gw'"],
        id="removed-service-name",
    ),
    pytest.param(
        "",
        channel(retry={"budget_ratio": 0.1}),
        "settings.json",
        ["channel.retry.budget_ratio", "0.1"],
        id="removed-budget-ratio",
    ),
    pytest.param(
        "[dispatch.health]\nejection_base = 1\n",
        None,
        "config.toml",
        ["dispatch.health.ejection_base", "1"],
        id="removed-ejection-base",
    ),
    pytest.param(
        "[dispatch.health]\nejection_max = 30\n",
        None,
        "config.toml",
        ["dispatch.health.ejection_max", "30"],
        id="removed-ejection-max",
    ),
    pytest.param(
        "[dispatch.health]\nmax_ejected_fraction = 0.25\n",
        None,
        "config.toml",
        ["dispatch.health.max_ejected_fraction", "0.25"],
        id="removed-max-ejected-fraction",
    ),
    pytest.param(
        "[dispatch.health]\nmetrics_stale_after = 5\n",
        None,
        "config.toml",
        ["dispatch.health.metrics_stale_after", "5"],
        id="removed-metrics-stale-after",
    ),
    pytest.param(
        "[gateway]\nport = 70000\n", None, "config.toml", ["gateway.port", "70000"], id="port-range"
    ),
    pytest.param(
        "[dispatch]\nmax_queue_per_instance = -1\n",
        None,
        "config.toml",
        ["dispatch.max_queue_per_instance", "-1"],
        id="queue-negative",
    ),
    pytest.param(
        "[dispatch.health]\nrise = 0\n",
        None,
        "config.toml",
        ["dispatch.health.rise", "0"],
        id="nested-toml-range",
    ),
    pytest.param(
        "",
        channel(retry={"max_attempts": 0}),
        "settings.json",
        ["channel.retry.max_attempts", "got 0"],
        id="retry-zero",
    ),
    pytest.param(
        "",
        {"vllm": {"instances": [{"url": URLS[0], "weight": 0}]}},
        "settings.json",
        ["vllm.instances[0].weight", "got 0"],
        id="weight-zero",
    ),
    pytest.param(
        "",
        {"vllm": {"instances": [{"url": URLS[0], "lane": "medium"}]}},
        "settings.json",
        ["vllm.instances[0].lane", "'medium'"],
        id="bad-lane",
    ),
    pytest.param(
        '[dispatch]\nstrategy = "fastest"\n',
        None,
        "config.toml",
        ["dispatch.strategy", "'fastest'", "round_robin", "least_busy"],
        id="strategy",
    ),
    pytest.param(
        "",
        {"vllm": {"instances": ["127.0.0.1:8000"]}},
        "settings.json",
        ["vllm.instances[0].url", "'127.0.0.1:8000'"],
        id="url-no-scheme",
    ),
    pytest.param(
        "",
        {"vllm": {"instances": [URLS[0], "ftp://127.0.0.1:8001"]}},
        "settings.json",
        ["vllm.instances[1].url", "'ftp://127.0.0.1:8001'"],
        id="url-ftp",
    ),
    pytest.param(
        "",
        {"vllm": {"instances": ["http://127.0.0.1:8000/?x=1"]}},
        "settings.json",
        ["vllm.instances[0].url", "?x=1", "query"],
        id="url-query",
    ),
    pytest.param(
        "",
        {"vllm": {"instances": ["http://127.0.0.1:99999"]}},
        "settings.json",
        ["vllm.instances[0].url", "99999"],
        id="url-port",
    ),
    pytest.param(
        '[gateway]\nbase_url = "localhost:8080/api"\n',
        None,
        "config.toml",
        ["gateway.base_url", "'localhost:8080/api'"],
        id="base-url",
    ),
    pytest.param(
        "",
        {"vllm": {"instances": [URLS[0], URLS[0] + "/"]}},
        "settings.json",
        ["vllm", "listed twice", URLS[0]],
        id="duplicate-url",
    ),
    pytest.param(
        "",
        {"vllm": {"instances": [{"url": URLS[0], "name": "a"}, {"url": URLS[1], "name": "a"}]}},
        "settings.json",
        ["vllm", "'a'", "twice"],
        id="duplicate-name",
    ),
    pytest.param(
        "",
        {"vllm": {"instances": [URLS[0], 7]}},
        "settings.json",
        ["vllm.instances[1]", "got 7"],
        id="instance-type",
    ),
    pytest.param(
        "",
        {"vllm": {"instances": []}},
        "settings.json",
        ["vllm.instances", "[]"],
        id="no-instances",
    ),
    pytest.param("", {"channel": {}}, "settings.json", ["vllm", "Field required"], id="no-vllm"),
    pytest.param(
        '[gateway]\ngateway = "x"\n',
        None,
        "config.toml",
        ["gateway.gateway", "'x'"],
        id="typo-nest",
    ),
    # An infinite timeout turns its protection off; TOML spells it, so it is refused.
    pytest.param(
        "[gateway]\nheader_timeout = inf\n",
        None,
        "config.toml",
        ["gateway.header_timeout", "inf", "finite"],
        id="infinite-timeout",
    ),
    pytest.param(
        "[gateway]\ndrain_timeout = nan\n",
        None,
        "config.toml",
        ["gateway.drain_timeout", "nan", "finite"],
        id="nan-timeout",
    ),
    pytest.param(
        "[dispatch]\nhealth_check_interval = inf\n",
        None,
        "config.toml",
        ["dispatch.health_check_interval", "inf", "finite"],
        id="infinite-interval",
    ),
    pytest.param(
        "",
        {"channel": {"timeout": {"read": float("inf")}}, "vllm": {"instances": URLS}},
        "settings.json",
        ["channel.timeout.read", "inf", "finite"],
        id="infinite-read-timeout",
    ),
]


@pytest.mark.parametrize(("toml", "settings", "file", "fragments"), CASES)
def test_bad_config_names_file_path_and_value(
    tmp_path: Path, toml: str, settings: Any, file: str, fragments: list[str]
) -> None:
    """Each class of bad configuration raises ConfigError naming the file, field path and value."""
    message = load_error(tmp_path, toml, settings)
    assert str(tmp_path / file) in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_several_problems_are_all_reported(tmp_path: Path) -> None:
    """Several problems in one file are all listed in one error."""
    message = load_error(tmp_path, '[gateway]\nport = -1\n[dispatch]\nstrategy = "x"\n')
    assert "2 problem(s)" in message
    assert "gateway.port" in message
    assert "dispatch.strategy" in message


@pytest.mark.parametrize("missing", ["config.toml", "settings.json"])
def test_missing_file_is_named(tmp_path: Path, missing: str) -> None:
    """A missing config or settings file is an error naming that file."""
    config = write(tmp_path)
    (tmp_path / missing).unlink()
    with pytest.raises(ConfigError) as info:
        load(config, environ=ENV)
    assert str(tmp_path / missing) in str(info.value)
    assert "not found" in str(info.value)


def test_directory_instead_of_file_is_a_config_error(tmp_path: Path) -> None:
    """A settings path that is a directory is a ConfigError, not an OSError."""
    config = write(tmp_path)
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(ConfigError, match="cannot read"):
        load(config, tmp_path / "dir.json", environ=ENV)


@pytest.mark.parametrize("name", ["config.toml", "settings.json"])
def test_file_that_is_not_utf8_is_a_config_error(tmp_path: Path, name: str) -> None:
    """A config or settings file that is not UTF-8 is a ConfigError naming the file."""
    config = write(tmp_path)
    (tmp_path / name).write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError) as info:
        load(config, environ=ENV)
    assert str(tmp_path / name) in str(info.value)


def test_boolean_port_is_rejected(tmp_path: Path) -> None:
    """`port = true` is a wrong type, not port 1."""
    message = load_error(tmp_path, "[gateway]\nport = true\n")
    assert "gateway.port" in message


def test_instance_api_key_env_unset_names_the_variable(tmp_path: Path) -> None:
    """An instance whose api_key_env names an unset variable is an error naming it and the URL."""
    settings = {"vllm": {"instances": [URLS[0], {"url": URLS[1], "api_key_env": "VLLM_KEY_B"}]}}
    message = load_error(tmp_path, settings=settings)
    assert str(tmp_path / "settings.json") in message
    assert "VLLM_KEY_B" in message
    assert "api_key_env" in message
    assert URLS[1] in message


def test_instance_api_key_env_set_loads(tmp_path: Path) -> None:
    """An instance whose api_key_env variable is set loads."""
    settings = {"vllm": {"instances": [{"url": URLS[0], "api_key_env": "VLLM_KEY_A"}]}}
    config = load_ok(tmp_path, settings=settings, environ={**ENV, "VLLM_KEY_A": "x"})
    assert config.instances[0].api_key_env == "VLLM_KEY_A"


def test_instance_api_key_with_a_line_break_is_an_error(tmp_path: Path) -> None:
    """A key read from a secret file with its trailing newline could never be sent as a
    header: an error naming the variable and the instance, without the secret."""
    settings = {"vllm": {"instances": [{"url": URLS[0], "api_key_env": "VLLM_KEY_A"}]}}
    environ = {**ENV, "VLLM_KEY_A": "sk-secret-value\n"}
    message = load_error(tmp_path, settings=settings, environ=environ)
    assert "VLLM_KEY_A" in message
    assert URLS[0] in message
    assert "control character" in message
    assert "sk-secret-value" not in message


@pytest.mark.parametrize("value", ["", "   ", ["good-key", ""]])
def test_empty_api_key_is_an_error(tmp_path: Path, value: Any) -> None:
    """An empty (or blank) api_key string is an error naming the file and channel.api_key."""
    message = load_error(tmp_path, settings=channel(api_key=value))
    assert str(tmp_path / "settings.json") in message
    assert "channel.api_key" in message
    assert "empty" in message


def test_empty_api_key_from_an_empty_variable_is_an_error(tmp_path: Path) -> None:
    """`api_key: "${K}"` with K set but empty is an error, not a silent open gateway."""
    message = load_error(tmp_path, settings=channel(api_key="${K}"), environ={"K": ""})
    assert "api_key" in message
    assert "empty" in message


def test_empty_single_api_key_reports_the_real_path(tmp_path: Path) -> None:
    """An empty api_key string under `taotoken` is reported as taotoken.api_key, as written."""
    settings = {"taotoken": {"api_key": ""}, "vllm": {"instances": URLS}}
    message = load_error(tmp_path, settings=settings)
    assert "taotoken.api_key:" in message


def test_error_under_taotoken_names_the_taotoken_path(tmp_path: Path) -> None:
    """A bad value inside the seed's `taotoken` block is reported under taotoken.*, as written."""
    settings = {"taotoken": {"retry": {"max_attempts": 0}}, "vllm": {"instances": URLS}}
    message = load_error(tmp_path, settings=settings)
    assert "taotoken.retry.max_attempts" in message


def test_wrong_api_key_type_gives_a_readable_path(tmp_path: Path) -> None:
    """A non-string api_key is reported at channel.api_key, without pydantic's internal tags."""
    message = load_error(tmp_path, settings=channel(api_key=5))
    assert "channel.api_key:" in message
    assert "lax-or-strict" not in message


@pytest.mark.parametrize(
    "settings",
    [
        pytest.param(
            {"taotoken": {"api_key": "${K}"}, "channel": {}, "vllm": {"instances": URLS}},
            id="both-blocks",
        ),
        pytest.param(channel(api_key=["${K}", 5]), id="bad-list-item"),
    ],
)
def test_config_errors_never_show_a_key(tmp_path: Path, settings: Any) -> None:
    """A ConfigError message never contains an API key's value."""
    message = load_error(tmp_path, settings=settings, environ={"K": KEY})
    assert KEY not in message


@pytest.mark.parametrize(
    ("toml", "where"),
    [
        ('[gateway]\nport = "8080"\n', "gateway.port"),
        ('[gateway]\nworkers = "2"\n', "gateway.workers"),
        ('[dispatch]\nmax_queue_per_instance = "4"\n', "dispatch.max_queue_per_instance"),
        ('[shared]\nstrict_caps = "no"\n', "shared.strict_caps"),
        ("[gateway]\ndrain_delay = true\n", "gateway.drain_delay"),
    ],
)
def test_a_string_or_boolean_where_a_number_is_meant_is_an_error(
    tmp_path: Path, toml: str, where: str
) -> None:
    """A quoted number or a boolean in place of a number is a type error, not a guess."""
    message = load_error(tmp_path, toml)
    assert where in message
    assert message.count("(got") <= 1  # the value once, not twice


def test_a_number_from_the_environment_is_still_a_number(tmp_path: Path) -> None:
    """`${VAR}` always expands to a string; that one may stand for a number or a boolean."""
    environ = {**ENV, "PORT": "9123", "STRICT": "true"}
    config = load_ok(tmp_path, '[gateway]\nport = "${PORT}"\n', environ=environ)
    assert config.gateway.port == 9123
