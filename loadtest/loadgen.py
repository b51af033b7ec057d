"""Load generator for OpenAI-compatible endpoints: seeded workloads, one streaming client, runners.

A workload is a list of `RequestSpec`s built from a seed, so two runs (two strategies,
or a gateway and the bare instances) see the same prompts and the same arrival times.
`Client.send` streams one chat completion and times it from the `data:` lines it reads;
`run_open` sends specs at their arrival times (Poisson when built with a rate), and
`run_closed` keeps a fixed number of requests in flight. Both are bounded in count and
in time, and show their progress on stderr (progress.py: a bar with an ETA on a terminal).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from loadtest import sdk_retry
from loadtest.progress import Progress

# The simulator (and the gateway's lane estimate) count about 4 UTF-8 bytes as a token.
BYTES_PER_TOKEN = 4
TEMPLATE_TOKENS = 4  # chat framing tokens the simulator and the gateway add per message
LONG_THRESHOLD = 4096  # the gateway's default [prefill] long_input_threshold


@dataclass(frozen=True)
class Mix:
    """Shape of a workload: prompt and output lengths in tokens, and the long share."""

    long_share: float = 0.2
    short_tokens: tuple[int, int] = (200, 1000)
    long_tokens: tuple[int, int] = (5000, 8000)
    max_tokens: tuple[int, int] = (32, 128)

    def __post_init__(self) -> None:
        if not 0.0 <= self.long_share <= 1.0:
            raise ValueError(f"long_share must be within 0..1, got {self.long_share}")
        for name in ("short_tokens", "long_tokens", "max_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be 1 <= low <= high, got {(lo, hi)}")

    def mean_prompt_tokens(self) -> float:
        """Expected prompt tokens per request, template tokens included."""
        short = sum(self.short_tokens) / 2
        long = sum(self.long_tokens) / 2
        return TEMPLATE_TOKENS + (1 - self.long_share) * short + self.long_share * long

    def mean_max_tokens(self) -> float:
        return sum(self.max_tokens) / 2


# The seed's slow-card mix (issues 10 and 12): half 200-token, half 6,000-token prompts,
# 32 output tokens each.
SEED_MIX = Mix(
    long_share=0.5, short_tokens=(200, 200), long_tokens=(6000, 6000), max_tokens=(32, 32)
)


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload: when it is sent (open loop) and what it asks for."""

    index: int
    at: float  # seconds after the start of an open-loop run
    prompt_tokens: int  # content tokens, without the template's
    max_tokens: int
    client: int  # the simulated client that sends it (for pinning without a gateway)
    # Shared-prefix workloads (workloads.py) set the chat messages themselves, as (role, text);
    # prompt_tokens is then their simulator token count less one message's template tokens.
    messages: tuple[tuple[str, str], ...] = ()
    group: int = -1  # the shared-prefix group, if any
    conversation: int = -1  # the multi-turn conversation, if any; turn counts from 0
    turn: int = 0
    # Conversations with users (workloads.py): the user who sends it, and the seconds they
    # think after their previous request's answer before sending this one.
    user: int = -1
    think: float = 0.0

    @property
    def tokens(self) -> int:
        """Its prompt as the simulator and the gateway count it, template included."""
        return self.prompt_tokens + TEMPLATE_TOKENS

    @property
    def long(self) -> bool:
        return self.tokens > LONG_THRESHOLD

    def prompt(self) -> str:
        """A deterministic text of exactly prompt_tokens simulator tokens, unique per request."""
        head = f"{self.index:07d} "  # 8 bytes: two tokens, and no two prompts are equal
        return head + " tok" * (self.prompt_tokens - 2)

    def chat_messages(self) -> list[dict[str, str]]:
        """The chat messages this request sends."""
        if self.messages:
            return [{"role": role, "content": text} for role, text in self.messages]
        return [{"role": "user", "content": self.prompt()}]


def make_workload(
    count: int, mix: Mix, seed: int, *, rate: float | None = None, clients: int = 16
) -> list[RequestSpec]:
    """`count` requests drawn from `mix`; Poisson arrivals at `rate` per second if given."""
    rng = random.Random(seed)
    specs: list[RequestSpec] = []
    at = 0.0
    for index in range(count):
        if rate is not None and index > 0:
            at += rng.expovariate(rate)
        long = rng.random() < mix.long_share
        lo, hi = mix.long_tokens if long else mix.short_tokens
        specs.append(
            RequestSpec(
                index=index,
                at=at,
                prompt_tokens=max(2, rng.randint(lo, hi) - TEMPLATE_TOKENS),
                max_tokens=rng.randint(*mix.max_tokens),
                client=index % max(1, clients),
            )
        )
    return specs


@dataclass
class Result:
    """What one request did, as the client saw it. Times are seconds."""

    index: int
    long: bool
    sent: float  # perf_counter() when sent
    status: int = 0  # HTTP status; 0 when no answer came
    error: str | None = None  # why it failed, if it did
    instance: str = ""
    ttft: float | None = None
    tpot: float | None = None
    latency: float | None = None
    answered: float | None = None  # until the status line arrived (a refusal's wait)
    tokens: int = 0
    reads: int = 0  # body reads that carried data (how chunked the stream arrived)
    attempts: int = 1  # with the client's retries on, how many times it was sent
    # From the usage chunk: the prompt as the instance counted it and, where the instance
    # reports it (vLLM's --enable-prompt-tokens-details), how much of it was cached there.
    prompt_tokens: int | None = None
    cached_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    def error_key(self) -> str:
        """The status, or what went wrong when the HTTP status alone does not say."""
        if self.status == 200:
            return self.error or "ok"
        return str(self.status) if self.status else (self.error or "no_answer")


def instance_label(url: str) -> str:
    """host:port of a URL, as the gateway names an instance by default."""
    return urlsplit(url).netloc


class Client:
    """Streams chat completions from one OpenAI-compatible base URL (or several, pinned).

    With `retries`, a refused or failed attempt is sent again as the OpenAI SDK would
    (`sdk_retry.py`), and the request is timed from its first attempt."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        key: str,
        *,
        model: str = "sim-model",
        timeout: float = 120.0,
        retries: int = 0,
    ) -> None:
        self.session = session
        self.headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        self.model = model
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.retries = retries

    async def send(self, base_url: str, spec: RequestSpec) -> Result:
        """Send one streaming request to base_url (ending in /v1) and time its tokens."""
        body = json.dumps(
            {
                "model": self.model,
                "messages": spec.chat_messages(),
                "max_tokens": spec.max_tokens,
                "ignore_eos": True,  # all of max_tokens, as `vllm bench serve` asks
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )
        result = Result(spec.index, spec.long, time.perf_counter())
        rng: random.Random | None = None
        while True:
            headers = await self._attempt(base_url, body, result)
            retries_made = result.attempts - 1
            # As the SDK: once a stream began (200), whatever happens to it is not retried.
            if result.status == 200 or retries_made >= self.retries:
                break
            if not sdk_retry.should_retry(result.status, headers):
                break
            # Seeded by the request, so every setup of a run sees the same jitter.
            rng = rng or random.Random(spec.index)
            await asyncio.sleep(sdk_retry.delay(retries_made, headers, rng))
            result.attempts += 1
        result.latency = time.perf_counter() - result.sent
        return result

    async def _attempt(self, base_url: str, body: str, result: Result) -> dict[str, str]:
        """One attempt; the answer's headers (empty when none came)."""
        result.status, result.error, result.answered, result.instance = 0, None, None, ""
        headers: dict[str, str] = {}
        try:
            async with self.session.post(
                base_url + "/chat/completions",
                data=body,
                headers=self.headers,
                timeout=self.timeout,
            ) as resp:
                result.answered = time.perf_counter() - result.sent
                result.status = resp.status
                headers = {k.lower(): v for k, v in resp.headers.items()}
                result.instance = resp.headers.get("X-Gateway-Instance") or instance_label(base_url)
                if resp.status != 200:
                    await resp.read()
                    result.error = f"status {resp.status}"
                else:
                    await _read_stream(resp, result)
        except TimeoutError:
            result.error = "timeout"
        except (aiohttp.ClientError, OSError) as exc:
            result.error = type(exc).__name__
        return headers


async def _read_stream(resp: aiohttp.ClientResponse, result: Result) -> None:
    first = last = 0.0
    content_chunks = usage_tokens = 0
    done = False
    buffer = b""
    async for data in resp.content.iter_any():
        now = time.perf_counter()
        result.reads += 1
        buffer += data
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                continue
            event = json.loads(payload)
            if "error" in event:
                result.error = "stream_error"
                continue
            if usage := event.get("usage"):
                usage_tokens = int(usage.get("completion_tokens") or 0)
                _read_prompt_usage(usage, result)
            if any(_has_content(c) for c in event.get("choices") or ()):
                content_chunks += 1
                first = first or now
                last = now
    if not done and result.error is None:
        result.error = "truncated"
    result.tokens = usage_tokens or content_chunks
    if content_chunks:
        result.ttft = first - result.sent
    if content_chunks and result.tokens > 1:
        result.tpot = (last - first) / (result.tokens - 1)


def _read_prompt_usage(usage: dict[str, Any], result: Result) -> None:
    prompt = usage.get("prompt_tokens")
    result.prompt_tokens = prompt if type(prompt) is int else None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    result.cached_tokens = cached if type(cached) is int else None


def _has_content(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or choice.get("text"))


Route = Callable[[RequestSpec, int], str]  # (spec, worker) -> base URL


@dataclass
class Run:
    """The results of one run, and its wall-clock span."""

    label: str
    results: list[Result] = field(default_factory=list)
    started: float = 0.0
    ended: float = 0.0
    unfinished: int = 0  # specs not finished when the run's time ran out (never sent or cut)
    last_sent: float = 0.0  # when the last spec went out: the end of the steady window

    @property
    def window(self) -> float:
        """From the start until the last request was sent: the run without its drain."""
        return max(1e-9, (self.last_sent or self.ended) - self.started)

    @property
    def duration(self) -> float:
        return max(1e-9, self.ended - self.started)


async def _bounded(run: Run, progress: Progress, work: asyncio.Task[None], limit: float) -> None:
    ticker = asyncio.create_task(progress.loop())
    try:
        await asyncio.wait_for(work, timeout=limit)
    except TimeoutError:
        pass  # wait_for cancelled the work; what did not finish is counted as unfinished
    finally:
        ticker.cancel()
        run.ended = time.perf_counter()


async def run_open(
    client: Client, specs: Sequence[RequestSpec], route: Route, *, label: str, limit: float
) -> Run:
    """Send each spec at its `at` offset, whatever is still in flight; at most `limit` s."""
    run = Run(label)
    progress = Progress(run, len(specs))
    pending: set[asyncio.Task[None]] = set()

    async def one(spec: RequestSpec) -> None:
        run.results.append(await client.send(route(spec, spec.client), spec))

    async def schedule() -> None:
        try:
            for spec in specs:
                delay = run.started + spec.at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.create_task(one(spec))
                pending.add(task)
                task.add_done_callback(pending.discard)
                progress.sent += 1
            run.last_sent = time.perf_counter()
            while pending:
                await asyncio.wait(set(pending))
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    run.started = time.perf_counter()
    await _bounded(run, progress, asyncio.create_task(schedule()), limit)
    run.unfinished = len(specs) - len(run.results)
    return run


async def run_closed(
    client: Client,
    specs: Sequence[RequestSpec],
    route: Route,
    *,
    concurrency: int,
    label: str,
    limit: float,
) -> Run:
    """Keep `concurrency` requests in flight until the specs (or `limit` seconds) run out."""
    run = Run(label)
    progress = Progress(run, len(specs))
    queue = iter(specs)

    async def worker(worker_id: int) -> None:
        for spec in queue:
            progress.sent += 1
            if progress.sent == len(specs):
                run.last_sent = time.perf_counter()
            run.results.append(await client.send(route(spec, worker_id), spec))

    async def all_workers() -> None:
        await asyncio.gather(*(worker(w) for w in range(concurrency)))

    run.started = time.perf_counter()
    await _bounded(run, progress, asyncio.create_task(all_workers()), limit)
    run.unfinished = len(specs) - len(run.results)
    return run


def session() -> aiohttp.ClientSession:
    """A client session whose pool never limits the load (the load generator must not)."""
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, force_close=False)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))
