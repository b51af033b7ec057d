"""Simulated vLLM instance: vLLM's OpenAI-compatible HTTP API over a continuous-batching model."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hmac
import ipaddress
import json
import random
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from .sim_anthropic import AnthropicRoutes
from .sim_batching import Engine, EngineBusy, EngineRequest
from .sim_engine import (
    BUSY_MESSAGE,
    MAX_MODEL_LEN,
    VOCAB,
    ApiError,
    Dropped,
    DyingWriter,
    Faults,
    Generation,
    SimConfig,
    SimStats,
    count_message_tokens,
    count_tokens,
    count_tool_tokens,
    dumps,
    embedding_inputs,
    embedding_vector,
    open_message_ids,
    parse_cache_salt,
    parse_ignore_eos,
    parse_max_tokens,
    parse_priority,
    parse_stream,
    parse_tools,
    prompt_token_count,
    prompt_token_ids,
    tokenize_messages,
    tokenize_text,
    tokenize_tools,
    tokens_to_generate,
    usage_body,
)
from .sim_kv_events import KvEventPublisher
from .sim_kv_transfer import (
    PROCESS_REGISTRY,
    KvConnector,
    KvRegistry,
    request_params,
    wants_remote_decode,
    wants_remote_prefill,
)
from .sim_metrics import VllmMetrics
from .sim_prefix_cache import NO_KEYS, BlockKeys
from .sim_responses import ResponsesRoutes
from .sim_routes_extra import ExtraRoutes

__all__ = [
    "BUSY_MESSAGE",
    "Faults",
    "SimConfig",
    "SimInstance",
    "SimStats",
    "count_message_tokens",
    "count_tokens",
]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(body: object, status: int = 200) -> web.Response:
    # Starlette's JSONResponse: compact, and no charset parameter on the content type.
    return web.Response(body=dumps(body).encode(), status=status, content_type="application/json")


class SimInstance:
    """One simulated vLLM server; start() binds it to a loopback port."""

    def __init__(
        self,
        config: SimConfig = SimConfig(),  # noqa: B008 - frozen
        kv_registry: KvRegistry = PROCESS_REGISTRY,
    ) -> None:
        """kv_registry: where the KV connector (config.kv_transfer) finds other instances."""
        self.config = config
        self.faults = Faults()
        self.stats = SimStats()
        self.kv = KvConnector(config, self.stats, kv_registry) if config.kv_transfer else None
        # vLLM's --kv-events-config: its sockets are bound at start, closed at stop.
        self.kv_events = KvEventPublisher(config) if config.kv_events_endpoint is not None else None
        self.engine = self._new_engine()
        self.url = ""
        self._rng = random.Random(config.seed)
        self._runner: web.AppRunner | None = None
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(VllmMetrics(self))
        self.app = web.Application(
            middlewares=[self._v1_middleware], client_max_size=64 * 1024 * 1024
        )
        self.app.on_response_prepare.append(self._mimic_uvicorn)
        self.app.router.add_post("/v1/chat/completions", self._chat)
        self.app.router.add_post("/v1/completions", self._completions)
        self.app.router.add_post("/v1/embeddings", self._embeddings)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_get("/health", self._health)
        self.app.router.add_post("/tokenize", self._tokenize)
        self.app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        self.app.router.add_get("/metrics", self._metrics)
        ExtraRoutes(self).install(self.app.router)
        ResponsesRoutes(self).install(self.app.router)
        AnthropicRoutes(self).install(self.app.router)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on host:port (loopback only; port 0 picks a free one) and return the URL."""
        if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
            raise ValueError(f"refusing to listen on non-loopback host {host!r}")
        if self._runner is not None:
            raise RuntimeError("already started")
        if self.engine.closed:
            self.engine = self._new_engine()
        # handler_cancellation: a client that leaves cancels its handler, which aborts the
        # request in the engine, as vLLM aborts requests of disconnected clients.
        # keepalive_timeout: uvicorn (vLLM's server) drops idle connections after 5 s, and a
        # gateway's connection pool must cope with that.
        runner = web.AppRunner(
            self.app,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=0.1,
            keepalive_timeout=5.0,
        )
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        self._runner = runner
        sockname = runner.addresses[0]
        url_host = f"[{sockname[0]}]" if ":" in sockname[0] else sockname[0]
        self.url = f"http://{url_host}:{sockname[1]}"
        if self.kv is not None:
            self.kv.bind(sockname[0], sockname[1])
        if self.kv_events is not None:
            try:
                await self.kv_events.open(sockname[0])
            except BaseException:
                await self.stop()
                raise
        return self.url

    async def stop(self) -> None:
        """Close the port and cut open connections at once, like a killed process."""
        runner, self._runner = self._runner, None
        if self.kv is not None:
            self.kv.unbind()
        if runner is not None:
            # aiohttp's graceful shutdown would let streams run on; a dead server cuts them.
            for connection in runner.server.connections if runner.server else []:
                if connection.transport is not None:
                    connection.transport.close()
            await runner.cleanup()
        await self.engine.close()
        if self.kv_events is not None:
            await self.kv_events.close()

    def _new_engine(self) -> Engine:
        held = self.kv.held_tokens if self.kv is not None else None
        publish = self.kv_events.publish if self.kv_events is not None else None
        return Engine(self.config, self.stats, held, publish)

    def set_speed(self, speed: float) -> None:
        """Change throughput mid-run; takes effect from the next engine step."""
        self.config = dataclasses.replace(self.config, speed=speed)
        self.engine.speed = speed

    @staticmethod
    async def _mimic_uvicorn(request: web.Request, response: web.StreamResponse) -> None:
        response.headers["Server"] = "uvicorn"

    @web.middleware
    async def _v1_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        is_v1 = request.path.startswith("/v1/")
        if request.method == "POST":
            self.stats.paths[request.path] += 1
        if is_v1 or request.method == "POST":
            self.stats.requests += is_v1 and request.method == "POST"
            self.stats.last_headers = {k.lower(): v for k, v in request.headers.items()}
            if request_id := request.headers.get("X-Request-Id"):
                self.stats.seen_request_ids.append(request_id)
        if is_v1 and request.method != "OPTIONS" and self.config.api_key:
            expected = f"Bearer {self.config.api_key}".encode()
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return _json({"error": "Unauthorized"}, status=401)
        try:
            return await handler(request)
        except ApiError as exc:
            return _json(exc.body(), exc.status)
        except web.HTTPNotFound:
            # FastAPI's answer for unknown routes, not aiohttp's plain text.
            return _json({"detail": "Not Found"}, status=404)
        except web.HTTPMethodNotAllowed:
            return _json({"detail": "Method Not Allowed"}, status=405)

    # --- request parsing ------------------------------------------------------------------

    async def _read_body(self, request: web.Request) -> dict[str, Any]:
        if request.content_type != "application/json":
            raise ApiError(400, "Unsupported Media Type: Only 'application/json' is allowed")
        raw = self.stats.last_body = await request.read()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"JSON decode error: {exc}") from exc
        if not isinstance(body, dict):
            raise ApiError(400, "Request body must be a JSON object")
        model = body.get("model")
        if model is not None and model not in self.config.served_models:
            raise ApiError(404, f"The model `{model}` does not exist.")
        return body

    def _request_id(self, request: web.Request) -> str:
        # vLLM bases the response id on the caller's X-Request-Id when there is one.
        return request.headers.get("X-Request-Id") or f"{self._rng.getrandbits(128):032x}"

    # --- faults -----------------------------------------------------------------------------

    async def _apply_faults(self) -> None:
        faults = self.faults
        if faults.status is not None:
            self.stats.rejected += 1
            raise ApiError(faults.status, f"Simulated failure with status {faults.status}")
        if faults.busy:
            self.stats.rejected += 1
            raise ApiError(503, BUSY_MESSAGE)
        if faults.hang_before_headers:
            try:
                await asyncio.get_running_loop().create_future()
            finally:
                self.stats.cancelled += 1

    def _submit(
        self,
        prompt_tokens: int,
        max_tokens: int,
        token_ids: list[int] | None = None,
        computed: int = 0,
        priority: int = 0,
        keys: BlockKeys = NO_KEYS,
    ) -> EngineRequest:
        try:
            return self.engine.submit(
                prompt_tokens, max_tokens, token_ids, computed, priority, keys
            )
        except EngineBusy as exc:
            self.stats.rejected += 1
            raise ApiError(503, BUSY_MESSAGE) from exc

    @staticmethod
    def _drop(request: web.Request) -> None:
        # close(), not abort(): bytes already written still reach the client, then the body
        # simply ends without the chunked terminator, as when a server process is killed.
        if request.transport is not None:
            request.transport.close()

    # --- generation -------------------------------------------------------------------------

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        await self._apply_faults()
        body = await self._read_body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages: field required (a non-empty list)")
        # vLLM's ChatCompletionRequest: a final message to continue (request migration's
        # continuation) is rendered open, with no generation prompt after it; its text is
        # prompt like any other message's.
        if body.get("continue_final_message") and body.get("add_generation_prompt", True):
            raise ApiError(
                400,
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            )
        tools = parse_tools(body)
        closed, continued = (
            (messages[:-1], messages[-1:]) if body.get("continue_final_message") else (messages, [])
        )
        # Token ids only matter to the prefix cache; counting alone is cheaper. The chat
        # template writes the tools ahead of the messages.
        ids = (
            tokenize_tools(tools)
            + tokenize_messages(closed)
            + [i for m in continued for i in open_message_ids(m)]
            if self.config.prefix_caching
            else None
        )
        count = (
            len(ids)
            if ids is not None
            else count_tool_tokens(tools)
            + count_message_tokens(closed)
            + sum(len(open_message_ids(m)) for m in continued)
        )
        return await self._generate(
            request, body, count, chat=True, token_ids=ids, prompt=[tools, messages]
        )

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        await self._apply_faults()
        body = await self._read_body(request)
        prompt = body.get("prompt")
        prompt_tokens = prompt_token_count(prompt)
        ids = prompt_token_ids(prompt) if self.config.prefix_caching else None
        return await self._generate(
            request, body, prompt_tokens, chat=False, token_ids=ids, prompt=prompt
        )

    async def _generate(
        self,
        request: web.Request,
        body: dict[str, Any],
        prompt_tokens: int,
        *,
        chat: bool,
        prompt: object,
        token_ids: list[int] | None = None,
    ) -> web.StreamResponse:
        """prompt: the request's prompt as JSON (messages and tools, or the prompt), which
        fixes the answer's natural length."""
        max_tokens = parse_max_tokens(body, self.config.default_max_tokens, prompt_tokens)
        stream, include_usage = parse_stream(body)
        priority = parse_priority(body)
        keys = self.block_keys(body.get("model"), parse_cache_salt(body))
        length = tokens_to_generate(
            self.config, prompt, max_tokens, ignore_eos=parse_ignore_eos(body)
        )
        prefix = "chatcmpl-" if chat else "cmpl-"
        # vLLM names the adapter that answered, or else the base model.
        model = body.get("model")
        gen = Generation(
            id=prefix + self._request_id(request),
            created=int(time.time()),
            model=model if model in self.config.lora_adapters else self.config.model,
            chat=chat,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
        )
        die_after = self.faults.die_after_chunks
        # Without a connector vLLM ignores kv_transfer_params, and so does the simulator.
        kv_params = request_params(body) if self.kv is not None else None
        producing = kv_params is not None and wants_remote_decode(kv_params)
        computed = 0
        if kv_params is not None and wants_remote_prefill(kv_params):
            computed = await self._receive_kv(kv_params)
        # instant mode skips the engine: every token is ready at once.
        req = (
            None
            if self.config.instant
            else self._submit(prompt_tokens, length, token_ids, computed, priority, keys)
        )
        resp: web.StreamResponse | None = None
        dropped = done = False
        writer = DyingWriter(die_after)

        try:
            if stream:
                resp = await self._start_stream(request)
                writer.resp = resp
            elif die_after is not None:
                raise Dropped
            while len(gen.tokens) < length:
                if req is not None and await req.next_token() is None:
                    break
                gen.tokens.append(self._rng.choice(VOCAB))
                if stream:
                    await writer.send(gen.token_events(last=len(gen.tokens) == length))
            if self.config.enable_prompt_tokens_details:
                gen.cached_tokens = 0 if req is None else req.cached
            if req is None:
                self.stats.prompt_tokens += prompt_tokens
                self.stats.generation_tokens += len(gen.tokens)
                self.stats.completed += 1
            produced = None
            # Only a request that finished by length keeps its blocks (vLLM's
            # FINISHED_LENGTH_CAPPED); a streamed one holds them too, though its answer has
            # no field to carry the params.
            if self.kv is not None and producing and len(gen.tokens) == max_tokens:
                produced = self.kv.produce(gen.id, prompt_tokens)
            if resp is None:
                done = True
                answer = gen.full_body()
                if produced is not None:
                    answer["kv_transfer_params"] = produced
                return _json(answer)
            await writer.send(gen.tail_events(include_usage))
            done = True
            return resp
        except Dropped:
            dropped = True
            self._drop(request)
            return resp or web.Response(status=500)
        except ConnectionResetError:
            # The client left between two writes; aiohttp only logs errors that escape.
            return resp or web.Response(status=500)
        finally:
            unfinished = self.engine.abort(req) if req is not None else not done
            if dropped:
                self.stats.rejected += 1
            elif unfinished:
                self.stats.cancelled += 1

    def block_keys(self, model: object, cache_salt: str | None = None) -> BlockKeys:
        """What a request's prompt blocks are keyed by besides their tokens, as vLLM keys
        them: the adapter it asked for (none for the base model), its cache_salt."""
        lora = model if isinstance(model, str) and model in self.config.lora_adapters else None
        return BlockKeys(lora_name=lora, cache_salt=cache_salt)

    async def _receive_kv(self, params: dict[str, Any]) -> int:
        """A decode leg's prompt KV, read from the prefill instance its params name: the prompt
        tokens already computed (0 after a fallback to a local prefill)."""
        assert self.kv is not None
        try:
            return await self.kv.receive(params, wait=not self.config.instant)
        except asyncio.CancelledError:
            self.stats.cancelled += 1  # the client left during the transfer
            raise

    @staticmethod
    async def _start_stream(request: web.Request) -> web.StreamResponse:
        # Headers go out before the first token, as Starlette's StreamingResponse does.
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        return resp

    async def _embeddings(self, request: web.Request) -> web.StreamResponse:
        await self._apply_faults()
        body = await self._read_body(request)
        inputs = embedding_inputs(body.get("input"))
        priority = parse_priority(body)
        encoding = body.get("encoding_format", "float")
        if encoding not in ("float", "base64"):
            raise ApiError(400, f"Unsupported encoding_format: {encoding}")
        if self.faults.die_after_chunks is not None:
            self.stats.rejected += 1
            self._drop(request)
            return web.Response(status=500)
        total = sum(count for _, count in inputs)
        if self.config.instant:
            self.stats.prompt_tokens += total
            self.stats.completed += 1
        else:
            req = self._submit(total, 0, priority=priority)
            try:
                while await req.next_token() is not None:
                    pass
            finally:
                if self.engine.abort(req):
                    self.stats.cancelled += 1
        data = []
        for index, (key, _) in enumerate(inputs):
            vector = embedding_vector(f"{self.config.seed}:{key}")
            value: list[float] | str = vector
            if encoding == "base64":
                value = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"index": index, "object": "embedding", "embedding": value})
        return _json(
            {
                "id": "embd-" + self._request_id(request),
                "object": "list",
                "created": int(time.time()),
                "model": self.config.model,
                "data": data,
                "usage": usage_body(total, 0),
            }
        )

    # --- other routes -----------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.StreamResponse:
        if self.faults.models_status != 200:
            return _json({"detail": "Not Found"}, status=self.faults.models_status)
        model = self.config.model
        card = {
            "id": model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": model,
            "parent": None,
            "max_model_len": MAX_MODEL_LEN,
        }
        # vLLM lists each LoRA adapter as a model of its own, its base model as parent.
        adapters = [
            {**card, "id": name, "root": f"/adapters/{name}", "parent": model}
            for name in self.config.lora_adapters
        ]
        return _json({"object": "list", "data": [card, *adapters]})

    async def _health(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=self.faults.health_status)

    async def _tokenize(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_body(request)
        if isinstance(body.get("messages"), list):
            tokens = tokenize_tools(parse_tools(body)) + tokenize_messages(body["messages"])
        elif isinstance(body.get("prompt"), str):
            tokens = tokenize_text(body["prompt"])
        else:
            raise ApiError(400, "Either prompt or messages is required")
        answer = {"count": len(tokens), "max_model_len": MAX_MODEL_LEN, "tokens": tokens}
        return _json({**answer, "token_strs": None})

    async def _reset_prefix_cache(self, request: web.Request) -> web.StreamResponse:
        # vLLM's route (among its dev-mode ones) answers 200 with no body; with KV events on
        # the engine publishes AllBlocksCleared.
        await self.engine.reset_prefix_cache()
        return web.Response(status=200)

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        resp = web.Response(body=generate_latest(self._registry))
        resp.headers["Content-Type"] = CONTENT_TYPE_PLAIN_0_0_4
        return resp
