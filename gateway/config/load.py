"""Configuration: `config.toml` and `settings.json`, validated once into frozen models.

`load(config_path, settings_path)` is the only entry point. It reads both files,
expands `${VAR}` (and `${VAR:-default}`) from the environment, validates them, and
returns a `Config`. Every problem raises `ConfigError`, whose message names the file,
the field path and the bad value, so the CLI can exit before any port is bound.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from pydantic import BaseModel, SecretStr, ValidationError

from gateway.config.schema import (
    CONTROL_CHARACTER,
    UNNAMED_KEY,
    Channel,
    ConfigFile,
    DispatchSection,
    Frozen,
    GatewaySection,
    InstanceConfig,
    KeyEntry,
    PrefillSection,
    Settings,
)
from gateway.config.urls import without_credentials

_M = TypeVar("_M", bound=BaseModel)
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class ConfigError(Exception):
    """A configuration file is missing, unreadable or invalid; the message says where."""


# ---------------------------------------------------------------- the result


class NamedKey(Frozen):
    """A `channel.keys` entry with its key read from where the entry says."""

    entry: KeyEntry
    secret: SecretStr


class Config(Frozen):
    """Both files, validated, plus what is derived from them once."""

    file: ConfigFile
    settings: Settings
    api_keys: tuple[SecretStr, ...]  # the unnamed keys: one key named `default`
    named_keys: tuple[NamedKey, ...] = ()
    config_path: str
    settings_path: str
    # --host/--port, kept so that a reload of the files applies them again.
    listen_override: tuple[str | None, int | None] = (None, None)
    workers_override: int | None = None  # --workers, kept for the same reason
    otlp_traces_url: str | None = None  # where spans go; None: no OpenTelemetry at all

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
    def instances(self) -> list[InstanceConfig]:
        return self.settings.vllm.instances

    @property
    def keyed(self) -> bool:
        """Whether any key is configured (else the gateway runs --open)."""
        return bool(self.api_keys or self.named_keys)

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
        override = (host, port)
        try:
            gateway = GatewaySection.model_validate({**self.gateway.model_dump(), **changes})
        except ValidationError as exc:
            problems = "; ".join(f"{_dotted(e['loc'])}: {e['msg']}" for e in exc.errors())
            raise ConfigError(f"command line: --host/--port: {problems}") from None
        file = self.file.model_copy(update={"gateway": gateway})
        return self.model_copy(update={"file": file, "listen_override": override})

    def with_workers(self, workers: int | None) -> Config:
        """A copy whose `[gateway] workers` is overridden by `--workers`."""
        if workers is None:
            return self
        try:
            gateway = GatewaySection.model_validate(
                {**self.gateway.model_dump(), "workers": workers}
            )
        except ValidationError as exc:
            problems = "; ".join(f"{_dotted(e['loc'])}: {e['msg']}" for e in exc.errors())
            raise ConfigError(f"command line: --workers {workers}: {problems}") from None
        file = self.file.model_copy(update={"gateway": gateway})
        return self.model_copy(update={"file": file, "workers_override": workers})

    def digest(self) -> str:
        """A short hash of the configuration served: processes that agree on it serve alike.

        The keys enter only as their SHA-256 each, so the digest says nothing of them, yet
        a key added or revoked changes it.
        """
        body = self.model_dump_json(exclude={"api_keys", "named_keys"})  # secrets dump masked
        named = [f"{k.entry.name}={_sha256(k.secret)}" for k in self.named_keys]
        keys = sorted([_sha256(k) for k in self.api_keys] + named)
        return hashlib.sha256(f"{body}\n{','.join(keys)}".encode()).hexdigest()[:12]


def _sha256(secret: SecretStr) -> str:
    return hashlib.sha256(secret.get_secret_value().encode()).hexdigest()


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
    named = _named_keys(settings, keys, env, settings_path, block)
    if not keys and not named and not allow_no_key:
        names = list(
            dict.fromkeys(n for n in (file.gateway.api_key_env, settings.channel.api_key_env) if n)
        )
        where = " or ".join(f"the environment variable {n}" for n in names) or "no variable"
        raise ConfigError(
            f"no API key configured: set {where}, or channel.api_key or channel.keys in "
            f"{settings_path}, or start with --open to run without a key"
        )
    for spec in settings.vllm.instances:
        if spec.api_key_env and not env.get(spec.api_key_env):
            raise ConfigError(
                f"{settings_path}: vllm.instances ({spec.url}).api_key_env: "
                f"environment variable {spec.api_key_env} is not set"
            )
        if spec.api_key_env and CONTROL_CHARACTER.search(env[spec.api_key_env]):
            # Sent as `Authorization: Bearer ...`, it could never be written: every
            # request to this instance would fail (the value is not shown: a secret).
            raise ConfigError(
                f"{settings_path}: vllm.instances ({spec.url}).api_key_env: environment "
                f"variable {spec.api_key_env} holds a control character (a trailing newline "
                "from a secret file?); a header cannot carry it"
            )
    return Config(
        file=file,
        settings=settings,
        api_keys=keys,
        named_keys=named,
        config_path=str(config_path),
        settings_path=str(settings_path),
        otlp_traces_url=_otlp_traces_url(file, env, config_path),
    )


def _otel_installed() -> bool:
    try:
        return importlib.util.find_spec("opentelemetry.exporter.otlp.proto.http") is not None
    except ModuleNotFoundError:  # the `opentelemetry` namespace itself is missing
        return False


def _otlp_traces_url(file: ConfigFile, env: Mapping[str, str], path: Path) -> str | None:
    """Where spans go: `[tracing] otlp_endpoint`, else OpenTelemetry's standard variables.

    A base endpoint gets OTLP/HTTP's `/v1/traces`, as the exporter does with
    OTEL_EXPORTER_OTLP_ENDPOINT. Set in the file without the `otel` extra installed, it is
    an error; set only in the environment (perhaps for other software), tracing stays off.
    """
    configured = file.tracing.otlp_endpoint
    signal = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")  # a whole URL, by the spec
    base = configured or (None if signal else env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    if base:
        base = base.rstrip("/")
        url: str | None = base if base.endswith("/v1/traces") else base + "/v1/traces"
    else:
        url = signal or None
    if url is None or _otel_installed():
        return url
    if configured:
        raise ConfigError(
            f"{path}: tracing.otlp_endpoint: spans need the OpenTelemetry packages: "
            "pip install 'vllm-dispatch-gateway[otel]' (or remove the setting)"
        )
    return None


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


def _named_keys(
    settings: Settings,
    unnamed: tuple[SecretStr, ...],
    env: Mapping[str, str],
    settings_path: Path,
    block: str,
) -> tuple[NamedKey, ...]:
    """Each `channel.keys` entry with its key read; two entries (or an entry and the unnamed
    keys) with one key are an error, since a request could not say whose it is."""
    whose: dict[str, str] = {k.get_secret_value(): f"{block}.api_key" for k in unnamed}
    named: list[NamedKey] = []
    for index, entry in enumerate(settings.channel.keys):
        where = f"{settings_path}: {block}.keys[{index}] ({entry.name})"
        if entry.name == UNNAMED_KEY and unnamed:
            raise ConfigError(
                f"{where}: the name {UNNAMED_KEY!r} is the unnamed keys' (api_key, "
                "api_key_env): give this key another name"
            )
        value = _key_value(entry, env, settings_path.parent, where)
        other = whose.setdefault(value, f"{block}.keys[{index}] ({entry.name})")
        if other != f"{block}.keys[{index}] ({entry.name})":
            raise ConfigError(f"{where}: its key is the same as {other}'s: give each its own")
        named.append(NamedKey(entry=entry, secret=SecretStr(value)))
    return tuple(named)


def _key_value(entry: KeyEntry, env: Mapping[str, str], folder: Path, where: str) -> str:
    """The key an entry names: its `key`, the variable `key_env` or the file `key_file`
    (relative to the settings file's folder), stripped; never quoted in an error."""
    if entry.key is not None:
        value = entry.key.get_secret_value()
    elif entry.key_env is not None:
        if not env.get(entry.key_env):
            raise ConfigError(f"{where}: key_env: environment variable {entry.key_env} is not set")
        value = env[entry.key_env]
    else:
        assert entry.key_file is not None  # the schema asks for exactly one source
        path = folder / entry.key_file
        try:
            value = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"{where}: key_file: cannot read {path}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{where}: key_file: {path} is not UTF-8 text") from None
    value = value.strip()
    if not value:
        raise ConfigError(f"{where}: the key is empty")
    return value


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


class FromEnvironment(str):
    """A string that `${VAR}` expansion made: the schema converts it to a number or a
    boolean where one is meant (schema.py, `Frozen`)."""


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

        expanded = _ENV_REF.sub(substitute, value)
        # A value from the environment is always a string; only it may stand for a number
        # or a boolean (`port = "${PORT}"`), never a string written in the file.
        return FromEnvironment(expanded) if expanded != value else expanded
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
                or any(isinstance(p, str) and ("api_key" in p or p == "key") for p in loc)
            )
            shown = "" if hidden else f" (got {_show(value)})"
            lines.append(f"  {where}: {error['msg']}{shown}")
        raise ConfigError("\n".join(lines)) from None


def _dotted(loc: tuple[str | int, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part.isidentifier() or part in ("str", "InstanceConfig", "SecretStr"):
            continue  # union branch tags pydantic adds; they say nothing to an operator
        else:
            out += ("." if out else "") + part
    return out


def _show(value: Any) -> str:
    """A bad value as an error quotes it: short, and a URL without its user and password."""
    text = repr(without_credentials(value) if isinstance(value, str) else value)
    return text if len(text) <= 80 else text[:77] + "..."
