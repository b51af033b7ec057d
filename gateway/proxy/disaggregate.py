"""The prefill hop of a disaggregated request, as vLLM's KV connector expects it.

vLLM disaggregates through a KV connector (NixlConnector and the others) driven by
`kv_transfer_params` in the bodies (vLLM's tests/v1/kv_connector/nixl_integration/
toy_proxy_server.py, and vllm-router's PD mode, send the same):

1. The prefill instance gets the client's body with `max_tokens: 1` (and
   `max_completion_tokens`), no stream, no `stream_options`, `min_tokens` capped at 1,
   and `kv_transfer_params: {"do_remote_decode": true, ...}`. It computes the prompt,
   answers one token, and holds the prompt's KV blocks; its answer's own
   `kv_transfer_params` say where they are (`remote_engine_id`, `remote_host`, ...).
2. The decode instance gets the client's body with those params copied verbatim, reads
   the blocks instead of prefilling, and streams the answer as usual (the proxy's normal
   attempt loop: retries go to other decode instances with the same params).

Both carry the request's one `X-Request-Id`. Where the prefill hop cannot give params
(every attempt failed, no place in time, or an answer without them: the connector is
off), the decode hop goes without them and the decode instance prefills the prompt
itself, as vLLM does when the params are missing; each such fallback is counted.
Whether a request takes two hops, and which prefill instance, is the core's
(dispatch/disaggregation.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from gateway import errors
from gateway.dispatch import Hop, Outcome, Ticket, judge_status
from gateway.fleet.dispatcher import Dispatcher, Lease
from gateway.observe import log
from gateway.observe.exchange import Exchange
from gateway.observe.metrics import FALLBACK_REASONS, Metrics
from gateway.proxy import jsoncodec
from gateway.proxy.attempt import Call, send_body, send_headers
from gateway.upstream.client import Upstream
from gateway.upstream.endpoint import Endpoint
from gateway.upstream.response import AttemptFailed, UpstreamResponse, read_whole

_log = log.get("gateway.proxy")

# What the prefill hop asks of the connector: compute, hold the blocks for a remote decode.
PREFILL_PARAMS: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Prefill instances tried before the decode instance prefills the prompt itself: a
# second covers one instance dying; beyond it the local prefill is sooner.
PREFILL_ATTEMPTS = 2
# How a prefill hop ended without params: a fallback (the metric's reasons), or REFUSED.
FAILED, UNPLACED, NO_PARAMS = FALLBACK_REASONS
REFUSED = "refused"
_AT_MOST_ONE = ("min_tokens", "min_completion_tokens")


def prefill_body(payload: Mapping[str, Any]) -> bytes:
    """The prefill hop's body: the client's, computing the prompt and one token only."""
    body = dict(payload)
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    for key in _AT_MOST_ONE:  # a minimum above the maximum is a 400 from vLLM
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            body[key] = 1
    body["stream"] = False
    body.pop("stream_options", None)
    body["kv_transfer_params"] = dict(PREFILL_PARAMS)
    return jsoncodec.dumps(body)


def decode_body(payload: Mapping[str, Any], params: Mapping[str, Any]) -> bytes:
    """The decode hop's body: the client's, with the prefill answer's params verbatim."""
    return jsoncodec.dumps({**payload, "kv_transfer_params": params})


def transfer_params(answer: bytes) -> dict[str, Any] | None:
    """The `kv_transfer_params` of a prefill answer; None if it has none (or is no JSON)."""
    try:
        parsed = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return None
    params = parsed.get("kv_transfer_params") if isinstance(parsed, dict) else None
    return params if isinstance(params, dict) and params else None


class PrefillHop:
    """Runs a request's prefill hop; returns the decode hop's call and ticket."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        upstream: Upstream,
        metrics: Metrics,
        endpoints: dict[str, Endpoint],
    ) -> None:
        self.dispatcher = dispatcher
        self.upstream = upstream
        self.metrics = metrics
        self.endpoints = endpoints
        self.clock: Callable[[], float] = dispatcher.clock

    async def run(
        self,
        call: Call,
        ex: Exchange,
        ticket: Ticket,
        payload: Mapping[str, Any],
        allowance: float,
    ) -> tuple[Call, Ticket]:
        """Prefill `call`'s prompt on a prefill instance (each attempt within `allowance`
        seconds); the decode hop reads its blocks. Without params, a whole request."""
        params, fallback = await self._prefill(call, ex, ticket, payload, allowance)
        decode = self.dispatcher.retry_ticket(ticket, frozenset())  # a new id
        if params is None:
            ex.hop_path = fallback
            self.metrics.hops.labels("whole").inc()
            if fallback != REFUSED:  # a refusal is the request's own fault, no fallback
                self.metrics.hop_fallbacks.labels(fallback).inc()
                _log.info("prefill_fallback", reason=fallback)
            return call, decode  # whole, on a decode instance
        ex.hop_path = "two_hop"
        self.metrics.hops.labels("two_hop").inc()
        body = decode_body(payload, params)
        return dataclasses.replace(call, body=body), dataclasses.replace(decode, hop=Hop.DECODE)

    async def _prefill(
        self,
        call: Call,
        ex: Exchange,
        ticket: Ticket,
        payload: Mapping[str, Any],
        allowance: float,
    ) -> tuple[dict[str, Any] | None, str]:
        # The prefill leg's body; a priority instance also gets the key's priority there.
        prefill = dataclasses.replace(call, body=prefill_body(payload))
        tried: frozenset[str] = frozenset()
        fallback = UNPLACED
        for _ in range(PREFILL_ATTEMPTS):
            hop = dataclasses.replace(self.dispatcher.retry_ticket(ticket, tried), hop=Hop.PREFILL)
            queued = self.clock()
            try:
                lease = await self.dispatcher.lease(hop)
            except errors.GatewayError:
                return None, fallback  # no prefill place in time: the decode side prefills
            finally:
                waited = self.clock() - queued
                ex.queue_wait += waited
                self.metrics.hop_seconds.labels("prefill_queue").observe(waited)
            ex.prefill_instance = lease.instance
            params, ended = await self._attempt(prefill, ex, lease, allowance)
            if ended != FAILED:  # params, or an answer another instance would give too
                return params, ended
            fallback = FAILED
            tried = tried | {lease.instance}
            if self.clock() >= call.deadline or not self.dispatcher.untried_available(
                call.lane, tried, ticket.model, Hop.PREFILL
            ):
                break
        return None, fallback

    async def _attempt(
        self, call: Call, ex: Exchange, lease: Lease, allowance: float
    ) -> tuple[dict[str, Any] | None, str]:
        """One prefill attempt: the params it got, and how it ended: "params",
        NO_PARAMS (a 200 without them: the connector is off there), REFUSED (a client
        error, which any instance would answer alike) or FAILED (try another)."""
        endpoint = self.endpoints[lease.instance]
        timeout = max(0.001, min(allowance, call.deadline - self.clock()))
        response: UpstreamResponse | None = None
        outcome = Outcome.NEUTRAL  # cancelled: the client left
        error: str | None = None  # for the instance's recent errors
        sent = self.clock()
        try:
            try:
                headers = send_headers(call, ex, endpoint, None)
                response = await self.upstream.open(
                    "POST",
                    endpoint.url + call.route.upstream_path,
                    body=send_body(call, endpoint),
                    headers=headers,
                    timeout=timeout,
                )
                status, answer = await read_whole(response, timeout)
            except AttemptFailed as failed:
                if failed.gateways_own:  # no fault of the prefill instance, and
                    outcome, error = Outcome.NEUTRAL, failed.kind  # every one would fail alike
                    return None, REFUSED
                outcome, error = Outcome.FAILURE, failed.reported
                self.metrics.instance_errors.labels(lease.instance, failed.reported).inc()
                _log.info("prefill_failed", reason=failed.reported, detail=failed.detail)
                return None, FAILED
            self.metrics.instance_requests.labels(lease.instance, str(status)).inc()
            took = self.clock() - sent
            if status != 200:
                verdict = judge_status(status)
                outcome, error = verdict.outcome, f"status {status}"
                _log.info("prefill_failed", reason=f"status_{status}")
                # A client error (400, 404...) is the decode instance's to answer too:
                # it gets the request whole and its answer goes back as usual. Anything
                # else is this instance's failure (or busyness): the prompt goes elsewhere.
                refused = 400 <= status < 500 and status != 429
                return None, REFUSED if refused else FAILED
            self.metrics.hop_seconds.labels("prefill").observe(took)
            lease.prefill_done(self.clock(), took)  # teaches its prefill rate
            outcome = Outcome.SUCCESS
            params = transfer_params(answer)
            return params, NO_PARAMS if params is None else "params"
        finally:
            if response is not None:
                response.close()  # idempotent: a cancelled prefill is aborted there
            lease.release(outcome, error)
