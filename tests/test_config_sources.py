"""Where `gateway.config.load` takes its values from: the shipped files, the settings block's
names, ${VAR} expansion, and the API keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _config_helpers import ENV, KEY, URLS, channel, load_error, load_ok, plain, write
from pydantic import SecretStr

import gateway
from gateway.config.load import ConfigError, load

REPO = Path(__file__).resolve().parent.parent
DEFAULTS = Path(gateway.__file__).resolve().parent / "defaults"


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
