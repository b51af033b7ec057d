"""Request bodies through jsoncodec: orjson's speed, Python json's reading and writing."""

from __future__ import annotations

import json

import pytest

from gateway.proxy import jsoncodec
from gateway.proxy.jsoncodec import MAX_DEPTH, nested_within

BODIES = [
    b'{"model": "m", "messages": [{"role": "user", "content": "caf\\u00e9 \xe2\x9c\x93"}]}',
    b' {"a": [1, 2.5, true, null, {"b": "c"}], "n": -0.0}\n',
]


@pytest.mark.parametrize("body", BODIES)
def test_loads_reads_what_json_reads(body: bytes) -> None:
    """Valid JSON parses to the value Python's json gives."""
    assert jsoncodec.loads(body) == json.loads(body)


@pytest.mark.parametrize(
    "body",
    [
        b'{"temperature": NaN}',
        b'{"x": Infinity}',
        b'{"x": 1e400}',
        b'{"t": "\\ud800"}',
        '{"model": "m"}'.encode("utf-16"),
    ],
    ids=["nan", "infinity", "past-a-double", "lone-surrogate", "utf-16"],
)
def test_loads_takes_what_only_json_takes(body: bytes) -> None:
    """What orjson refuses but vLLM's json takes still parses, to json's value."""
    got, want = jsoncodec.loads(body), json.loads(body)
    assert repr(got) == repr(want)


@pytest.mark.parametrize("body", [b"{", b"[1,]", b"\xff", b""])
def test_invalid_json_raises_jsons_error(body: bytes) -> None:
    """A body that is not JSON raises what json.loads raises, so the client's 400 says the same."""
    with pytest.raises(ValueError, match=r".") as ours:
        jsoncodec.loads(body)
    with pytest.raises(ValueError, match=r".") as theirs:
        json.loads(body)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize(
    "source",
    [
        b'{"messages": [{"role": "user", "content": "caf\\u00e9 \xe2\x9c\x93"}], "n": 1.50}',
        b'  {\n "temperature": NaN, "seed": 123456789012345678901234567890, "t": "\\ud800"}',
        b"{}",
        b" { } ",
    ],
    ids=["plain", "what-only-json-takes", "empty", "empty-with-space"],
)
def test_a_new_field_is_spliced_into_the_clients_bytes(source: bytes) -> None:
    """A field the body lacks goes in front; every byte the client sent stays as it was."""
    payload = json.loads(source)
    out = jsoncodec.with_field(source, payload, "model", "sim-model")
    assert out.replace(b'"model":"sim-model"', b"").replace(b"{,", b"{") == source
    got = json.loads(out)
    assert repr(got) == repr({"model": "sim-model", **payload})


@pytest.mark.parametrize(
    "source",
    [b'{"model": null, "n": 1}', '{"n": 1}'.encode("utf-16")],
    ids=["null-model", "utf-16"],
)
def test_a_field_to_overwrite_or_a_non_utf8_body_is_written_as_json_writes_it(
    source: bytes,
) -> None:
    """With the key already there (null), or a UTF-16 body, the payload is written by json,
    as the gateway always did."""
    payload = json.loads(source)
    out = jsoncodec.with_field(source, payload, "model", "m")
    assert out == json.dumps({**payload, "model": "m"}).encode()


@pytest.mark.parametrize("container", ["[", '{"a":'])
def test_a_body_nested_past_the_bound_is_caught_at_its_depth(container: str) -> None:
    """MAX_DEPTH arrays or objects within each other pass; one more does not."""
    close = {"[": "]", '{"a":': "}"}[container]
    for depth, within in ((MAX_DEPTH, True), (MAX_DEPTH + 1, False)):
        body = (container * depth + "1" + close * depth).encode()
        assert nested_within(body, jsoncodec.loads(body)) is within, depth


def test_many_brackets_side_by_side_are_not_depth() -> None:
    """A wide body (more brackets than the bound, none deep) is walked and passes."""
    body = ("[" + ",".join(["[1]"] * (3 * MAX_DEPTH)) + "]").encode()
    assert nested_within(body, jsoncodec.loads(body))
