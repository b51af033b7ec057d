"""JSON bodies on the request path: parsed once with orjson, and written again only where
a hop needs another body (`dumps`).

orjson parses a prompt-sized body several times faster than Python's `json`. It refuses
some of what vLLM's own parser (Python's `json`, via Starlette) takes: NaN and Infinity,
numbers past a double, lone surrogates, UTF-16 bodies; those go through `json`, which also
words the error a client sees for a body that is not JSON. (orjson reads an integer past
64 bits as a float: the gateway reads only routing fields from the value, and the body
goes on as the client wrote it.)

When the gateway fills in a field (the default model), it is spliced into the client's
bytes instead of writing the whole payload again: cheaper, and every other byte (key
order, number spelling, NaN) stays the client's.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

_JSON_SPACE = (b" ", b"\t", b"\n", b"\r")


def loads(body: bytes) -> Any:
    """The value of `body`; raises ValueError (or RecursionError) as `json.loads` does."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return json.loads(body)


# Containers within containers a body may hold. Python's `json` (vLLM's parser, and ours
# after orjson) stops near 1,000 with a RecursionError that vLLM answers with a 500, which
# would count against the instance's health; any code that walks a body recursively stops
# sooner. No request a client means to send comes near: tool schemas nest a dozen deep.
MAX_DEPTH = 128


def nested_within(body: bytes, value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether `value` (parsed from `body`) nests at most `limit` containers deep. A body
    with no more brackets than that cannot be deeper: counted at C speed, it spares the
    walk for nearly every request."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return True
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return False
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values() if isinstance(v, (dict, list)))
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item if isinstance(v, (dict, list)))
    return True


def dumps(value: Any) -> bytes:
    """`value` as JSON: orjson's, or Python's `json`'s for what `loads` took and orjson
    will not write (a lone surrogate), escaped as vLLM's parser reads it back."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return json.dumps(value).encode()


def with_field(source: bytes, payload: dict[str, Any], key: str, value: Any) -> bytes:
    """`source` (which parsed to `payload`) with `key` set to `value`."""
    start = 0
    while source[start : start + 1] in _JSON_SPACE:
        start += 1
    if key not in payload and source[start : start + 1] == b"{":  # UTF-8, no such key yet
        field = json.dumps(key).encode() + b":" + json.dumps(value).encode()
        rest = source[start + 1 :]
        return source[: start + 1] + field + (b"," if payload else b"") + rest
    changed = json.loads(source)  # a key to overwrite, or not UTF-8: written as before
    changed[key] = value
    return json.dumps(changed).encode()
