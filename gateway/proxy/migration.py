"""Request migration: a stream its instance broke after the client got part of it goes on
on another instance (relay/continuation.py says how the request and the events change).

A break (the instance reset the connection, ended without `data: [DONE]`, or went quiet
past the lane's allowance) of a stream that can be continued gives the proxy a `Broken`
stream instead of one ended with the in-band error. `Migration.run` then places a
continuation like a retry (a new ticket, the instances already tried excluded, within the
request's deadline), at most `[channel.retry] migrations` times, and relays its events to
the same client response, rewritten into one stream. If none can be placed or every
continuation breaks too, the stream ends with the in-band error, as it would have.

Each break is counted in `gateway_migrations_total{reason,outcome}`; the access line says
`migrated` (how many continuations) and `migrated_to` (their instances, in order).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from aiohttp import web

from gateway import errors
from gateway.dispatch import Outcome, Ticket
from gateway.fleet.dispatcher import Dispatcher, Lease
from gateway.observe import log
from gateway.observe.exchange import Exchange
from gateway.observe.metrics import Metrics
from gateway.proxy import jsoncodec
from gateway.proxy.attempt import Call, send_headers
from gateway.relay import continuation
from gateway.relay.continuation import Rewriter, Sent, Transcript
from gateway.relay.records import Broken, Streamed, Unusable
from gateway.relay.relay import Relay, StreamAnswer
from gateway.upstream.client import Upstream
from gateway.upstream.endpoint import Endpoint
from gateway.upstream.response import AttemptFailed

_log = log.get("gateway.proxy")


class Migration:
    """Continues broken streams on other instances."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        upstream: Upstream,
        relay: Relay,
        metrics: Metrics,
        endpoints: dict[str, Endpoint],
    ) -> None:
        self.dispatcher = dispatcher
        self.upstream = upstream
        self.relay = relay
        self.metrics = metrics
        self.endpoints = endpoints
        self.clock: Callable[[], float] = dispatcher.clock

    async def run(
        self,
        call: Call,
        ex: Exchange,
        ticket: Ticket,
        tried: frozenset[str],
        broken: Broken,
        limit: int,
        allowance: float,
    ) -> web.StreamResponse:
        """Continue `broken` (its instance is in `tried`) at most `limit` times; each
        continuation's first token is due within `allowance` seconds."""
        reason = broken.reason
        first = broken.transcript.sent()
        why_not = _why_not(first)
        if why_not is not None or first is None:
            self.metrics.migrations.labels(why_not or "unreadable", "refused").inc()
            return await self._end(call, ex, broken, None)
        payload = jsoncodec.loads(call.body)
        sent = first
        for _ in range(limit):
            body = continuation.continuation_body(call.route, payload, sent)
            if body is None:  # max_tokens reached: nothing is left to continue
                self.metrics.migrations.labels("no_tokens_left", "refused").inc()
                return await self._end(call, ex, broken, sent.tokens)
            if self.clock() >= call.deadline:
                break
            ticket = self.dispatcher.retry_ticket(ticket, tried)
            try:
                lease = await self.dispatcher.lease(ticket)
            except errors.GatewayError:
                break  # nowhere to go now: the client gets the in-band error
            tried = tried | {lease.instance}
            ex.migrated_to.append(lease.instance)
            rewriter = Rewriter(
                first, call.route, client_usage=not call.hide_usage, before=sent.tokens
            )
            _log.info("migrating", reason=reason, to=lease.instance, tokens_sent=sent.tokens)
            result = await self._continue(call, ex, lease, broken, body, rewriter, allowance)
            if isinstance(result, Streamed):
                self.metrics.migrations.labels(reason, "completed").inc()
                ex.status, ex.cut = result.status, result.cut
                ex.tokens = sent.tokens + (result.tokens or 0)
                if result.prompt_tokens is not None:  # it holds the text sent, re-tokenized
                    ex.usage_prompt_tokens = max(0, result.prompt_tokens - sent.tokens)
                return result.response
            if result is not None:  # it broke too, after sending more
                more = result.transcript.sent()
                if more is None or more.tool_call or more.reasoning:
                    self.metrics.migrations.labels(reason, "failed").inc()
                    return await self._end(call, ex, result, sent.tokens)
                sent = replace(sent, text=sent.text + more.text, tokens=sent.tokens + more.tokens)
                broken, reason = result, result.reason
        self.metrics.migrations.labels(reason, "failed").inc()
        return await self._end(call, ex, broken, sent.tokens)

    async def _continue(
        self,
        call: Call,
        ex: Exchange,
        lease: Lease,
        broken: Broken,
        body: dict[str, Any],
        rewriter: Rewriter,
        allowance: float,
    ) -> Streamed | Broken | None:
        """One continuation on `lease`'s instance: the stream it ended, broke (with more
        sent), or None if it sent nothing usable (the client got nothing from it)."""
        endpoint = self.endpoints[lease.instance]
        outcome, note = Outcome.FAILURE, "migration"
        response = None
        try:
            remaining = call.deadline - self.clock()
            try:
                response = await self.upstream.open(
                    "POST",
                    endpoint.url + call.route.upstream_path,
                    body=jsoncodec.dumps(body),
                    headers=send_headers(call, ex, endpoint, None),
                    timeout=max(0.001, min(remaining, allowance)),
                )
            except AttemptFailed as failed:
                if failed.gateways_own:  # no fault of the instance
                    outcome, note = Outcome.NEUTRAL, failed.kind
                else:
                    note = failed.reported
                return None
            if response.status != 200:
                note = f"status {response.status}"
                return None
            stream: StreamAnswer = response
            started = await self.relay.first_chunk(
                stream,
                min(remaining, allowance),
                call.route.token_event,
                keep=Transcript(call.route),
            )
            if isinstance(started, Unusable):
                note = started.reason
                return None
            result = await self.relay.resume(
                call, broken, stream, started, rewriter.feed, lease, allowance
            )
            if isinstance(result, Streamed) and result.error is None:
                outcome, note = Outcome.SUCCESS, ""
            elif isinstance(result, Streamed):
                outcome, note = result.outcome, result.error or ""
            return result
        finally:
            if response is not None:
                response.close()
            lease.release(outcome, note or None)

    async def _end(
        self, call: Call, ex: Exchange, broken: Broken, tokens: int | None
    ) -> web.StreamResponse:
        """End the stream with the in-band error; `tokens`: what every part sent (None:
        only the first part's, as the relay counts them)."""
        instance = ex.migrated_to[-1] if ex.migrated_to else ex.instance
        streamed = await self.relay.end(call, broken, instance)
        ex.status, ex.cut = streamed.status, streamed.cut
        ex.tokens = streamed.tokens if tokens is None else tokens
        return streamed.response


def _why_not(sent: Sent | None) -> str | None:
    """Why what the first part sent cannot be continued (None: it can)."""
    if sent is None:
        return "unreadable"
    if sent.tool_call:
        return "tool_call"
    if sent.reasoning:
        return "reasoning"
    if sent.finished:
        return "finished"
    return None
