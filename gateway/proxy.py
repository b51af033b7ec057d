"""The request handler for the OpenAI routes: check, place, forward, stream back.

Per request: validate the headers and the key, read the body once (bounded), parse it
once, pick the lane from the estimated prompt size, then loop over attempts: get an
instance from the dispatcher, send, and either relay the answer or retry elsewhere.
Nothing reaches the client until an attempt is committed (a non-retryable status, or
the first streamed chunk), so a retry is always invisible to the client. After that a
failure ends the stream with an in-band SSE error and `data: [DONE]`.

Relaying an answer once an attempt has one is `relay.py`'s job.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web

from . import errors, log, request_id, trace_context
from .auth import KeyChecker
from .body import InvalidField, wants_stream
from .config import Config
from .dispatch import (
    GiveUp,
    Lane,
    Outcome,
    RetryAfter,
    RetryBudget,
    Ticket,
    plan_retry,
    reason_for_status,
)
from .dispatch.affinity import prompt_blocks, prompt_text
from .dispatcher import Dispatcher
from .intake import Intake, max_tokens_of
from .metrics import ERROR_KINDS, Metrics
from .recorder import EXCHANGE, Recorder
from .relay import Exchange, Relay, Retryable
from .routes import CHAT, COMPLETIONS, EMBEDDINGS, Route
from .tokenizer import TokenCounter
from .upstream import AttemptFailed, Upstream, UpstreamResponse

if TYPE_CHECKING:
    from .tracing import Span, Spans

_log = log.get("gateway.proxy")


__all__ = ["CHAT", "COMPLETIONS", "EMBEDDINGS", "Proxy", "Route", "Target"]


@dataclass(frozen=True)
class Target:
    """An instance as the proxy sends to it: base URL and the headers it always gets."""

    name: str
    url: str
    headers: dict[str, str]


class Proxy:
    def __init__(
        self,
        config: Config,
        dispatcher: Dispatcher,
        upstream: Upstream,
        metrics: Metrics,
        keys: KeyChecker,
        targets: dict[str, Target],
        counter: TokenCounter,
    ) -> None:
        self.dispatcher = dispatcher
        self.upstream = upstream
        self.metrics = metrics
        self.targets = targets
        self.counter = counter
        self.intake = Intake(config, keys, dispatcher.scheduler, metrics)
        # Long-lane requests carry the [prefill] tag as their lane name in logs and metrics.
        self.lane_names = metrics.lane_names  # the long lane is named by [prefill].tag
        self.budget = RetryBudget(ratio=config.channel.retry.budget_ratio)
        self.affinity = config.dispatch.prefix_index_blocks != 0
        self.clock = dispatcher.clock
        self.spans: Spans | None = None
        if config.otlp_traces_url:
            from . import tracing  # the otel extra is imported only by a gateway that traces

            self.spans = tracing.start(config.otlp_traces_url, config.file.tracing.service_name)
        # Shutdown: the tasks of requests in progress, and whether their drain time is up.
        self._tasks: set[asyncio.Task[Any]] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.relay = Relay(metrics, dispatcher, config.channel.timeout.write)
        self.reconfigure(config, keys, targets)
        slo = config.file.slo
        self.recorder = Recorder(
            metrics,
            {
                self.lane_names[Lane.SHORT]: (slo.ttft, slo.tpot),
                self.lane_names[Lane.LONG]: (slo.long_ttft, slo.long_tpot),
            },
        )

    def reconfigure(self, config: Config, keys: KeyChecker, targets: dict[str, Target]) -> None:
        """Take a (reloaded) configuration: what is read per request changes from here on.

        Requests in progress keep what they read at their start. Targets of removed
        instances stay known, so a request still on one finishes normally.
        """
        self.config = config
        self.keys = keys
        self.targets.update(targets)
        channel = config.channel
        self.default_model = channel.default_model
        self.threshold = config.prefill.long_input_threshold
        self.counter.threshold = self.threshold  # where an exact count is worth asking for
        self.request_timeout = config.gateway.request_timeout
        self.retry = channel.retry
        self.ttft_allowance = {
            Lane.SHORT: channel.timeout.read,
            Lane.LONG: channel.timeout.read * config.prefill.long_ttft_factor,
        }
        self.budget.ratio = channel.retry.budget_ratio  # its counts carry on
        self.relay.write_timeout = channel.timeout.write
        self.upstream.timeouts = channel.timeout
        self.upstream.splice = config.gateway.splice_streams
        self.intake.reconfigure(config, keys)

    @property
    def aborting(self) -> bool:
        return self.relay.aborting

    async def drain(self, timeout: float) -> int:
        """Let requests in progress finish for up to `timeout` s, then end the rest.

        Streams that are still running get an in-band error event and `[DONE]`; requests
        that have not started answering get 503 with Retry-After. Returns how many had to
        be ended.
        """
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        left = len(self._tasks)
        if left:
            self.relay.aborting = True
            for task in list(self._tasks):
                task.cancel()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2.0):
                    await self._idle.wait()
        return left

    # ------------------------------------------------------------ handler

    async def handle(self, request: web.Request, route: Route) -> web.StreamResponse:
        ex = request.get(EXCHANGE) or Exchange(route.name, request_id.current(), self.clock())
        ex.route = route.name  # the middleware records it (recorder.py)
        ex.sse_done, ex.timed = route.sse_done, route.timed
        self._start_trace(request, ex)
        headers = {request_id.HEADER: ex.request_id}  # a stream sends its headers itself
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            self._idle.clear()
        try:
            # The key first: an unauthenticated request names no metric label (its tag
            # would use up the bounded tag slots) and learns nothing about our checks.
            self.intake.authorize(request)
            ex.tag = self.intake.tag(request)
            if ex.tag:
                headers["X-Request-Tag"] = ex.tag
                structlog.contextvars.bind_contextvars(tag=ex.tag)
            ex.forward = self.intake.passthrough(request)
            if route.form:  # an upload goes on byte for byte: its model is not filled in
                body, payload = await self.intake.form_body(request)
            else:
                body, payload = await self.intake.json_body(request)
            if payload.get("model") is None and self.default_model and not route.form:
                payload["model"] = self.default_model
                body = json.dumps(payload).encode()
            try:  # read as vLLM reads it ("true" and 1 stream), before any instance is asked
                stream = route.streams and wants_stream(payload)
            except InvalidField as bad:
                raise errors.BadRequest(str(bad), param=bad.field) from None
            model = self.intake.served_model(payload)
            if model is not None:
                ex.model = model if self.dispatcher.scheduler.knows_model(model) else "other"
            ex.prompt_tokens = await self.counter.count(payload, self.config.prefill)
            ex.max_tokens = max_tokens_of(payload)
            lane = Lane.LONG if ex.prompt_tokens > self.threshold else Lane.SHORT
            ex.lane = self.lane_names[lane]
            structlog.contextvars.bind_contextvars(lane=ex.lane)
            ticket = self.dispatcher.new_ticket(
                lane,
                ex.started + self.request_timeout,
                tokens=ex.prompt_tokens,
                max_tokens=ex.max_tokens,
                model=model,
                prefix=prompt_blocks(prompt_text(payload)) if self.affinity else (),
            )
            return await self._forward(request, route, body, stream, ex, headers, ticket)
        except errors.GatewayError as exc:
            ex.status = exc.status
            return exc.response(headers)
        except asyncio.CancelledError:
            if self.aborting and ex.status == 0 and task is not None:
                task.uncancel()  # our own drain deadline, not the client: answer it
                error = errors.ShuttingDown(
                    "the gateway is shutting down",
                    retry_after=self.dispatcher.scheduler.limits.queue_retry_after,
                )
                ex.status = error.status
                return error.response(headers)
            if ex.status == 200:
                self.metrics.stream_aborts.labels("client").inc()
            ex.status = 499  # the client closed the connection (nginx's code for it)
            raise
        finally:
            if task is not None:
                self._tasks.discard(task)
                if not self._tasks:
                    self._idle.set()
            if ex.span is not None:
                ex.span.end(
                    ex.status,
                    lane=ex.lane,
                    model=ex.model,
                    instance=ex.instance,
                    attempts=ex.attempts,
                    request_id=ex.request_id,
                )

    def _start_trace(self, request: web.Request, ex: Exchange) -> None:
        """The request's trace: the client's, continued, or a new one; its id is logged."""
        client = trace_context.from_headers(request.headers)
        if self.spans is None:
            ex.trace = client or trace_context.fresh()
        else:
            ex.span = self.spans.request(request.path, request.method, client)
            ex.trace = trace_context.TraceContext(
                ex.span.trace_id,
                ex.span.span_id,
                ex.span.flags,
                client.state if client is not None else None,
                from_client=client is not None,
            )
        structlog.contextvars.bind_contextvars(trace_id=ex.trace.trace_id)

    async def _forward(
        self,
        request: web.Request,
        route: Route,
        body: bytes,
        stream: bool,
        ex: Exchange,
        headers: dict[str, str],
        ticket: Ticket,
    ) -> web.StreamResponse:
        lane, deadline = ticket.lane, ticket.deadline
        self.budget.record_request(self.clock())
        tried: frozenset[str] = frozenset()
        last_failure: Retryable | None = None
        while True:
            ex.attempts += 1
            if tried:
                ticket = self.dispatcher.retry_ticket(ticket, tried)
            queued = self.clock()
            try:
                instance = await self.dispatcher.acquire(ticket)
            except errors.GatewayError:
                if last_failure is None:
                    raise
                return self._give_up(last_failure, ex, headers)  # nowhere left to retry
            finally:
                ex.queue_wait += self.clock() - queued
            ex.instance = instance
            structlog.contextvars.bind_contextvars(server=instance)
            try:
                return await self._attempt(
                    request, route, body, lane, stream, ex, headers, ticket.id, deadline
                )
            except Retryable as failed:
                tried = tried | {instance}
                plan: RetryAfter | GiveUp = GiveUp("instances")
                scheduler = self.dispatcher.scheduler
                if scheduler.untried_available(lane, tried, self.clock(), ticket.model):
                    plan = plan_retry(
                        attempt=ex.attempts,
                        max_attempts=self.retry.max_attempts,
                        deadline=deadline,
                        now=self.clock(),
                        budget=self.budget,
                        base=self.retry.backoff_base,
                        cap=self.retry.backoff_max,
                        rng=self.dispatcher.rng,
                    )
                if isinstance(plan, GiveUp):
                    self.metrics.retries_refused.labels(plan.why).inc()
                    return self._give_up(failed, ex, headers)
                last_failure = failed
                self.metrics.retries.labels(failed.reason).inc()
                _log.info("retrying", reason=failed.reason, delay_s=round(plan.delay, 3))
                await asyncio.sleep(plan.delay)

    async def _attempt(
        self,
        request: web.Request,
        route: Route,
        body: bytes,
        lane: Lane,
        stream: bool,
        ex: Exchange,
        headers: dict[str, str],
        ticket_id: int,
        deadline: float,
    ) -> web.StreamResponse:
        target = self.targets[ex.instance]
        send_headers = dict(target.headers)
        send_headers.update(ex.forward)
        if route.form:  # its boundary is in it
            send_headers["Content-Type"] = request.headers["Content-Type"]
        send_headers["X-Request-Id"] = ex.request_id
        span: Span | None = None
        if self.spans is not None and ex.span is not None:
            span = self.spans.attempt(ex.span, ex.attempts, ex.instance)
        if ex.trace is not None:  # the instance's spans hang under this attempt's, if any
            send_headers["traceparent"] = ex.trace.traceparent(span.span_id if span else None)
            if ex.trace.state:
                send_headers["tracestate"] = ex.trace.state
        if ex.tag:
            send_headers["X-Request-Tag"] = ex.tag
        remaining = deadline - self.clock()
        # A stream must show its first token within the lane's allowance; a plain answer
        # arrives whole, so only the deadline bounds it.
        allowance = min(remaining, self.ttft_allowance[lane]) if stream else remaining
        outcome, error = Outcome.NEUTRAL, None
        response: UpstreamResponse | None = None
        opened = self.clock()
        try:
            try:
                response = await self.upstream.open(
                    "POST",
                    target.url + route.upstream_path,
                    body=body,
                    headers=send_headers,
                    timeout=max(0.001, allowance),
                    stream=stream,
                )
            except AttemptFailed as failed:
                outcome, error = Outcome.FAILURE, failed.kind
                raise Retryable(failed.kind, self._attempt_error(failed)) from None
            status = response.status
            self.metrics.instance_requests.labels(ex.instance, str(status)).inc()
            reason = reason_for_status(status)
            if reason is not None:
                # 502/504: the instance is failing. 429/503: busy, it never ran the request.
                outcome = Outcome.FAILURE if status in (502, 504) else Outcome.BUSY
                error = f"status {status}"
                passthrough = await self.relay.whole(response, ex, headers, deadline)
                raise Retryable(reason, passthrough)
            if status == 200 and stream:
                first = await self.relay.first_chunk(response, allowance - (self.clock() - opened))
                # A stream may go without a data event for at most its lane's allowance.
                idle = self.ttft_allowance[lane]
                out, outcome, error = await self.relay.stream(
                    request, response, first, ex, headers, ticket_id, opened, idle
                )
                return out
            answer = await self.relay.whole(response, ex, headers, deadline)
            outcome = Outcome.FAILURE if status >= 500 else Outcome.SUCCESS
            return answer
        except Retryable as failed:
            if error is None:  # failed before commit while reading the first chunk
                outcome, error = Outcome.FAILURE, failed.reason
            if failed.reason in ERROR_KINDS:  # no usable answer (not a retryable status)
                self.metrics.instance_errors.labels(ex.instance, failed.reason).inc()
            raise
        finally:
            if response is not None:
                response.close()  # idempotent; closing (not pooling) aborts unfinished work
            self.dispatcher.release(ticket_id, outcome, error)
            if span is not None:
                got = response.status if response is not None else error or "cancelled"
                span.end(got, lane=ex.lane, model=ex.model)

    def _give_up(
        self, failed: Retryable, ex: Exchange, headers: dict[str, str]
    ) -> web.StreamResponse:
        """Answer with the failure of the last attempt: the instance's own answer, or ours."""
        if isinstance(failed.error, web.Response):
            ex.status = failed.error.status
            failed.error.headers.update(headers)
            return failed.error
        raise failed.error from None

    def _attempt_error(self, failed: AttemptFailed) -> errors.GatewayError:
        if failed.kind == "timeout":
            return errors.UpstreamTimeout(
                f"the vLLM instance did not answer in time ({failed.detail})"
            )
        if failed.kind == "bad_response":
            return errors.UpstreamError(
                f"the vLLM instance's response header was too large or malformed ({failed.detail})"
            )
        # Nothing reached a GPU: the client may retry as soon as an instance is back.
        return errors.NoInstanceAvailable(
            f"could not reach a vLLM instance ({failed.detail})",
            retry_after=self.dispatcher.scheduler.limits.queue_retry_after,
        )
