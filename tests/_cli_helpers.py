"""What the command line's tests share: a config folder writer and `python -m gateway` in a
fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KEY = "sk-cli-test-key-0001"
SETTINGS = {"vllm": {"instances": ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]}}


def write(folder: Path, toml: str = "", settings: object = SETTINGS) -> Path:
    """Write config.toml and settings.json into folder; return the config path."""
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "config.toml"
    config.write_text(toml, encoding="utf-8")
    (folder / "settings.json").write_text(json.dumps(settings), encoding="utf-8")
    return config


def run_module(*args: str, key: bool = True) -> subprocess.CompletedProcess[str]:
    """Run `python -m gateway ARGS` in a fresh interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "GATEWAY_API_KEY"}
    if key:
        env["GATEWAY_API_KEY"] = KEY
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
