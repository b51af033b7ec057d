"""The two hops' bodies, as vLLM's KV connector reads them (proxy/disaggregate.py)."""

from __future__ import annotations

import json

import orjson
import pytest

from gateway.proxy import jsoncodec
from gateway.proxy.disaggregate import PREFILL_PARAMS, decode_body, prefill_body, transfer_params

CLIENT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_completion_tokens": 64,
    "max_tokens": 64,
    "min_tokens": 8,
    "stream": True,
    "stream_options": {"include_usage": True},
    "temperature": 0.5,
}


def test_the_prefill_hop_computes_the_prompt_and_one_token_without_a_stream() -> None:
    sent = orjson.loads(prefill_body(CLIENT))
    assert sent["max_tokens"] == 1
    assert sent["max_completion_tokens"] == 1
    assert sent["min_tokens"] == 1  # above the maximum, vLLM would refuse it
    assert sent["stream"] is False
    assert "stream_options" not in sent
    assert sent["kv_transfer_params"] == dict(PREFILL_PARAMS)
    assert sent["kv_transfer_params"]["do_remote_decode"] is True
    # The rest is the client's, untouched.
    assert {k: sent[k] for k in ("model", "messages", "temperature")} == {
        k: CLIENT[k] for k in ("model", "messages", "temperature")
    }


def test_the_prefill_hop_adds_no_field_the_client_did_not_send_but_max_tokens() -> None:
    sent = orjson.loads(prefill_body({"model": "m", "prompt": "x", "min_tokens": 0}))
    assert set(sent) == {
        "model",
        "prompt",
        "min_tokens",
        "max_tokens",
        "stream",
        "kv_transfer_params",
    }
    assert sent["min_tokens"] == 0


def test_the_decode_hop_is_the_clients_body_with_the_params_verbatim() -> None:
    params = {"do_remote_prefill": True, "remote_block_ids": [3, 4], "remote_engine_id": "e"}
    sent = orjson.loads(decode_body(CLIENT, params))
    assert sent == {**CLIENT, "kv_transfer_params": params}


@pytest.mark.parametrize(
    ("answer", "params"),
    [
        (
            b'{"choices":[],"kv_transfer_params":{"remote_engine_id":"e"}}',
            {"remote_engine_id": "e"},
        ),
        (b'{"choices":[]}', None),  # the connector is off there
        (b'{"kv_transfer_params":null}', None),
        (b'{"kv_transfer_params":{}}', None),
        (b'{"kv_transfer_params":[1]}', None),
        (b"[1,2]", None),
        (b"not json", None),
    ],
)
def test_a_prefill_answers_params_are_read_only_when_they_are_an_object(
    answer: bytes, params: dict[str, str] | None
) -> None:
    assert transfer_params(answer) == params


def test_a_lone_surrogate_still_makes_both_hops_bodies() -> None:
    """A lone surrogate, which vLLM's parser takes, is written back as it reads it
    (orjson refuses to write one: a 500 before)."""
    payload = jsoncodec.loads(b'{"prompt": "\\ud800 lone", "max_tokens": 4}')
    prefill = json.loads(prefill_body(payload))
    decode = json.loads(decode_body(payload, {"remote_block_ids": [1]}))
    for hop in (prefill, decode):
        assert hop["prompt"] == "\ud800 lone"
    assert prefill["max_tokens"] == 1
    assert decode["kv_transfer_params"] == {"remote_block_ids": [1]}
