"""vLLM's other routes on a simulated instance: minimal answers in vLLM's shapes.

`/detokenize`, `/rerank` (and `/v1/rerank`, `/v2/rerank`), `/score` (and `/v1/score`),
`/pooling`, `/classify`, and the multipart uploads `/v1/audio/transcriptions` and
`/v1/audio/translations` (streamed as `transcription.chunk` events ending in `[DONE]`).
They check the model, apply the instance's faults and answer at once: enough for the
gateway's tests to see a request reach an instance serving its model; no engine time.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Awaitable, Callable
from email.parser import BytesParser
from email.policy import HTTP
from typing import Any, Protocol

from aiohttp import web

from .sim_engine import (
    VOCAB,
    ApiError,
    Faults,
    SimConfig,
    SimStats,
    count_tokens,
    dumps,
    embedding_vector,
    tokenize_text,
    usage_body,
)


class Host(Protocol):
    """What these routes use of the instance that serves them (sim_vllm's `SimInstance`)."""

    config: SimConfig
    faults: Faults
    stats: SimStats

    async def _apply_faults(self) -> None: ...

    async def _read_body(self, request: web.Request) -> dict[str, Any]: ...

    def _request_id(self, request: web.Request) -> str: ...

    @staticmethod
    def _drop(request: web.Request) -> None: ...


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(body: object) -> web.Response:
    return web.Response(body=dumps(body).encode(), content_type="application/json")


def _texts(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [v if isinstance(v, str) else dumps(v) for v in value]
    return []


def _similarity(a: str, b: str, seed: int) -> float:
    """A deterministic relevance in 0..1 (cosine of the two texts' embeddings, rescaled)."""
    va, vb = embedding_vector(f"{seed}:{a}"), embedding_vector(f"{seed}:{b}")
    return round((1 + sum(x * y for x, y in zip(va, vb, strict=True))) / 2, 6)


def _form_fields(content_type: str, raw: bytes) -> dict[str, bytes]:
    """The parts of a multipart/form-data body by name (the first of each), as bytes."""
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode()
    message = BytesParser(policy=HTTP).parsebytes(head + raw)
    if not message.is_multipart():
        raise ApiError(400, "the body is not multipart/form-data")
    fields: dict[str, bytes] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True)
        if isinstance(name, str) and isinstance(payload, bytes):
            fields.setdefault(name, payload)
    return fields


class ExtraRoutes:
    """The handlers, bound to one simulated instance (its config, faults and stats)."""

    def __init__(self, sim: Host) -> None:
        self.sim = sim

    def install(self, router: web.UrlDispatcher) -> None:
        routes: list[tuple[str, Handler]] = [
            ("/detokenize", self.detokenize),
            ("/rerank", self.rerank),
            ("/v1/rerank", self.rerank),
            ("/v2/rerank", self.rerank),
            ("/score", self.score),
            ("/v1/score", self.score),
            ("/pooling", self.pooling),
            ("/classify", self.classify),
            ("/v1/audio/transcriptions", self.transcription),
            ("/v1/audio/translations", self.transcription),
        ]
        for path, handler in routes:
            router.add_post(path, handler)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        await self.sim._apply_faults()
        return await self.sim._read_body(request)

    def _done(self, prompt_tokens: int, completion_tokens: int = 0) -> None:
        stats = self.sim.stats
        stats.completed += 1
        stats.prompt_tokens += prompt_tokens
        stats.generation_tokens += completion_tokens

    def _head(self, prefix: str, request: web.Request) -> dict[str, Any]:
        return {
            "id": prefix + self.sim._request_id(request),
            "object": "list",
            "created": int(time.time()),
            "model": self.sim.config.model,
        }

    # --- audio ------------------------------------------------------------------------------

    async def transcription(self, request: web.Request) -> web.StreamResponse:
        await self.sim._apply_faults()
        if request.content_type != "multipart/form-data":
            raise ApiError(400, "Expected multipart/form-data")
        raw = await request.read()
        self.sim.stats.last_upload = hashlib.sha256(raw).hexdigest()
        form = _form_fields(request.headers["Content-Type"], raw)
        model = form["model"].decode() if "model" in form else None
        if model is not None and model != self.sim.config.model:
            raise ApiError(404, f"The model `{model}` does not exist.")
        if "file" not in form:
            raise ApiError(400, "file: field required")
        size = len(form["file"])
        seconds = max(1, size // 32000)  # 16 kHz, 16-bit mono
        text = "".join(VOCAB[i % len(VOCAB)] for i in range(seconds * 3)).strip()
        self._done(seconds * 25, count_tokens(text))
        if form.get("stream", b"false").decode().lower() not in ("true", "1", "yes", "on"):
            return _json({"text": text, "usage": {"type": "duration", "seconds": seconds}})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await out.prepare(request)
        head = {**self._head("trsc-", request), "object": "transcription.chunk"}
        for word in text.split(" "):
            choice = {"delta": {"content": word + " "}, "finish_reason": None, "stop_reason": None}
            await out.write(f"data: {dumps({**head, 'choices': [choice]})}\n\n".encode())
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    # --- tokens and pooling -----------------------------------------------------------------

    async def detokenize(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ApiError(400, "tokens: field required (a list of token ids)")
        return _json({"prompt": "".join(VOCAB[t % len(VOCAB)] for t in tokens)})

    async def rerank(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        query = body.get("query")
        documents = _texts(body.get("documents"))
        if not isinstance(query, str) or not documents:
            raise ApiError(400, "query and documents are required")
        seed = self.sim.config.seed
        scores = sorted(
            ((i, d, _similarity(query, d, seed)) for i, d in enumerate(documents)),
            key=lambda r: -r[2],
        )
        results = [
            {"index": i, "document": {"text": d}, "relevance_score": score}
            for i, d, score in scores
        ]
        top_n = body.get("top_n")
        if isinstance(top_n, int) and top_n > 0:
            results = results[:top_n]
        tokens = sum(count_tokens(query) + count_tokens(d) for d in documents)
        self._done(tokens)
        head = self._head("rerank-", request)
        return _json(
            {
                "id": head["id"],
                "model": head["model"],
                "usage": {"total_tokens": tokens},
                "results": results,
            }
        )

    async def score(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        first = _texts(body.get("text_1", body.get("queries")))
        second = _texts(body.get("text_2", body.get("documents", body.get("items"))))
        if not first or not second or (len(first) != 1 and len(first) != len(second)):
            raise ApiError(400, "text_1 and text_2 are required (one text_1, or one per text_2)")
        pairs = [(first[0] if len(first) == 1 else first[i], t) for i, t in enumerate(second)]
        seed = self.sim.config.seed
        data = [
            {"index": i, "object": "score", "score": _similarity(a, b, seed)}
            for i, (a, b) in enumerate(pairs)
        ]
        tokens = sum(count_tokens(a) + count_tokens(b) for a, b in pairs)
        self._done(tokens)
        return _json(
            {**self._head("score-", request), "data": data, "usage": usage_body(tokens, 0)}
        )

    async def pooling(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        inputs = _texts(body.get("input"))
        if not inputs:
            raise ApiError(400, "input: field required")
        seed = self.sim.config.seed
        data = [
            {"index": i, "object": "pooling", "data": embedding_vector(f"{seed}:{text}")}
            for i, text in enumerate(inputs)
        ]
        tokens = sum(len(tokenize_text(t)) for t in inputs)
        self._done(tokens)
        return _json({**self._head("pool-", request), "data": data, "usage": usage_body(tokens, 0)})

    async def classify(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        inputs = _texts(body.get("input"))
        if not inputs:
            raise ApiError(400, "input: field required")
        data = []
        for i, text in enumerate(inputs):
            p = _similarity(text, "positive", self.sim.config.seed)
            probs = [round(1 - p, 6), p]
            label = "positive" if p >= 0.5 else "negative"
            data.append({"index": i, "label": label, "probs": probs, "num_classes": 2})
        tokens = sum(count_tokens(t) for t in inputs)
        self._done(tokens)
        return _json(
            {**self._head("classify-", request), "data": data, "usage": usage_body(tokens, 0)}
        )
