"""The simulated vLLM's engine: continuous batching with chunked prefill, and the prefix cache."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Sequence

from .sim_engine import KV_TOKENS_PER_SEQ, SimConfig, SimStats
from .sim_prefix_cache import NO_KEYS, BlockKeys, CacheEvent, PrefixCache, block_hashes
from .sim_queue import FcfsQueue, PriorityQueue, waiting_queue


class EngineBusy(Exception):
    """The waiting queue is full (admission control)."""


class EngineRequest:
    """One sequence inside the engine; its handler reads tokens with next_token()."""

    __slots__ = (
        "_queue",
        "active",
        "arrival",
        "cached",
        "generated",
        "hashes",
        "keys",
        "max_tokens",
        "prefilled",
        "priority",
        "prompt_tokens",
        "token_ids",
    )

    def __init__(
        self,
        prompt_tokens: int,
        max_tokens: int,
        hashes: list[int] | None = None,
        priority: int = 0,
        arrival: int = 0,
        token_ids: Sequence[int] = (),
        keys: BlockKeys = NO_KEYS,
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.priority = priority  # vLLM's request field: lower is served first
        self.arrival = arrival  # the engine's count of requests before it
        self.hashes = hashes  # the prompt's block hashes, when the prefix cache is on
        self.token_ids = token_ids  # the prompt's, for the cache's events
        self.keys = keys  # what else its block hashes cover (adapter, cache_salt)
        self.cached = 0  # prompt tokens found in the prefix cache at admission
        self.prefilled = 0
        self.generated = 0
        self.active = True
        # One item per produced token (its 1-based index); None marks the end.
        self._queue: asyncio.Queue[int | None] = asyncio.Queue()

    async def next_token(self) -> int | None:
        """Wait for the next token's index; None once the request has finished."""
        return await self._queue.get()

    @property
    def in_decode(self) -> bool:
        return self.prefilled >= self.prompt_tokens


class Engine:
    """Continuous batching: admission into max_num_seqs slots in the order of the scheduling
    policy (sim_queue.py), chunked prefill, decode steps.

    The step loop runs as a task only while there is work, so an idle instance costs nothing.
    Each step that changed the prefix cache hands its events, as one batch, to
    `publish_cache_events` (vLLM's KV cache events, sim_kv_events.py), when there is one.
    There is no KV pressure, so nothing is preempted: the priority policy orders the waiting
    queue and never evicts a running request (vLLM preempts only when KV blocks run out).
    """

    def __init__(
        self,
        config: SimConfig,
        stats: SimStats,
        held_kv_tokens: Callable[[], int] | None = None,
        publish_cache_events: Callable[[Sequence[CacheEvent]], Awaitable[None]] | None = None,
    ) -> None:
        """held_kv_tokens: KV tokens held outside the running requests (a prefill instance's
        blocks waiting for a decode instance), counted in kv_cache_usage as vLLM counts them."""
        self.config = config
        self.speed = config.speed
        self._stats = stats
        self._waiting: FcfsQueue[EngineRequest] | PriorityQueue[EngineRequest] = waiting_queue(
            config.scheduling_policy
        )
        self._arrivals = itertools.count()
        self._running: list[EngineRequest] = []
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._held_kv_tokens = held_kv_tokens
        self._publish_cache_events = publish_cache_events
        self.prefix_cache = (
            PrefixCache(
                config.prefix_cache_blocks,
                config.block_size,
                events=publish_cache_events is not None,
            )
            if config.prefix_caching
            else None
        )

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def kv_cache_usage(self) -> float:
        held = sum(r.prefilled + r.generated for r in self._running)
        if self._held_kv_tokens is not None:
            held += self._held_kv_tokens()
        return min(1.0, held / (self.config.max_num_seqs * KV_TOKENS_PER_SEQ))

    def submit(
        self,
        prompt_tokens: int,
        max_tokens: int,
        token_ids: Sequence[int] | None = None,
        computed: int = 0,
        priority: int = 0,
        keys: BlockKeys = NO_KEYS,
    ) -> EngineRequest:
        """Queue a request; raises EngineBusy when the waiting queue is full.

        priority: the request's own; orders the waiting queue under the priority policy.

        token_ids (the prompt's, when known) let the prefix cache skip a cached prefix; keys
        (its adapter, its cache_salt) go into its block hashes, as vLLM's extra keys do.
        computed: prompt tokens whose KV is already here (read from a prefill instance); only
        the rest is prefilled, and at least the last token, which vLLM computes for its logits.
        """
        if self._closed:
            raise EngineBusy("engine is shut down")
        hashes = None
        if self.prefix_cache is not None and token_ids is not None:
            hashes = block_hashes(token_ids, self.config.block_size, keys)
        # Every prompt costs at least one prefill token, so each request reaches decode.
        req = EngineRequest(
            max(1, prompt_tokens),
            max_tokens,
            hashes,
            priority,
            next(self._arrivals),
            token_ids or (),
            keys,
        )
        req.prefilled = max(0, min(computed, req.prompt_tokens - 1))
        # A request that finds a free slot is admitted at once rather than at the next step
        # boundary, so that admission control only counts requests that really queue.
        if not self._waiting and len(self._running) < self.config.max_num_seqs:
            self._start(req)
        elif self.config.max_waiting is not None and len(self._waiting) >= self.config.max_waiting:
            raise EngineBusy("waiting queue full")
        else:
            self._waiting.add(req)
        self._sync_stats()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        return req

    def abort(self, req: EngineRequest) -> bool:
        """Drop a request (client gone); True if it was still unfinished."""
        if not req.active:
            return False
        req.active = False
        if req in self._running:
            self._running.remove(req)
        else:
            self._waiting.remove(req)
        self._sync_stats()
        return True

    async def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (vLLM's /reset_prefix_cache) and publish AllBlocksCleared at
        once, as a batch of its own; False when there is no prefix cache.

        vLLM refuses while running requests hold blocks; here the cache is a pool apart, so
        it always succeeds."""
        if self.prefix_cache is None:
            return False
        events = self.prefix_cache.clear()
        if self._publish_cache_events is not None:
            await self._publish_cache_events(events)
        return True

    async def close(self) -> None:
        """Stop the step loop and drop everything still queued or running."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for req in [*self._running, *self._waiting]:
            req.active = False
            req._queue.put_nowait(None)
        self._running.clear()
        self._waiting.clear()
        self._sync_stats()

    def _sync_stats(self) -> None:
        stats = self._stats
        stats.running = len(self._running)
        stats.waiting = len(self._waiting)
        stats.peak_held = max(stats.peak_held, stats.running + stats.waiting)

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.config.max_num_seqs:
            self._start(self._waiting.pop())
        self._sync_stats()

    def _start(self, req: EngineRequest) -> None:
        # Like vLLM's scheduler, look the prompt up when it is scheduled: its cached prefix
        # counts as already prefilled, so only the uncached tokens cost prefill time.
        self._running.append(req)
        cache = self.prefix_cache
        if cache is None or req.hashes is None:
            return
        req.cached = cache.lookup(req.hashes, req.prompt_tokens)
        req.prefilled = max(req.prefilled, req.cached)
        self._stats.prefix_cache_queries += req.prompt_tokens
        self._stats.prefix_cache_hits += req.cached

    def _emit(self, req: EngineRequest) -> None:
        req.generated += 1
        self._stats.generation_tokens += 1
        req._queue.put_nowait(req.generated)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        cfg = self.config
        # Steps are scheduled against a deadline so sleep overshoot does not accumulate.
        deadline = loop.time()
        try:
            while self._running or self._waiting:
                self._admit()
                decoding = [r for r in self._running if r.in_decode]
                # As in vLLM, each decoding sequence takes one token of the step's budget.
                budget = cfg.max_num_batched_tokens - len(decoding)
                chunks: list[tuple[EngineRequest, int]] = []
                for req in self._running:
                    need = req.prompt_tokens - req.prefilled
                    if need > 0 and budget > 0:
                        take = min(need, budget)
                        chunks.append((req, take))
                        budget -= take
                step = sum(take for _, take in chunks) / cfg.prefill_tokens_per_s
                if decoding:
                    slowdown = 1 + cfg.decode_slowdown_per_seq * (len(decoding) - 1)
                    step += cfg.decode_s_per_token * slowdown
                deadline = max(deadline + step / self.speed, loop.time())
                await asyncio.sleep(deadline - loop.time())
                events = self._apply_step(decoding, chunks)
                if events and self._publish_cache_events is not None:
                    await self._publish_cache_events(events)
        finally:
            if self._task is asyncio.current_task():
                self._task = None

    def _apply_step(
        self, decoding: list[EngineRequest], chunks: list[tuple[EngineRequest, int]]
    ) -> list[CacheEvent]:
        """Apply a step's tokens; returns the prefix cache's events of the step, in order."""
        events: list[CacheEvent] = []
        # Requests aborted during the sleep are skipped: their slot is already free.
        for req in decoding:
            if req.active:
                self._emit(req)
        for req, take in chunks:
            if not req.active:
                continue
            req.prefilled += take
            self._stats.prefill_tokens_computed += take
            if self.prefix_cache is not None and req.hashes:
                # vLLM caches each full block once computed; the whole chain is re-touched so
                # that its head stays the most recently used.
                computed = req.hashes[: req.prefilled // self.config.block_size]
                events += self.prefix_cache.insert(computed, req.token_ids, req.keys)
            if req.in_decode:
                self._stats.prompt_tokens += req.prompt_tokens
                if req.max_tokens > 0:
                    self._emit(req)
        for req in [r for r in self._running if r.in_decode and r.generated >= r.max_tokens]:
            self._running.remove(req)
            req.active = False
            self._stats.completed += 1
            req._queue.put_nowait(None)
        self._sync_stats()
        return events
