"""The request handler for the proxied routes: check, place, forward, stream back.

Per request: validate the headers and the key, read the body once (bounded), parse it
once, pick the lane from the estimated prompt size, then loop over attempts: get an
instance from the dispatcher, send, and either relay the answer or retry elsewhere.
Nothing reaches the client until an attempt is committed (a non-retryable status, or
the first streamed token), so a retry is always invisible to the client. After that a
failure ends the stream with an in-band SSE error in the route's API's shape.

Each attempt ends as a value (`attempt.py`: `Committed` or `Failed`), and whether a
failed one is tried again elsewhere is the dispatch core's `plan_retry`. Relaying an
answer once an attempt has one is `relay.py`'s job; the proxy alone writes the request's
`Exchange`, from the records those return.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web

from gateway import errors
from gateway.config.load import Config
from gateway.dispatch import (
    GiveUp,
    Hop,
    Lane,
    Outcome,
    Priority,
    RetryBudget,
    Ticket,
    judge_status,
    plan_retry,
)
from gateway.dispatch.affinity import prompt_blocks, prompt_text
from gateway.fleet.dispatcher import Dispatcher, Lease
from gateway.lifecycle import Lifecycle
from gateway.observe import log, request_id
from gateway.observe.exchange import Exchange, tokens_used
from gateway.observe.metrics import ERROR_KINDS, Metrics
from gateway.observe.recorder import EXCHANGE, Recorder
from gateway.proxy import anthropic_body, jsoncodec
from gateway.proxy.attempt import (
    Call,
    Committed,
    Failed,
    failed_to_send,
    send_body,
    send_headers,
    taken_back,
    vllm_priority,
)
from gateway.proxy.body import InvalidField, ask_usage, wants_stream
from gateway.proxy.disaggregate import PrefillHop
from gateway.proxy.intake import Intake, max_tokens_of
from gateway.proxy.limiter import Grant, Limiter
from gateway.proxy.migration import Migration
from gateway.proxy.prompt_ids import PromptIds
from gateway.proxy.tenants import DEFAULT, TENANT, Tenant
from gateway.proxy.tokenizer import TokenCounter
from gateway.relay import continuation
from gateway.relay.continuation import Transcript
from gateway.relay.records import Broken, Unusable, Whole
from gateway.relay.relay import Relay, StreamAnswer
from gateway.routes import CHAT, COMPLETIONS, EMBEDDINGS, Route
from gateway.upstream.client import Upstream
from gateway.upstream.endpoint import Endpoint
from gateway.upstream.response import AttemptFailed, UpstreamResponse

if TYPE_CHECKING:
    from gateway.observe.tracing import Span, Spans

_log = log.get("gateway.proxy")

# A long-lane stream may wait this many `timeout.read`s for its first token (and between
# two events): a long prefill behind others takes longer than a read should.
LONG_TTFT_FACTOR = 4
LOGGED_MODEL_CHARS = 100  # of a model name the fleet does not know, in the access line


__all__ = ["CHAT", "COMPLETIONS", "EMBEDDINGS", "Endpoint", "Proxy", "Route"]


@dataclass
class _Asked:
    """What a request asks, as `Proxy.handle`'s stages read it: the body as it goes on (a
    default model or a usage request written in), and what was read of it."""

    body: bytes
    payload: dict[str, Any]
    stream: bool = False  # the client asked for server-sent events
    hide_usage: bool = False  # the gateway asked for the stream's usage chunk: keep it back
    model: str | None = None  # served and allowed (intake.served_model)
    prompt: dict[str, Any] = field(default_factory=dict)  # as the instance renders it
    kv_chain: tuple[int, ...] = ()  # its blocks' hashes for a KV events index
    kv_block_size: int = 0


class Proxy:
    def __init__(
        self,
        config: Config,
        dispatcher: Dispatcher,
        upstream: Upstream,
        metrics: Metrics,
        endpoints: dict[str, Endpoint],
        counter: TokenCounter,
        lifecycle: Lifecycle | None = None,
        prompt_ids: PromptIds | None = None,
    ) -> None:
        self.dispatcher = dispatcher
        self.upstream = upstream
        self.metrics = metrics
        self.endpoints = endpoints
        self.counter = counter
        self.prompt_ids = prompt_ids  # token ids for the KV events index (prompt_ids.py)
        self.intake = Intake(config, dispatcher, metrics)
        # Long-lane requests carry the [prefill] tag as their lane name in logs and metrics.
        self.lane_names = metrics.lane_names  # the long lane is named by [prefill].tag
        self.budget = RetryBudget()  # the core's ratio, 0.2 (docs/decisions/0017)
        self.limiter = Limiter(dispatcher.clock)  # each named key's limits
        self.affinity = config.dispatch.prefix_index_blocks != 0
        self.clock = dispatcher.clock
        self.spans: Spans | None = None
        if config.otlp_traces_url:
            from gateway.observe import (
                tracing,  # the otel extra is imported only by a gateway that traces
            )

            self.spans = tracing.start(config.otlp_traces_url)
        # Shutdown is the lifecycle's: it holds the requests in progress and says when
        # their drain time is up.
        self.lifecycle = lifecycle or Lifecycle()
        self.prefill_hop = PrefillHop(dispatcher, upstream, metrics, endpoints)
        self.relay = Relay(
            metrics, config.channel.timeout.write, dispatcher.clock, lambda: self.aborting
        )
        self.migration = Migration(dispatcher, upstream, self.relay, metrics, endpoints)
        slo, batch = config.file.slo, config.file.slo.batch
        short, long = self.lane_names[Lane.SHORT], self.lane_names[Lane.LONG]
        self.recorder = Recorder(
            metrics,
            {
                (short, Priority.INTERACTIVE): (slo.ttft, slo.tpot),
                (long, Priority.INTERACTIVE): (slo.long_ttft, slo.long_tpot),
                (short, Priority.BATCH): (batch.ttft, batch.tpot),
                (long, Priority.BATCH): (batch.long_ttft, batch.long_tpot),
            },
        )
        self.apply(config)

    def know(self, endpoints: dict[str, Endpoint]) -> None:
        """The instances' endpoints now (a reload, discovery). Those of removed instances
        stay known, so a request still on one finishes normally."""
        self.endpoints.update(endpoints)

    def apply(self, config: Config) -> None:
        """Take a (reloaded) configuration: what is read per request changes from here on,
        here and in the parts the proxy builds (intake, relay, recorder), each through its
        own `apply`. The parts it is handed (upstream, token counter) are applied by whoever
        built them (reload.py).

        Requests in progress keep what they read at their start.
        """
        self.config = config
        self.loaded_at = time.time()  # wall clock, for /admin/config
        self.waiting_for_restart: list[str] = []  # settings a reload left (reload.py)
        channel = config.channel
        self.default_model = channel.default_model
        self.threshold = config.prefill.long_input_threshold
        self.request_timeout = config.gateway.request_timeout
        self.retry = channel.retry
        self.ttft_allowance = {
            Lane.SHORT: channel.timeout.read,
            Lane.LONG: channel.timeout.read * LONG_TTFT_FACTOR,
        }
        self.intake.apply(config)
        self.relay.apply(config)
        self.recorder.apply(config)

    @property
    def aborting(self) -> bool:
        return self.lifecycle.aborting

    # ------------------------------------------------------------ handler

    async def handle(self, request: web.Request, route: Route) -> web.StreamResponse:
        """One request's walk: opened, read, checked, counted, laned, admitted, ticketed,
        then forwarded (in one hop or two); a refusal answered in the route's shape."""
        ex = self._opened(request, route)
        headers = {request_id.HEADER: ex.request_id}  # a stream sends its headers itself
        tenant = request.get(TENANT, DEFAULT)
        grant: Grant | None = None  # the key's limits' claim, settled once it is over
        task = asyncio.current_task()
        if task is not None:
            self.lifecycle.track(task)
        try:
            self._tag(request, ex, headers)
            asked = await self._read(request, route, ex)
            self._fill_in(route, asked)
            self._check_model(asked, tenant, ex)
            await self._count_tokens(route, asked, ex)
            lane = self._lane(ex)
            grant = await self.limiter.admit(tenant, ex, route, headers)
            ex.priority = tenant.priority
            ticket = self._ticket(asked, lane, tenant, ex)
            call = self._call(request, route, asked, lane, ticket, headers, tenant)
            if route.disaggregates and self.dispatcher.has_prefill_role:
                return await self._disaggregated(call, ex, ticket, asked.payload)
            return await self._forward(call, ex, ticket)
        except errors.GatewayError as exc:
            return self._refused(exc, route, ex, headers)
        except asyncio.CancelledError:
            if self.aborting and ex.status == 0 and task is not None:
                task.uncancel()  # our own drain deadline, not the client: answer it
                return self._shutting_down(route, ex, headers)
            self._client_left(ex)
            raise
        finally:
            self._settle(ex, tenant, grant, task)

    # The stages of `handle`, in the order a request walks them.

    def _opened(self, request: web.Request, route: Route) -> Exchange:
        """The request's record, as the middleware opened it (recorder.py), for this route."""
        ex = request.get(EXCHANGE) or Exchange(route.name, request_id.current(), self.clock())
        ex.route = route.name  # the middleware records it (recorder.py)
        ex.metered = route.metered
        return ex

    def _tag(self, request: web.Request, ex: Exchange, headers: dict[str, str]) -> None:
        """The request's tag (echoed and logged) and the client headers passed through."""
        # The key was checked first (auth.py's middleware): an unauthenticated request
        # names no metric label (its tag would use up the bounded tag slots).
        ex.tag = self.intake.tag(request)
        if ex.tag:
            headers["X-Request-Tag"] = ex.tag
            structlog.contextvars.bind_contextvars(tag=ex.tag)
        ex.forward = self.intake.passthrough(request)

    async def _read(self, request: web.Request, route: Route, ex: Exchange) -> _Asked:
        """The body, read once (bounded) and parsed once."""
        if route.form:  # an upload goes on byte for byte: its model is not filled in
            body, payload = await self.intake.form_body(request)
        else:
            body, payload = await self.intake.json_body(request)
        ex.bytes_received = len(body)  # as read: a chunked body has no Content-Length
        if route.kv_connected and "kv_transfer_params" in payload:
            raise errors.BadRequest(
                "kv_transfer_params names hosts and KV blocks on the instances and is "
                "set by the gateway only; remove it from the request",
                param="kv_transfer_params",
            )
        return _Asked(body, payload)

    def _fill_in(self, route: Route, asked: _Asked) -> None:
        """The default model where none is named; whether it streams; a stream's usage asked."""
        body, payload = asked.body, asked.payload
        if payload.get("model") is None and self.default_model and not route.form:
            body = jsoncodec.with_field(body, payload, "model", self.default_model)
            payload["model"] = self.default_model
        try:  # read as vLLM reads it ("true" and 1 stream), before any instance is asked
            asked.stream = route.streams and wants_stream(payload)
        except InvalidField as bad:
            raise errors.BadRequest(str(bad), param=bad.field) from None
        # whose tokens these are is read from the instance's usage
        if asked.stream and route.asks_usage:
            body, asked.hide_usage = ask_usage(body, payload)
        asked.body = body

    def _check_model(self, asked: _Asked, tenant: Tenant, ex: Exchange) -> None:
        """The model, served by the fleet and allowed to the key (404, 403), as a label."""
        try:
            asked.model = self.intake.served_model(asked.payload, tenant)
        except errors.GatewayError:  # not served (404), or not this key's (403)
            self._label_model(ex, asked.payload.get("model"))
            raise
        self._label_model(ex, asked.model)

    async def _count_tokens(self, route: Route, asked: _Asked, ex: Exchange) -> None:
        """The prompt as the instance renders it, and its tokens: exact where an instance's
        KV events index can look its token ids up, else counted or estimated."""
        payload = asked.payload
        # What the instance renders into the prompt: a Messages body as vLLM converts it.
        prompt = asked.prompt = (
            anthropic_body.as_chat(payload) if route.api == "anthropic" else payload
        )
        # Its token ids, where an instance's KV events index can look them up: then its
        # count is exact too.
        ids = await self.prompt_ids.chain(prompt, asked.model) if self.prompt_ids else None
        if ids is None:
            ex.prompt_tokens = await self.counter.count(prompt, self.config.prefill)
        else:
            ex.prompt_tokens = len(ids[0])
            _, asked.kv_chain, asked.kv_block_size = ids
        ex.max_tokens = max_tokens_of(payload)

    def _lane(self, ex: Exchange) -> Lane:
        """The long lane above the threshold, else the short one; bound to the log context."""
        lane = Lane.LONG if ex.prompt_tokens > self.threshold else Lane.SHORT
        ex.lane = self.lane_names[lane]
        structlog.contextvars.bind_contextvars(lane=ex.lane)
        return lane

    def _ticket(self, asked: _Asked, lane: Lane, tenant: Tenant, ex: Exchange) -> Ticket:
        """What the dispatcher places: lane, deadline, size, model, prefix, key."""
        return self.dispatcher.new_ticket(
            lane,
            ex.started + self.request_timeout,
            tokens=ex.prompt_tokens,
            max_tokens=ex.max_tokens,
            model=asked.model,
            prefix=prompt_blocks(prompt_text(asked.prompt)) if self.affinity else (),
            kv_chain=asked.kv_chain,
            kv_block_size=asked.kv_block_size,
            priority=tenant.priority,
            key=tenant.name,
        )

    def _call(
        self,
        request: web.Request,
        route: Route,
        asked: _Asked,
        lane: Lane,
        ticket: Ticket,
        headers: dict[str, str],
        tenant: Tenant,
    ) -> Call:
        """The request as each attempt sends it."""
        # A stream its instance breaks may go on elsewhere (migration.py), unless the
        # request is one a continuation cannot reproduce.
        migrate = asked.stream and self.retry.migrations > 0
        not_migrated = continuation.refusal(route, asked.payload) if migrate else "off"
        call = Call(
            request,
            route,
            asked.body,
            asked.stream,
            lane,
            ticket.deadline,
            headers,
            asked.hide_usage,
            not_migrated=not_migrated,
        )
        if route.prioritized:
            call = vllm_priority(call, asked.payload, tenant.vllm_priority)
        return call

    def _refused(
        self, exc: errors.GatewayError, route: Route, ex: Exchange, headers: dict[str, str]
    ) -> web.StreamResponse:
        """The gateway's own error, recorded and answered in the route's API's shape."""
        ex.status = exc.status
        ex.refused = ex.refused or exc.rejection  # the scheduler's reason, if it refused
        return exc.response(headers, route.api)

    def _shutting_down(
        self, route: Route, ex: Exchange, headers: dict[str, str]
    ) -> web.StreamResponse:
        """The answer to a request the drain deadline cut (503, retry elsewhere)."""
        error = errors.ShuttingDown(
            "the gateway is shutting down",
            retry_after=self.dispatcher.retry_after,
        )
        ex.status = error.status
        return error.response(headers, route.api)

    def _client_left(self, ex: Exchange) -> None:
        """The client closed the connection: a stream it cut is counted as such."""
        if ex.status == 200:
            self.metrics.stream_aborts.labels("client").inc()
            ex.cut = "client"
        ex.status = 499  # the client closed the connection (nginx's code for it)

    def _settle(
        self, ex: Exchange, tenant: Tenant, grant: Grant | None, task: asyncio.Task[Any] | None
    ) -> None:
        """Whatever the end: the key's limits settled with the tokens used, the key's answered
        tokens counted, the request no longer in progress."""
        used = tokens_used(ex)
        if grant is not None:
            self.limiter.settle(grant, sum(used))
        if used[1]:
            self.dispatcher.answered(tenant.name, used[1])
        if task is not None:
            self.lifecycle.done(task)

    def _label_model(self, ex: Exchange, model: object) -> None:
        """The model as a metric label: a model the fleet knows, else "other" (and then, for
        the access line only, the name asked for, cut short)."""
        if not isinstance(model, str):
            return
        if self.dispatcher.knows_model(model):
            ex.model = model
        else:
            ex.model, ex.requested_model = "other", model[:LOGGED_MODEL_CHARS]

    async def _disaggregated(
        self, call: Call, ex: Exchange, ticket: Ticket, payload: dict[str, Any]
    ) -> web.StreamResponse:
        """A request of a fleet with prefill instances: in two hops if the core says its
        prefill is worth moving off the decode instance (disaggregate.py), else whole."""
        if not self.dispatcher.splits(ticket):
            ex.hop_path = "whole"
            self.metrics.hops.labels("whole").inc()
            return await self._forward(call, ex, ticket)
        allowance = self.ttft_allowance[call.lane]
        call, ticket = await self.prefill_hop.run(call, ex, ticket, payload, allowance)
        if ticket.hop is not Hop.DECODE:
            return await self._forward(call, ex, ticket)
        decode_from, waited = self.clock(), ex.queue_wait
        try:
            return await self._forward(call, ex, ticket)
        finally:
            if not ex.answered:  # its blocks wait on the prefill instance for vLLM's timeout
                self.metrics.kv_unclaimed.inc()
            queue = ex.queue_wait - waited
            self.metrics.hop_seconds.labels("decode_queue").observe(queue)
            if ex.ttft is not None:
                first = ex.started + ex.ttft - decode_from - queue
                self.metrics.hop_seconds.labels("decode").observe(max(0.0, first))

    async def _forward(self, call: Call, ex: Exchange, ticket: Ticket) -> web.StreamResponse:
        """Attempt, and attempt again elsewhere while the retry plan allows."""
        self.budget.record_request(self.clock())
        tried: frozenset[str] = frozenset()
        last: Failed | None = None
        while True:
            ex.attempts += 1
            if tried:
                ticket = self.dispatcher.retry_ticket(ticket, tried)
            queued = self.clock()
            try:
                lease = await self.dispatcher.lease(ticket)
            except errors.GatewayError:
                if last is None:
                    raise
                return self._answer(last, ex)  # nowhere left to retry
            finally:
                ex.queue_wait += self.clock() - queued
            ex.instance = lease.instance
            structlog.contextvars.bind_contextvars(server=lease.instance)
            result = await self._attempt(call, ex, lease)
            if isinstance(result, Committed) and result.broken is not None:
                return await self.migration.run(
                    call,
                    ex,
                    ticket,
                    tried | {lease.instance},
                    result.broken,
                    self.retry.migrations,
                    self.ttft_allowance[call.lane],
                )
            if isinstance(result, Committed):
                return result.response
            if result.final:
                return self._answer(result, ex)
            tried = tried | {lease.instance}
            now = self.clock()
            plan = plan_retry(
                untried=self.dispatcher.untried_available(
                    call.lane, tried, ticket.model, ticket.hop
                ),
                attempt=ex.attempts,
                max_attempts=self.retry.max_attempts,
                deadline=call.deadline,
                now=now,
                budget=self.budget,
                base=self.retry.backoff_base,
                cap=self.retry.backoff_max,
                rng=self.dispatcher.rng,
            )
            if isinstance(plan, GiveUp):
                self.metrics.retries_refused.labels(plan.why).inc()
                return self._answer(result, ex)
            last = result
            self.metrics.retries.labels(result.reason).inc()
            _log.info("retrying", reason=result.reason, delay_s=round(plan.delay, 3))
            await asyncio.sleep(plan.delay)

    async def _attempt(self, call: Call, ex: Exchange, lease: Lease) -> Committed | Failed:
        """Send the request to the leased instance and judge its answer.

        Whatever way it ends, cancellation included, the lease goes back once with what
        the attempt says about the instance.
        """
        span: Span | None = None
        if self.spans is not None and ex.span is not None:
            span = self.spans.attempt(ex.span, ex.attempts, lease.instance)
        endpoint = self.endpoints[lease.instance]
        remaining = call.deadline - self.clock()
        # A stream must show its first token within the lane's allowance; a plain answer
        # arrives whole, so only the deadline bounds it.
        allowance = min(remaining, self.ttft_allowance[call.lane]) if call.stream else remaining
        result: Committed | Failed | None = None  # None: cancelled
        response: UpstreamResponse | None = None
        stream: StreamAnswer | None = None  # the same answer, when it is a stream's
        opened = self.clock()
        try:
            try:
                url = endpoint.url + call.route.upstream_path
                headers = send_headers(call, ex, endpoint, span.span_id if span else None)
                response = await self.upstream.open(
                    "POST",
                    url,
                    body=send_body(call, endpoint),
                    headers=headers,
                    timeout=max(0.001, allowance),
                )
                ex.answered = True
                lease.evictable(response.close)  # until it commits (Scheduler.overbooked)
                if call.stream:  # the relay splices its body once committed
                    stream = response
            except AttemptFailed as failed:
                retry_after = self.dispatcher.retry_after
                result = failed_to_send(failed, retry_after)
            else:
                result = await self._judge(call, ex, lease, response, stream, opened)
            if lease.evicted and isinstance(result, Failed):
                result = taken_back(lease.instance, self.dispatcher.limits)
            return result
        finally:
            if response is not None:
                response.close()  # idempotent; closing (not pooling) aborts unfinished work
            if isinstance(result, Failed):
                if result.reason in ERROR_KINDS:  # no usable answer (not a retryable status)
                    self.metrics.instance_errors.labels(lease.instance, result.reason).inc()
                lease.release(result.outcome, result.note)
            elif isinstance(result, Committed):
                lease.release(result.outcome, result.error)
            else:
                lease.release(Outcome.NEUTRAL)
            if call.route.timed and lease.first_token_at is not None:
                ex.ttft = lease.first_token_at - ex.started
            if span is not None:
                got = response.status if response is not None else None
                reason = result.reason if isinstance(result, Failed) else "cancelled"
                span.end(got or reason, lane=ex.lane, model=ex.model)

    async def _judge(
        self,
        call: Call,
        ex: Exchange,
        lease: Lease,
        response: UpstreamResponse,
        stream: StreamAnswer | None,
        opened: float,
    ) -> Committed | Failed:
        """Pass the answer on, or fail the attempt: the status table decides which.

        `stream` is the answer again when the request was a stream's (its 200 is relayed
        event by event); `opened` is when the request went out: the first token is due by
        the lane's allowance after it (or the deadline, if sooner).
        """
        status = response.status
        self.metrics.instance_requests.labels(lease.instance, str(status)).inc()
        verdict = judge_status(status)
        if verdict.retry is None and status == 200 and stream is not None:
            first_by = min(call.deadline, opened + self.ttft_allowance[call.lane])
            started = await self.relay.first_chunk(
                stream,
                first_by - self.clock(),
                call.route.token_event,
                hide_usage=call.hide_usage,
                keep=Transcript(call.route) if call.not_migrated is None else None,
            )
            if isinstance(started, Unusable):
                return Failed(started.reason, Outcome.FAILURE, started.error)
            lease.evictable(None)  # its first token is out: it is running there
            ex.status = 200  # committed: a cancellation from here on is the client leaving
            streamed = await self.relay.stream(
                call,
                stream,
                started,
                lease,
                sent_at=opened,
                silence=self.ttft_allowance[call.lane],  # between two data events
            )
            if isinstance(streamed, Broken):  # migration.py continues it, or ends it
                return Committed(streamed.response, Outcome.FAILURE, "stream_broken", streamed)
            if streamed.error == "stream_broken" and call.not_migrated not in (None, "off"):
                self.metrics.migrations.labels(call.not_migrated, "refused").inc()
            ex.status, ex.tokens, ex.tpot = streamed.status, streamed.tokens, streamed.tpot
            ex.cut, ex.usage_prompt_tokens = streamed.cut, streamed.prompt_tokens
            return Committed(streamed.response, streamed.outcome, streamed.error)
        whole = await self.relay.whole(
            response, lease.instance, call.headers, max(0.001, call.deadline - self.clock())
        )
        lease.evictable(None)  # whole (or broken): nothing left to take back
        if isinstance(whole, Unusable):
            # A busy or failing instance's broken answer still says it was busy or failing.
            outcome = verdict.outcome if verdict.retry is not None else Outcome.FAILURE
            return Failed(whole.reason, outcome, whole.error)
        if verdict.retry is not None:
            return Failed(verdict.retry, verdict.outcome, whole)
        ex.status, ex.tokens, ex.usage_prompt_tokens = status, whole.tokens, whole.prompt_tokens
        return Committed(whole.response, verdict.outcome)

    def _answer(self, failed: Failed, ex: Exchange) -> web.StreamResponse:
        """Answer with the last attempt's failure: the instance's own answer, or ours."""
        if isinstance(failed.answer, Whole):
            ex.status, ex.tokens = failed.answer.response.status, failed.answer.tokens
            return failed.answer.response
        raise failed.answer
