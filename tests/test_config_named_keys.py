"""`channel.keys`: named keys read from the environment, a file or `${VAR}`, each with its
models and limits; what makes a list of them invalid, and what is never shown."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _config_helpers import ENV, KEY, channel, load_error, load_ok
from pydantic import SecretStr, ValidationError

from gateway.config.preflight import weak_keys
from gateway.config.schema import KeyEntry, SloSection
from gateway.dispatch import Priority
from gateway.fleet.inputs import FAIR_QUEUE_PER_INSTANCE, scheduler_inputs
from gateway.proxy.tenants import tenant_of

TEAM_KEY = "sk-team-a-0123456789abcdef"
CI_KEY = "sk-ci-key-fedcba9876543210"


def keys(*entries: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return channel(keys=list(entries), **fields)


def test_keys_come_from_the_environment_a_file_and_a_reference(tmp_path: Path) -> None:
    """key_env, key_file (beside settings.json, stripped) and "${VAR}" each give an entry's key."""
    (tmp_path / "ci.key").write_text(CI_KEY + "\n")
    settings = keys(
        {"name": "team-a", "key_env": "TEAM_A_KEY", "models": ["m1"], "requests_per_minute": 60},
        {"name": "ci", "key_file": "ci.key", "tokens_per_minute": 1000, "max_concurrent": 2},
        {"name": "ref", "key": "${REF_KEY}"},
    )
    env = {**ENV, "TEAM_A_KEY": TEAM_KEY, "REF_KEY": "sk-ref-key-000011112222"}
    config = load_ok(tmp_path, settings=settings, environ=env)
    got = {k.entry.name: k.secret.get_secret_value() for k in config.named_keys}
    assert got == {"team-a": TEAM_KEY, "ci": CI_KEY, "ref": "sk-ref-key-000011112222"}
    team, ci, _ = (k.entry for k in config.named_keys)
    assert (team.models, team.requests_per_minute, team.tokens_per_minute) == (["m1"], 60, None)
    assert (ci.tokens_per_minute, ci.max_concurrent) == (1000, 2)
    assert [k.get_secret_value() for k in config.api_keys] == [KEY]  # the unnamed key stays


def test_named_keys_alone_are_enough(tmp_path: Path) -> None:
    """Without any unnamed key, a named one satisfies the rule that some key exists."""
    settings = keys({"name": "team-a", "key": TEAM_KEY})
    config = load_ok(tmp_path, settings=settings, environ={})
    assert config.api_keys == ()
    assert config.keyed


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ({"name": "a"}, "exactly one of key, key_env or key_file"),
        ({"name": "a", "key": "x" * 20, "key_env": "V"}, "not key and key_env"),
        ({"name": "has space", "key": "x" * 20}, "should match pattern"),
        ({"name": "a" * 65, "key": "x" * 20}, "should match pattern"),
        ({"name": "a", "key": "x" * 20, "requests_per_minute": 0}, "greater than or equal to 1"),
        ({"name": "a", "key": "x" * 20, "models": []}, "at least 1 item"),
        ({"name": "a", "key": "x" * 20, "tokens": 5}, "Extra inputs are not permitted"),
    ],
)
def test_a_bad_entry_is_named(tmp_path: Path, entry: dict[str, Any], expected: str) -> None:
    """Each malformed entry fails naming channel.keys and what is wrong with it."""
    message = load_error(tmp_path, settings=keys(entry))
    assert "channel.keys[0]" in message
    assert expected in message


def test_two_entries_with_one_name_are_an_error(tmp_path: Path) -> None:
    """A name used twice would be one label for two keys' traffic."""
    settings = keys({"name": "a", "key": TEAM_KEY}, {"name": "a", "key": CI_KEY})
    assert "key name 'a' is used twice ([0] and [1])" in load_error(tmp_path, settings=settings)


def test_two_entries_with_one_key_are_an_error_that_quotes_no_key(tmp_path: Path) -> None:
    """A key given twice could not say whose requests it carries; the error names the entries."""
    settings = keys({"name": "a", "key": TEAM_KEY}, {"name": "b", "key": f" {TEAM_KEY}\n"})
    message = load_error(tmp_path, settings=settings)
    assert "channel.keys[1] (b): its key is the same as channel.keys[0] (a)'s" in message
    assert TEAM_KEY not in message


def test_a_named_key_equal_to_an_unnamed_one_is_an_error(tmp_path: Path) -> None:
    """The unified key may not also be a named key."""
    message = load_error(tmp_path, settings=keys({"name": "a", "key_env": "GATEWAY_API_KEY"}))
    assert "the same as channel.api_key's" in message


def test_the_unnamed_keys_name_is_reserved_while_they_exist(tmp_path: Path) -> None:
    """`default` names the unnamed keys; a named key may take it only when there are none."""
    settings = keys({"name": "default", "key": TEAM_KEY})
    assert "'default' is the unnamed keys'" in load_error(tmp_path, settings=settings)
    assert load_ok(tmp_path, settings=settings, environ={}).named_keys[0].entry.name == "default"


def test_missing_sources_are_named_never_quoted(tmp_path: Path) -> None:
    """An unset key_env names the variable; an unreadable key_file names the file; an empty
    key says so."""
    assert "environment variable NOPE is not set" in load_error(
        tmp_path, settings=keys({"name": "a", "key_env": "NOPE"})
    )
    assert "key_file: cannot read" in load_error(
        tmp_path, settings=keys({"name": "a", "key_file": "missing.key"})
    )
    (tmp_path / "empty.key").write_text(" \n")
    assert "channel.keys[0] (a): the key is empty" in load_error(
        tmp_path, settings=keys({"name": "a", "key_file": "empty.key"})
    )


def test_a_named_key_of_the_wrong_type_is_not_shown(tmp_path: Path) -> None:
    """A validation error under `key` never quotes the value given."""
    message = load_error(tmp_path, settings=keys({"name": "a", "key": 12345678901234567}))
    assert "12345678901234567" not in message


def test_named_keys_never_appear_in_dumps_and_move_the_digest(tmp_path: Path) -> None:
    """The key is in no repr or dump; a key of another value gives another digest."""
    first = load_ok(tmp_path, settings=keys({"name": "a", "key": TEAM_KEY}))
    for text in (repr(first), str(first), first.model_dump_json()):
        assert TEAM_KEY not in text
    second = load_ok(tmp_path, settings=keys({"name": "a", "key": CI_KEY}))
    assert first.digest() != second.digest()
    again = load_ok(tmp_path, settings=keys({"name": "a", "key": TEAM_KEY}))
    assert again.digest() == first.digest()


def test_weak_named_keys_are_named_in_the_warning(tmp_path: Path) -> None:
    """A short or placeholder named key is warned about by its name, never its value."""
    config = load_ok(tmp_path, settings=keys({"name": "team-a", "key": "changeme"}))
    (warning,) = weak_keys(config)
    assert warning.startswith("the key 'team-a' is weak (a placeholder")


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ("interactive", (Priority.INTERACTIVE, 0)),
        ("batch", (Priority.BATCH, 1)),
        (0, (Priority.INTERACTIVE, 0)),
        (-2, (Priority.INTERACTIVE, -2)),
        (3, (Priority.BATCH, 3)),
    ],
)
def test_a_keys_priority_is_its_class_and_vllms_value(
    setting: str | int, expected: tuple[Priority, int]
) -> None:
    entry = KeyEntry(name="k", key=SecretStr("sk-k-0123456789"), priority=setting)
    tenant = tenant_of(entry)
    assert (tenant.priority, tenant.vllm_priority) == expected


@pytest.mark.parametrize("setting", ["urgent", "1", True, 1.5, 2**63])
def test_a_priority_that_is_neither_class_nor_integer_is_refused(setting: object) -> None:
    with pytest.raises(ValidationError, match="priority"):
        KeyEntry.model_validate({"name": "k", "key": "sk-k-0123456789", "priority": setting})


def test_batch_objectives_shorter_than_interactive_ones_are_refused() -> None:
    with pytest.raises(ValidationError, match=r"batch.long_ttft \(10 s\) must be at least"):
        SloSection.model_validate({"long_ttft": 20, "batch": {"long_ttft": 10}})


def test_shares_reach_the_core_and_named_keys_keep_the_queue_in_the_gateway(
    tmp_path: Path,
) -> None:
    """A key's share goes to the scheduler's limits; with named keys an instance holds none
    waiting beyond its slots unless `max_queue_per_instance` is set, without them 32."""
    settings = keys({"name": "gold", "key": TEAM_KEY, "share": 2}, {"name": "ci", "key": CI_KEY})
    for folder in "abc":
        (tmp_path / folder).mkdir()
    _, limits, _ = scheduler_inputs(load_ok(tmp_path / "a", settings=settings))
    assert limits.shares == {"gold": 2.0, "ci": 1.0}
    assert limits.max_queue_per_instance == FAIR_QUEUE_PER_INSTANCE == 0
    toml = "[dispatch]\nmax_queue_per_instance = 16\n"
    _, limits, _ = scheduler_inputs(load_ok(tmp_path / "b", toml, settings=settings))
    assert limits.max_queue_per_instance == 16
    _, limits, _ = scheduler_inputs(load_ok(tmp_path / "c", settings=channel()))
    assert (limits.max_queue_per_instance, limits.shares) == (32, {})


@pytest.mark.parametrize("share", [0, -1, 1001, "much"])
def test_a_share_that_is_not_a_positive_number_is_refused(tmp_path: Path, share: object) -> None:
    message = load_error(tmp_path, settings=keys({"name": "k", "key": TEAM_KEY, "share": share}))
    assert "share" in message
