"""A sticky cache-aware front: our re-implementation of the `cache_aware` rule of vLLM's
Rust router (`vllm-router`) and the SGLang router, as a baseline for the `prefix` benchmark.

Not their code: the rule as their source describes it (`policies/cache_aware.rs`), on our
own data structures. Per request:

- load = the router's own requests in flight per instance (sent, not yet answered in full);
- the fleet is *imbalanced* when (max - min) > `balance_abs` and max > min x `balance_rel`:
  then the least loaded instance takes it (ties at random), whatever is cached;
- otherwise the instance whose history shares the longest prefix with the request's text
  takes it if that match is above `cache_threshold` of the text, else the least loaded.

The request's text is then recorded as sent there. Their trees are radix trees over
characters, evicted by size every 120 s (33M characters per worker: never reached in a
benchmark); here the text is cut into blocks of `BLOCK_BYTES` bytes with chained hashes,
so a match is exact to a block (4 simulator tokens) and nothing is evicted. Defaults are
vllm-router 0.1.17's balance thresholds (64, 1.5) and the 0.5 cache threshold the SGLang
router had (vllm-router's is now 0.3: the same choice on these workloads, whose matches
are ~0.95 or ~0).

`python -m loadtest.sticky --instances URL ...` serves it on a free loopback port and
prints its URL; it relays chat and completion requests, streamed or not, and adds
`X-Gateway-Instance` (host:port) so the load generator can tell where each went.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import sys
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from gateway.dispatch.affinity import prompt_blocks

BLOCK_BYTES = 16
CACHE_THRESHOLD = 0.5
BALANCE_ABS = 64
BALANCE_REL = 1.5


def text_blocks(text: bytes, block_bytes: int = BLOCK_BYTES) -> list[int]:
    """Chained 64-bit hashes of the full blocks of `text` (block k's covers blocks 0..k):
    the gateway's own hash chain, at this router's block size."""
    return list(prompt_blocks(text, block_bytes))


def request_text(body: dict[str, Any]) -> bytes:
    """What the routers match on: the messages' contents in order, or the prompt."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts += [p.get("text", "") for p in content if isinstance(p, dict)]
        return "\n".join(parts).encode()
    prompt = body.get("prompt")
    return prompt.encode() if isinstance(prompt, str) else json.dumps(prompt).encode()


class StickyPolicy:
    """The routing decision alone: no I/O, so tests can drive it directly."""

    def __init__(
        self,
        instances: Sequence[str],
        *,
        cache_threshold: float = CACHE_THRESHOLD,
        balance_abs: int = BALANCE_ABS,
        balance_rel: float = BALANCE_REL,
        seed: int = 0,
    ) -> None:
        if not instances:
            raise ValueError("the sticky front needs at least one instance")
        self.instances = list(instances)
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.inflight = dict.fromkeys(self.instances, 0)
        self.held: dict[str, set[int]] = {i: set() for i in self.instances}
        self.rng = random.Random(seed)
        self.decisions = {"imbalanced": 0, "affinity": 0, "least_loaded": 0}

    def _match(self, instance: str, blocks: Sequence[int]) -> int:
        # Every prefix of a recorded text is recorded too: the held blocks along a chain are
        # a leading run, so a binary search finds its length.
        held = self.held[instance]
        lo, hi = 0, len(blocks)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if blocks[mid - 1] in held:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _least_loaded(self) -> str:
        low = min(self.inflight.values())
        return self.rng.choice([i for i in self.instances if self.inflight[i] == low])

    def choose(self, text: bytes) -> str:
        """Pick an instance for `text`, record the text there and count it in flight."""
        blocks = text_blocks(text)
        loads = self.inflight.values()
        high, low = max(loads), min(loads)
        if high - low > self.balance_abs and high > low * self.balance_rel:
            self.decisions["imbalanced"] += 1
            chosen = self._least_loaded()
        else:
            matches = {i: self._match(i, blocks) for i in self.instances}
            best = max(matches.values())
            ratio = best * BLOCK_BYTES / len(text) if text else 0.0
            if ratio > self.cache_threshold:
                self.decisions["affinity"] += 1
                chosen = self.rng.choice([i for i in self.instances if matches[i] == best])
            else:
                self.decisions["least_loaded"] += 1
                chosen = self._least_loaded()
        self.held[chosen].update(blocks)
        self.inflight[chosen] += 1
        return chosen

    def done(self, instance: str) -> None:
        self.inflight[instance] -= 1


class StickyFront:
    """The aiohttp relay around a StickyPolicy."""

    def __init__(self, policy: StickyPolicy) -> None:
        self.policy = policy
        self.http: aiohttp.ClientSession | None = None

    async def _open(self, app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
        self.http = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None)
        )

    async def _close(self, app: web.Application) -> None:
        if self.http is not None:
            await self.http.close()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        app.router.add_post("/v1/chat/completions", self.relay)
        app.router.add_post("/v1/completions", self.relay)
        app.router.add_get("/health", self.health)
        app.router.add_get("/stats", self.stats)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response({"decisions": self.policy.decisions})

    async def relay(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        instance = self.policy.choose(request_text(json.loads(raw)))
        assert self.http is not None
        try:
            async with self.http.post(
                instance + request.path,
                data=raw,
                headers={"Content-Type": "application/json"},
            ) as upstream:
                response = web.StreamResponse(status=upstream.status)
                response.content_type = upstream.content_type
                response.headers["X-Gateway-Instance"] = urlsplit(instance).netloc
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        finally:
            self.policy.done(instance)


async def serve(policy: StickyPolicy, port: int) -> None:
    runner = web.AppRunner(StickyFront(policy).app(), access_log=None)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    await web.SockSite(runner, sock).start()
    print(f"http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.sticky", description=__doc__)
    parser.add_argument("--instances", nargs="+", required=True, help="instance base URLs")
    parser.add_argument("--port", type=int, default=0, help="loopback port (0: a free one)")
    parser.add_argument("--cache-threshold", type=float, default=CACHE_THRESHOLD)
    parser.add_argument("--balance-abs", type=int, default=BALANCE_ABS)
    parser.add_argument("--balance-rel", type=float, default=BALANCE_REL)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    policy = StickyPolicy(
        [u.rstrip("/") for u in args.instances],
        cache_threshold=args.cache_threshold,
        balance_abs=args.balance_abs,
        balance_rel=args.balance_rel,
        seed=args.seed,
    )
    try:
        asyncio.run(serve(policy, args.port))
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
