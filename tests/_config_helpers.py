"""Builders the configuration loader's tests share: write a config.toml and settings.json
into a temporary folder, load them, and read back keys or the error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from gateway.config.load import Config, ConfigError, load

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
