"""Reading a request before it is placed: its key, tag, body and model.

Each check raises the gateway error the client should see, in the order that keeps an
unauthenticated request from learning or naming anything: the key first.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from aiohttp import web

from gateway import errors
from gateway.config.load import Config
from gateway.fleet.dispatcher import Dispatcher
from gateway.observe.metrics import Metrics
from gateway.proxy import auth, form, jsoncodec
from gateway.proxy.auth import KeyChecker
from gateway.proxy.tenants import Tenant, key_checker

TAG_PATTERN = re.compile(r"[A-Za-z0-9._:/@+=-]{1,64}")
# Client headers an instance acts on, passed through (the rest never is): vLLM reads the
# data-parallel rank to pin a request to one engine of a DP deployment. The W3C trace
# headers travel too, through trace_context (validated, or replaced by a fresh trace).
DP_RANK_HEADER = "X-data-parallel-rank"
_DP_RANK = re.compile(r"[0-9]{1,4}")
# The form fields of an upload the gateway routes by; the rest goes on unread.
_FORM_FIELDS = frozenset({"model", "stream"})


def max_tokens_of(payload: dict[str, Any]) -> int:
    """The output tokens a request asks for (0: unknown)."""
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = payload.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


class Intake:
    def __init__(self, config: Config, dispatcher: Dispatcher, metrics: Metrics) -> None:
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.max_body = config.gateway.max_body_bytes  # the app's own limit: fixed at start
        self.apply(config)

    def apply(self, config: Config) -> None:
        """A (reloaded) configuration: the keys, default tag and body timeout it names."""
        self.keys: KeyChecker[Tenant] = key_checker(config)
        self.default_tag = config.channel.headers.get("X-Request-Tag", "")
        self.body_timeout = config.gateway.body_timeout

    def authorize(self, request: web.Request) -> None:
        auth.authorize(self.keys, request)  # the middleware's check, for `Expect` (app.py)

    def tag(self, request: web.Request) -> str:
        tag = request.headers.get("X-Request-Tag")
        if tag is None:
            return self.default_tag
        if not TAG_PATTERN.fullmatch(tag):
            raise errors.InvalidHeader(
                f"X-Request-Tag {tag[:80]!r} is not allowed: use 1-64 characters from "
                "letters, digits and . _ : / @ + = -",
                param="X-Request-Tag",
            )
        return tag

    def passthrough(self, request: web.Request) -> dict[str, str]:
        """The client headers on the allow list that the instance gets as they came."""
        rank = request.headers.get(DP_RANK_HEADER)
        if rank is None:
            return {}
        if not _DP_RANK.fullmatch(rank.strip()):
            raise errors.InvalidHeader(
                f"{DP_RANK_HEADER} {rank[:40]!r} is not a data-parallel rank: "
                "send a non-negative integer",
                param=DP_RANK_HEADER,
            )
        return {DP_RANK_HEADER: rank.strip()}

    async def json_body(self, request: web.Request) -> tuple[bytes, dict[str, Any]]:
        if request.content_type != "application/json":
            raise errors.UnsupportedContentType(
                f"Content-Type {request.content_type!r} is not supported: send application/json"
            )
        body = await self._read(request)
        try:
            payload = jsoncodec.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise errors.InvalidJSON(f"the request body is not valid JSON: {exc}") from None
        except RecursionError:
            raise errors.InvalidJSON("the request body is nested too deeply") from None
        if not isinstance(payload, dict):
            raise errors.InvalidJSON(
                f"the request body must be a JSON object, got {type(payload).__name__}"
            )
        if not jsoncodec.nested_within(body, payload):
            raise errors.InvalidJSON(
                f"the request body is nested too deeply: at most {jsoncodec.MAX_DEPTH} "
                "arrays and objects within each other"
            )
        return body, payload

    async def form_body(self, request: web.Request) -> tuple[bytes, dict[str, Any]]:
        """An upload's bytes, unchanged, and its `model` and `stream` fields as a payload."""
        if request.content_type != "multipart/form-data":
            raise errors.UnsupportedContentType(
                f"Content-Type {request.content_type!r} is not supported on this route: "
                "send multipart/form-data"
            )
        try:
            boundary = form.boundary_of(request.headers.get("Content-Type", ""))
        except form.InvalidForm as bad:
            raise errors.BadRequest(str(bad)) from None
        body = await self._read(request)
        try:
            return body, dict(form.text_fields(body, boundary, _FORM_FIELDS))
        except form.InvalidForm as bad:
            raise errors.BadRequest(f"the multipart/form-data body is malformed: {bad}") from None

    async def _read(self, request: web.Request) -> bytes:
        """The whole body, within max_body_bytes and body_timeout."""
        length = request.content_length
        if length is not None and length > self.max_body:
            raise self._too_large()
        try:
            async with asyncio.timeout(self.body_timeout):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise self._too_large() from None
        except TimeoutError:
            self.metrics.client_connections_closed.labels("body_timeout").inc()
            raise errors.RequestTimeout(
                "the request body did not arrive within the gateway's body_timeout of "
                f"{self.body_timeout:g} s"
            ) from None

    def served_model(self, payload: dict[str, Any], tenant: Tenant) -> str | None:
        """The request's model, if a string; 404 here if no instance serves it, 403 if the
        tenant's key may not use it (the 404 lists only the models the key may use)."""
        model = payload.get("model")
        if not isinstance(model, str):
            tenant.check_model(None)
            return None  # none at all, or not a string: the instance answers that
        fleet = self.dispatcher
        if not fleet.instance_names():
            # No instance at all (discovery found none yet): nothing says the model is
            # wrong, and the fleet may come back; the client should try again.
            raise errors.NoInstanceAvailable(
                "the fleet has no instance now", retry_after=fleet.retry_after
            )
        if not fleet.model_served(model):
            models = fleet.served_models()
            if tenant.models is not None:
                models = [m for m in models if m in tenant.models]
            served = ", ".join(models) or "none yet"
            raise errors.ModelNotFound(
                f"the model {model[:200]!r} does not exist on this gateway's fleet; "
                f"available models: {served}",
                param="model",
            )
        tenant.check_model(model)
        return model

    def _too_large(self) -> errors.PayloadTooLarge:
        return errors.PayloadTooLarge(
            f"the request body is larger than the gateway's limit of {self.max_body} bytes"
        )
