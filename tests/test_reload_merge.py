"""`reload.merge`: which reloaded settings apply live, and which wait for a restart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gateway.config.load import Config, load
from gateway.process.reload import merge


def _load(folder: Path, toml: str, settings: dict[str, Any]) -> Config:
    (folder / "config.toml").write_text(toml)
    (folder / "settings.json").write_text(json.dumps(settings))
    return load(folder / "config.toml")


BASE = {"channel": {"api_key": "k1"}, "vllm": {"instances": ["http://127.0.0.1:9001"]}}


def test_live_settings_apply_and_restart_only_ones_keep_the_running_value(tmp_path: Path) -> None:
    """Timeouts, retry, keys and instances change; port, strategy and SLOs keep their value."""
    old = _load(tmp_path, "[gateway]\nport = 8080\nrequest_timeout = 30\n", BASE)
    new = _load(
        tmp_path,
        '[gateway]\nport = 9090\nrequest_timeout = 60\n[dispatch]\nstrategy = "round_robin"\n'
        "[slo]\nttft = 9\n",
        {
            "channel": {"api_key": "k2", "retry": {"max_attempts": 5}, "timeout": {"read": 7}},
            "vllm": {"instances": ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]},
        },
    )
    config, live, restart = merge(old, new)
    assert restart == ["dispatch.strategy", "gateway.port", "slo.ttft"]
    assert config.gateway.port == 8080
    assert config.dispatch.strategy == "least_busy"
    assert config.file.slo.ttft == old.file.slo.ttft
    assert config.gateway.request_timeout == 60
    assert config.channel.retry.max_attempts == 5
    assert config.channel.timeout.read == 7
    assert [k.get_secret_value() for k in config.api_keys] == ["k2"]
    assert len(config.instances) == 2
    assert "channel.api_key" in live
    assert "vllm.instances" in live


def test_an_unchanged_file_changes_nothing(tmp_path: Path) -> None:
    """Reloading the same files reports no change at all."""
    old = _load(tmp_path, "", BASE)
    config, live, restart = merge(old, _load(tmp_path, "", BASE))
    assert (live, restart) == ([], [])
    assert config == old


def test_command_line_listen_address_survives_a_reload(tmp_path: Path) -> None:
    """A --port given at start is still the port after a reload of a file that names another."""
    old = _load(tmp_path, "[gateway]\nport = 8080\n", BASE).with_listen(None, 7000)
    config, live, restart = merge(old, _load(tmp_path, "[gateway]\nport = 9090\n", BASE))
    assert config.gateway.port == 7000
    assert (live, restart) == ([], [])


def test_the_shared_store_and_tracing_change_only_with_a_restart(tmp_path: Path) -> None:
    """A new [shared] redis_url or [tracing] endpoint is reported and the running one kept."""
    old = _load(tmp_path, '[shared]\nredis_url = "redis://127.0.0.1:6379/0"\n', BASE)
    new = _load(
        tmp_path,
        '[shared]\nredis_url = "redis://127.0.0.1:6380/0"\n'
        '[tracing]\notlp_endpoint = "http://127.0.0.1:4318"\n',
        BASE,
    )
    config, live, restart = merge(old, new)
    assert restart == ["shared.redis_url", "tracing.otlp_endpoint"]
    assert live == []
    assert config.file.shared == old.file.shared
    assert config.file.tracing == old.file.tracing


def test_workers_from_the_command_line_are_not_a_change(tmp_path: Path) -> None:
    """`--workers 2` over a file without it: a reload neither reports nor undoes it."""
    old = _load(tmp_path, "", BASE).with_workers(2)
    config, live, restart = merge(old, _load(tmp_path, "", BASE))
    assert (live, restart) == ([], [])
    assert config.gateway.workers == 2
    assert config.digest() == old.digest()


def test_workers_changed_in_the_file_wait_for_a_restart(tmp_path: Path) -> None:
    """The supervisor's process count is fixed at start: a new value is reported, not applied."""
    old = _load(tmp_path, "[gateway]\nworkers = 2\n", BASE)
    config, _, restart = merge(old, _load(tmp_path, "[gateway]\nworkers = 3\n", BASE))
    assert restart == ["gateway.workers"]
    assert config.gateway.workers == 2


def test_the_digest_tells_configurations_apart_and_hides_the_keys(tmp_path: Path) -> None:
    """A revoked key changes the digest; the digest holds no part of a key."""
    one = _load(tmp_path, "", {**BASE, "channel": {"api_key": ["k1", "k2"]}})
    two = _load(tmp_path, "", BASE)
    assert one.digest() != two.digest()
    assert len(one.digest()) == 12
    assert "k1" not in one.model_dump_json(exclude={"api_keys"})
