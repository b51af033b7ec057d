"""Configuration: `config.toml` and `settings.json`, validated once into frozen models.

`load(config_path, settings_path)` is the only entry point. It reads both files,
expands `${VAR}` (and `${VAR:-default}`) from the environment, validates them, and
returns a `Config`. Every problem raises `ConfigError`, whose message names the file,
the field path and the bad value, so the CLI can exit before any port is bound.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from .dispatch.select import STRATEGIES

Lane = Literal["short", "long", "any"]

_M = TypeVar("_M", bound=BaseModel)
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class ConfigError(Exception):
    """A configuration file is missing, unreadable or invalid; the message says where."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# ---------------------------------------------------------------- config.toml


class GatewaySection(_Frozen):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    base_url: str | None = None
    api_key_env: str | None = "GATEWAY_API_KEY"
    request_timeout: float = Field(120.0, gt=0)
    max_connections: int = Field(64, ge=1)
    # Long-lane prompts are tens of KiB; base64 images are MiBs. 16 MiB covers both.
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    drain_timeout: float = Field(30.0, ge=0)

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None:
            _check_http_url(value)
        return value

    @field_validator("port", mode="before")
    @classmethod
    def _not_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):  # pydantic's lax int would take true as port 1
            raise ValueError("expected a port number, got a boolean")
        return value


class HealthSection(_Frozen):
    rise: int = Field(2, ge=1)
    fall: int = Field(3, ge=1)
    probe_timeout: float = Field(2.0, gt=0)
    eject_after_failures: int = Field(5, ge=1)
    ejection_base: float = Field(10.0, gt=0)
    ejection_max: float = Field(300.0, gt=0)
    max_ejected_fraction: float = Field(0.5, ge=0, le=1)
    metrics_stale_after: float | None = Field(None, gt=0)


class DispatchSection(_Frozen):
    strategy: str = "least_busy"
    health_check_interval: float = Field(10.0, gt=0)
    max_queue_per_instance: int = Field(32, ge=0)
    # vLLM's own default; set it to the --max-num-seqs your instances run with.
    max_num_seqs: int = Field(256, ge=1)
    gateway_queue_size: int = Field(1024, ge=0)
    health: HealthSection = HealthSection()

    @field_validator("strategy")
    @classmethod
    def _known_strategy(cls, value: str) -> str:
        if value not in STRATEGIES:
            names = ", ".join(sorted(STRATEGIES))
            raise ValueError(f"unknown strategy {value!r}; expected one of {names}")
        return value


class PrefillSection(_Frozen):
    tag: str = Field("prefill", min_length=1, max_length=64)
    long_input_threshold: int = Field(4096, ge=1)
    max_long_per_instance: int = Field(2, ge=1)
    long_ttft_factor: float = Field(4.0, ge=1)
    # None: estimate; "instance": ask an instance's /tokenize near the threshold;
    # a path: a local HuggingFace tokenizer.json (needs the `tokenizers` package).
    tokenizer: str | None = None

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_source(cls, value: str | None) -> str | None:
        if value is None or value == "instance":
            return value
        if not Path(value).is_file():
            raise ValueError(f"expected 'instance' or the path of a tokenizer.json, got {value!r}")
        try:
            import tokenizers  # noqa: F401
        except ImportError:
            raise ValueError(
                "a tokenizer.json needs the 'tokenizers' package: pip install tokenizers"
            ) from None
        return value


class SloSection(_Frozen):
    """Objectives per lane, in seconds; goodput counts streamed requests that meet both."""

    ttft: float = Field(2.0, gt=0)
    tpot: float = Field(0.1, gt=0)
    long_ttft: float = Field(15.0, gt=0)
    long_tpot: float = Field(0.1, gt=0)


class ConfigFile(_Frozen):
    gateway: GatewaySection = GatewaySection()
    dispatch: DispatchSection = DispatchSection()
    prefill: PrefillSection = PrefillSection()
    slo: SloSection = SloSection()


# -------------------------------------------------------------- settings.json


class Timeouts(_Frozen):
    connect: float = Field(10.0, gt=0)
    read: float = Field(120.0, gt=0)
    write: float = Field(30.0, gt=0)


class RetrySettings(_Frozen):
    max_attempts: int = Field(3, ge=1, le=10)
    backoff_base: float = Field(0.5, ge=0)
    backoff_max: float = Field(8.0, ge=0)
    budget_ratio: float = Field(0.2, ge=0, le=1)


class Channel(_Frozen):
    base_url: str | None = None
    api_key: SecretStr | list[SecretStr] | None = None
    api_key_env: str | None = None
    default_model: str | None = None
    timeout: Timeouts = Timeouts()
    retry: RetrySettings = RetrySettings()
    headers: dict[str, str] = Field(default_factory=dict)

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None:
            _check_http_url(value)
        return value


class InstanceSpec(_Frozen):
    url: str
    name: str | None = None
    lane: Lane = "any"
    api_key_env: str | None = None
    weight: float = Field(1.0, gt=0)
    max_num_seqs: int | None = Field(None, ge=1)

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        _check_http_url(value)
        return value.rstrip("/")

    @property
    def label(self) -> str:
        """The name used in metrics and logs: the configured name, else host:port."""
        if self.name:
            return self.name
        parts = urlsplit(self.url)
        # Never user:password@ from the URL: the label goes into metrics and logs.
        return parts.netloc.rpartition("@")[2] + parts.path


class VllmSection(_Frozen):
    instances: list[InstanceSpec] = Field(min_length=1)
    tensor_parallel_size: int = Field(1, ge=1)

    @field_validator("instances", mode="before")
    @classmethod
    def _strings_are_urls(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [{"url": item} if isinstance(item, str) else item for item in value]
        return value

    @model_validator(mode="after")
    def _unique(self) -> VllmSection:
        seen: set[str] = set()
        for spec in self.instances:
            if spec.url in seen:
                raise ValueError(f"instance {spec.url!r} is listed twice")
            if spec.label in seen:
                raise ValueError(f"instance name {spec.label!r} is used twice")
            seen.update((spec.url, spec.label))
        return self


class Settings(_Frozen):
    channel: Channel = Channel()
    vllm: VllmSection

    @model_validator(mode="before")
    @classmethod
    def _seed_block_name(cls, data: Any) -> Any:
        # The seed post calls the channel block after its hosted service.
        if isinstance(data, dict) and "taotoken" in data:
            if "channel" in data:
                raise ValueError("give either 'channel' or 'taotoken', not both")
            data = {("channel" if k == "taotoken" else k): v for k, v in data.items()}
        return data


# ---------------------------------------------------------------- the result


class Config(_Frozen):
    """Both files, validated, plus what is derived from them once."""

    file: ConfigFile
    settings: Settings
    api_keys: tuple[SecretStr, ...]
    config_path: str
    settings_path: str

    @property
    def gateway(self) -> GatewaySection:
        return self.file.gateway

    @property
    def dispatch(self) -> DispatchSection:
        return self.file.dispatch

    @property
    def prefill(self) -> PrefillSection:
        return self.file.prefill

    @property
    def channel(self) -> Channel:
        return self.settings.channel

    @property
    def instances(self) -> list[InstanceSpec]:
        return self.settings.vllm.instances

    @property
    def route_prefixes(self) -> tuple[str, ...]:
        """Path prefixes the OpenAI routes are served under: `/v1`, bare, and base_url's."""
        prefixes = ["/v1", ""]
        for url in (self.gateway.base_url, self.channel.base_url):
            path = urlsplit(url).path.rstrip("/") if url else ""
            if path and path != "/v1":
                prefixes += [path, path + "/v1"] if not path.endswith("/v1") else [path]
        return tuple(dict.fromkeys(prefixes))

    def with_listen(self, host: str | None, port: int | None) -> Config:
        """A copy whose listen address is overridden by the command line."""
        changes: dict[str, Any] = {}
        if host is not None:
            changes["host"] = host
        if port is not None:
            changes["port"] = port
        if not changes:
            return self
        try:
            gateway = GatewaySection.model_validate({**self.gateway.model_dump(), **changes})
        except ValidationError as exc:
            problems = "; ".join(f"{_dotted(e['loc'])}: {e['msg']}" for e in exc.errors())
            raise ConfigError(f"command line: --host/--port: {problems}") from None
        return self.model_copy(update={"file": self.file.model_copy(update={"gateway": gateway})})


def load(
    config_path: str | Path,
    settings_path: str | Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    allow_no_key: bool = False,
) -> Config:
    """Read, expand and validate both files; raise `ConfigError` naming what is wrong."""
    env = os.environ if environ is None else environ
    config_path = Path(config_path)
    settings_path = Path(settings_path) if settings_path else config_path.parent / "settings.json"
    raw_file = _expand(_read_toml(config_path), env, str(config_path), ())
    raw_settings = _expand(_read_json(settings_path), env, str(settings_path), ())
    block = "taotoken" if "taotoken" in raw_settings else "channel"
    file = _validate(ConfigFile, raw_file, config_path)
    settings = _validate(Settings, raw_settings, settings_path, {"channel": block})
    keys = _api_keys(file, settings, env, settings_path, block)
    if not keys and not allow_no_key:
        names = [n for n in (file.gateway.api_key_env, settings.channel.api_key_env) if n]
        where = " or ".join(f"the environment variable {n}" for n in names) or "no variable"
        raise ConfigError(
            f"no API key configured: set {where}, or channel.api_key in {settings_path}, "
            "or start with --open to run without a key"
        )
    for spec in settings.vllm.instances:
        if spec.api_key_env and not env.get(spec.api_key_env):
            raise ConfigError(
                f"{settings_path}: vllm.instances ({spec.url}).api_key_env: "
                f"environment variable {spec.api_key_env} is not set"
            )
    return Config(
        file=file,
        settings=settings,
        api_keys=keys,
        config_path=str(config_path),
        settings_path=str(settings_path),
    )


def _api_keys(
    file: ConfigFile, settings: Settings, env: Mapping[str, str], settings_path: Path, block: str
) -> tuple[SecretStr, ...]:
    keys: list[str] = []
    configured = settings.channel.api_key
    single = isinstance(configured, SecretStr)
    secrets: list[SecretStr] = (
        [configured] if isinstance(configured, SecretStr) else configured or []
    )
    for index, secret in enumerate(secrets):
        value = secret.get_secret_value().strip()
        if not value:
            where = f"{block}.api_key" + ("" if single else f"[{index}]")
            raise ConfigError(f"{settings_path}: {where}: the key is empty")
        keys.append(value)
    # An env var may hold several comma-separated keys, for rotation.
    for name in (file.gateway.api_key_env, settings.channel.api_key_env):
        if name and env.get(name):
            keys.extend(k.strip() for k in env[name].split(",") if k.strip())
    return tuple(SecretStr(k) for k in dict.fromkeys(keys))


def _check_http_url(value: str) -> None:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http:// or https:// URL with a host, got {value!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"the URL {value!r} must not carry a query or fragment")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        raise ValueError(f"bad port in URL {value!r}") from exc


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text: {exc}") from None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object at the top, got {type(data).__name__}")
    return data


def _expand(value: Any, env: Mapping[str, str], file: str, path: tuple[str | int, ...]) -> Any:
    """Replace `${VAR}` / `${VAR:-default}` in every string; an unset VAR is an error."""
    if isinstance(value, str):

        def substitute(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            if default is not None:  # as in the shell: unset or empty takes the default
                return env.get(name) or default
            if name in env:
                return env[name]
            raise ConfigError(
                f"{file}: {_dotted(path)}: environment variable {name} is not set "
                f"(referenced as {match.group(0)})"
            )

        return _ENV_REF.sub(substitute, value)
    if isinstance(value, dict):
        return {k: _expand(v, env, file, (*path, k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v, env, file, (*path, i)) for i, v in enumerate(value)]
    return value


def _validate(
    model: type[_M], data: dict[str, Any], path: Path, block_names: Mapping[str, str] | None = None
) -> _M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        lines = [f"{path}: {len(exc.errors())} problem(s):"]
        for error in exc.errors():
            loc = error["loc"]
            if loc and block_names and loc[0] in block_names:
                loc = (block_names[str(loc[0])], *loc[1:])  # name the block as the file does
            where = _dotted(loc) or "(top level)"
            value = error.get("input")
            # Whole blocks may hold keys (after ${VAR} expansion): show only scalars, and
            # nothing at all under a key field.
            hidden = (
                error["type"] == "missing"
                or (isinstance(value, dict | list) and bool(value))
                or any(isinstance(p, str) and "api_key" in p for p in loc)
            )
            shown = "" if hidden else f" (got {_show(value)})"
            lines.append(f"  {where}: {error['msg']}{shown}")
        raise ConfigError("\n".join(lines)) from None


def _dotted(loc: tuple[str | int, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part.isidentifier() or part in ("str", "InstanceSpec", "SecretStr"):
            continue  # union branch tags pydantic adds; they say nothing to an operator
        else:
            out += ("." if out else "") + part
    return out


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
