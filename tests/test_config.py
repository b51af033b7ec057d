"""The configuration loader: `gateway.config.load` and the frozen models it returns."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr, ValidationError

import gateway
from gateway.config import Config, ConfigError, load

REPO = Path(__file__).resolve().parent.parent
DEFAULTS = Path(gateway.__file__).resolve().parent / "defaults"

KEY = "sk-test-0123456789abcdef"
ENV = {"GATEWAY_API_KEY": KEY}
URLS = ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]


def write(tmp_path: Path, toml: str = "", settings: Any = None) -> Path:
    """Write config.toml and settings.json (dict, text or bytes) into tmp_path."""
    config = tmp_path / "config.toml"
    config.write_text(toml, encoding="utf-8")
    if settings is None:
        settings = {"vllm": {"instances": URLS}}
    target = tmp_path / "settings.json"
    if isinstance(settings, bytes):
        target.write_bytes(settings)
    elif isinstance(settings, str):
        target.write_text(settings, encoding="utf-8")
    else:
        target.write_text(json.dumps(settings), encoding="utf-8")
    return config


def load_ok(tmp_path: Path, toml: str = "", settings: Any = None, **kw: Any) -> Config:
    """Write both files and load them, with GATEWAY_API_KEY set unless environ is given."""
    kw.setdefault("environ", ENV)
    return load(write(tmp_path, toml, settings), **kw)


def load_error(tmp_path: Path, toml: str = "", settings: Any = None, **kw: Any) -> str:
    """Write both files, expect `ConfigError`, and return its message."""
    kw.setdefault("environ", ENV)
    config = write(tmp_path, toml, settings)
    with pytest.raises(ConfigError) as info:
        load(config, **kw)
    return str(info.value)


def channel(**fields: Any) -> dict[str, Any]:
    """A settings document with the given channel fields and the two default instances."""
    return {"channel": fields, "vllm": {"instances": URLS}}


def plain(keys: tuple[SecretStr, ...]) -> list[str]:
    """The secret values of loaded keys, in order."""
    return [k.get_secret_value() for k in keys]


# ------------------------------------------------------------- shipped files


def test_repository_seed_files_load() -> None:
    """The repository's config.toml and settings.json load as shipped and give the seed's values."""
    config = load(REPO / "config.toml", environ={"TAOTOKEN_API_KEY": KEY})
    assert len(config.instances) == 4
    assert config.dispatch.strategy == "least_busy"
    assert config.dispatch.max_queue_per_instance == 32
    assert config.prefill.long_input_threshold == 4096
    assert config.channel.retry.max_attempts == 3
    assert config.settings.vllm.tensor_parallel_size == 4
    assert config.channel.default_model == "your-model-name"
    assert {"/v1", "", "/api", "/api/v1"} <= set(config.route_prefixes)
    assert plain(config.api_keys) == [KEY]
    assert config.settings_path == str(REPO / "settings.json")


def test_repository_seed_without_its_key_names_the_variable() -> None:
    """Without TAOTOKEN_API_KEY the seed fails naming the variable and the taotoken.api_key path."""
    with pytest.raises(ConfigError) as info:
        load(REPO / "config.toml", environ={})
    message = str(info.value)
    assert "TAOTOKEN_API_KEY" in message
    assert "taotoken.api_key" in message
    assert str(REPO / "settings.json") in message


def test_packaged_defaults_load_with_gateway_api_key() -> None:
    """The defaults shipped inside the package load when GATEWAY_API_KEY is set."""
    config = load(DEFAULTS / "config.toml", environ=ENV)
    assert [spec.url for spec in config.instances] == URLS
    assert config.channel.default_model == "sim-model"
    assert plain(config.api_keys) == [KEY]


def test_settings_default_to_the_file_beside_the_config(tmp_path: Path) -> None:
    """Without settings_path the loader reads settings.json from the config file's folder."""
    config = load_ok(tmp_path)
    assert config.settings_path == str(tmp_path / "settings.json")
    assert config.config_path == str(tmp_path / "config.toml")


def test_explicit_settings_path_is_used(tmp_path: Path) -> None:
    """An explicit settings_path is read instead of the settings.json beside the config."""
    config_path = write(tmp_path, settings="not json at all")
    other = tmp_path / "elsewhere.json"
    other.write_text(json.dumps({"vllm": {"instances": ["http://10.0.0.9:8000"]}}))
    config = load(config_path, other, environ=ENV)
    assert [spec.url for spec in config.instances] == ["http://10.0.0.9:8000"]
    assert config.settings_path == str(other)


# ------------------------------------------------------------ the block name


@pytest.mark.parametrize("block", ["taotoken", "channel"])
def test_both_block_names_are_accepted(tmp_path: Path, block: str) -> None:
    """The settings block may be named `taotoken` (the seed's name) or `channel`."""
    settings = {block: {"default_model": "m", "api_key": KEY}, "vllm": {"instances": URLS}}
    config = load_ok(tmp_path, settings=settings, environ={})
    assert config.channel.default_model == "m"
    assert plain(config.api_keys) == [KEY]


def test_taotoken_and_channel_together_is_an_error(tmp_path: Path) -> None:
    """Giving both `taotoken` and `channel` is an error that names both and the file."""
    settings = {"taotoken": {}, "channel": {}, "vllm": {"instances": URLS}}
    message = load_error(tmp_path, settings=settings)
    assert "'taotoken'" in message
    assert "'channel'" in message
    assert str(tmp_path / "settings.json") in message


# ------------------------------------------------------------- ${VAR} expansion


def test_env_reference_is_expanded(tmp_path: Path) -> None:
    """`${VAR}` in a string value is replaced by the variable's value."""
    settings = channel(api_key="${MY_KEY}", default_model="${MODEL}")
    config = load_ok(tmp_path, settings=settings, environ={"MY_KEY": KEY, "MODEL": "llama"})
    assert plain(config.api_keys) == [KEY]
    assert config.channel.default_model == "llama"


def test_env_reference_inside_a_longer_string_and_in_toml(tmp_path: Path) -> None:
    """References expand inside longer strings and in config.toml, then validate to their type."""
    toml = '[gateway]\nport = "${PORT}"\nbase_url = "http://${HOST}:9000/${PREFIX}"\n'
    env = {**ENV, "PORT": "9123", "HOST": "gw.internal", "PREFIX": "api"}
    config = load_ok(tmp_path, toml, environ=env)
    assert config.gateway.port == 9123
    assert config.gateway.base_url == "http://gw.internal:9000/api"


def test_env_default_is_used_when_the_variable_is_unset(tmp_path: Path) -> None:
    """`${VAR:-default}` gives the default when VAR is not in the environment."""
    config = load_ok(tmp_path, settings=channel(default_model="${MODEL:-fallback-model}"))
    assert config.channel.default_model == "fallback-model"


def test_env_default_is_ignored_when_the_variable_is_set(tmp_path: Path) -> None:
    """`${VAR:-default}` gives VAR's value when VAR is set."""
    env = {**ENV, "MODEL": "real-model"}
    config = load_ok(tmp_path, settings=channel(default_model="${MODEL:-fallback}"), environ=env)
    assert config.channel.default_model == "real-model"


def test_expanded_values_are_not_expanded_again(tmp_path: Path) -> None:
    """A variable whose value looks like a reference is inserted literally, not expanded again."""
    env = {**ENV, "MODEL": "${OTHER}"}
    config = load_ok(tmp_path, settings=channel(default_model="${MODEL}"), environ=env)
    assert config.channel.default_model == "${OTHER}"


def test_env_default_is_used_when_the_variable_is_empty(tmp_path: Path) -> None:
    """`${VAR:-default}` gives the default when VAR is set but empty, as in the shell."""
    env = {**ENV, "MODEL": ""}
    config = load_ok(tmp_path, settings=channel(default_model="${MODEL:-fallback}"), environ=env)
    assert config.channel.default_model == "fallback"


def test_unset_variable_names_the_variable_and_the_field_path(tmp_path: Path) -> None:
    """An unset `${VAR}` is an error naming the file, the variable and the field path."""
    settings = {"taotoken": {"api_key": "${NOT_SET_ANYWHERE}"}, "vllm": {"instances": URLS}}
    message = load_error(tmp_path, settings=settings)
    assert str(tmp_path / "settings.json") in message
    assert "NOT_SET_ANYWHERE" in message
    assert "taotoken.api_key" in message


def test_unset_variable_in_a_list_names_the_index(tmp_path: Path) -> None:
    """An unset variable inside a list gives a path with the list index."""
    settings = {"vllm": {"instances": [URLS[0], "http://${FLEET_HOST}:8001"]}}
    message = load_error(tmp_path, settings=settings)
    assert "vllm.instances[1]" in message
    assert "FLEET_HOST" in message


def test_unset_variable_in_toml_names_the_toml_file(tmp_path: Path) -> None:
    """An unset variable in config.toml names config.toml and the dotted TOML path."""
    message = load_error(tmp_path, '[gateway]\nhost = "${LISTEN_HOST}"\n')
    assert str(tmp_path / "config.toml") in message
    assert "gateway.host" in message
    assert "LISTEN_HOST" in message


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


# ------------------------------------------------------------------- API keys


def test_no_key_is_an_error_naming_the_variable_and_open(tmp_path: Path) -> None:
    """With no key anywhere, the error names the env var(s) to set and the --open flag."""
    message = load_error(tmp_path, settings=channel(api_key_env="CHANNEL_KEY"), environ={})
    assert "GATEWAY_API_KEY" in message
    assert "CHANNEL_KEY" in message
    assert "--open" in message


def test_allow_no_key_loads_with_zero_keys(tmp_path: Path) -> None:
    """allow_no_key=True loads a configuration that has no key at all, with zero keys."""
    config = load_ok(tmp_path, environ={}, allow_no_key=True)
    assert config.api_keys == ()


def test_api_key_list_gives_several_keys(tmp_path: Path) -> None:
    """api_key given as a list yields each key, in order."""
    config = load_ok(tmp_path, settings=channel(api_key=["k1", "k2", "k3"]), environ={})
    assert plain(config.api_keys) == ["k1", "k2", "k3"]


def test_env_var_may_hold_comma_separated_keys(tmp_path: Path) -> None:
    """The variable named by api_key_env may hold comma-separated keys; blanks are dropped."""
    config = load_ok(tmp_path, environ={"GATEWAY_API_KEY": " k1, k2,,k3 ,"})
    assert plain(config.api_keys) == ["k1", "k2", "k3"]


def test_channel_api_key_env_is_read_too(tmp_path: Path) -> None:
    """channel.api_key_env names a second variable whose keys are added to the gateway's."""
    settings = channel(api_key_env="CHANNEL_KEY")
    config = load_ok(
        tmp_path, settings=settings, environ={"GATEWAY_API_KEY": "a", "CHANNEL_KEY": "b"}
    )
    assert plain(config.api_keys) == ["a", "b"]


def test_gateway_api_key_env_is_configurable(tmp_path: Path) -> None:
    """[gateway].api_key_env names which variable holds the keys."""
    config = load_ok(tmp_path, '[gateway]\napi_key_env = "MY_VAR"\n', environ={"MY_VAR": "x"})
    assert plain(config.api_keys) == ["x"]


def test_duplicate_keys_collapse(tmp_path: Path) -> None:
    """The same key given twice, in the file and the environment, is kept once, in first order."""
    settings = channel(api_key=["k1", " k1 ", "k2"])
    config = load_ok(tmp_path, settings=settings, environ={"GATEWAY_API_KEY": "k2,k3,k1"})
    assert plain(config.api_keys) == ["k1", "k2", "k3"]


def test_keys_never_appear_in_repr_or_str(tmp_path: Path) -> None:
    """repr(), str() and the JSON dump of a loaded config never contain a key's value."""
    file_key, env_key = "sk-file-secret-4242", "sk-env-secret-1717"
    config = load_ok(
        tmp_path, settings=channel(api_key=[file_key]), environ={"GATEWAY_API_KEY": env_key}
    )
    assert plain(config.api_keys) == [file_key, env_key]
    for text in (repr(config), str(config), repr(config.channel), config.model_dump_json()):
        assert file_key not in text
        assert env_key not in text
    assert all(isinstance(k, SecretStr) for k in config.api_keys)


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
