"""Pure parts of the simulated vLLM: config, counters, tokenizer, body shapes.

The batching engine is in sim_batching.py, the prefix cache in sim_prefix_cache.py.
"""

from __future__ import annotations

import collections
import hashlib
import ipaddress
import json
import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from statistics import NormalDist
from types import MappingProxyType
from typing import Any, Literal, Protocol

from pydantic import BaseModel, Field, ValidationError

MAX_MODEL_LEN = 32768
# KV capacity per running slot, so kv_cache_usage_perc reaches 1.0 only with full, long sequences.
KV_TOKENS_PER_SEQ = 2048
_VOCAB_SIZE = 32000
# vLLM's --scheduling-policy values the simulator models (vLLM also has "sjf").
SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = ("fcfs", "priority")
# The KV event wire forms (sim_kv_events.py): current vLLM's msgpack maps, older vLLM's arrays.
KvEventsEncoding = Literal["map", "array"]
KV_EVENTS_ENCODINGS: tuple[KvEventsEncoding, ...] = ("map", "array")
# Ids reserved for the chat template's per-message framing tokens.
_TEMPLATE_IDS = (1, 2, 3, 4)
# Every word is exactly 4 bytes, so count_tokens() of generated text equals the tokens generated.
VOCAB = (" the", " and", " for", " sim", " gpu", " llm", " run", " set", " one", " two", " new")
# The spread of natural answer lengths around their median (log-normal): at sigma 1 about two in
# three answers lie within a factor e of the median, one in a hundred past ten times it.
ANSWER_SIGMA = 1.0


def dumps(obj: object) -> str:
    """Compact JSON, as pydantic's model_dump_json writes vLLM's bodies."""
    return json.dumps(obj, separators=(",", ":"))


@dataclass(frozen=True)
class SimConfig:
    """Fixed properties of one simulated instance."""

    model: str = "sim-model"
    speed: float = 1.0  # multiplies all throughput: 0.4 is a card at 40 % speed
    prefill_tokens_per_s: float = 20000.0
    decode_s_per_token: float = 0.010  # decode step time with a batch of one
    decode_slowdown_per_seq: float = 0.02  # step time grows by this fraction per extra seq
    max_num_seqs: int = 16  # running slots
    max_num_batched_tokens: int = 2048  # token budget per step (decodes + prefill chunks)
    max_waiting: int | None = None  # queued requests beyond this get 503 engine busy
    # vLLM's --scheduling-policy: the order the waiting queue is served in (sim_queue.py).
    scheduling_policy: SchedulingPolicy = "fcfs"
    # A request's limit when it names none. vLLM's is the rest of the context (None here); a
    # small one keeps a test's answers short (they end at it with finish_reason "length").
    default_max_tokens: int | None = 16
    # The median length of an answer that ends on its own (the model's end-of-sequence token),
    # unless max_tokens cuts it first or the request sets vLLM's ignore_eos (answer_tokens()).
    answer_tokens_median: int = 200
    api_key: str | None = None  # like vLLM --api-key: guards /v1/* only
    instant: bool = False  # no timing model: answer at once
    seed: int = 0
    # vLLM's automatic prefix cache (sim_prefix_cache.py): capacity in blocks; 0 turns it off.
    prefix_cache_blocks: int = 0
    block_size: int = 16  # tokens per KV block, vLLM's default
    # LoRA adapters loaded beside the base model (vLLM --lora-modules): listed in
    # /v1/models with the base model as parent, and accepted as a request's `model`.
    lora_adapters: tuple[str, ...] = ()
    # vLLM's NixlConnector (--kv-transfer-config kv_connector=NixlConnector, kv_role=kv_both):
    # prefill/decode disaggregation through kv_transfer_params (sim_kv_transfer.py).
    kv_transfer: bool = False
    # KV bytes per token: 2 (K and V) x layers x hidden size x bytes per value. The default is
    # OPT-13B in fp16 (40 layers, hidden 5120): 2 x 40 x 5120 x 2 = 819,200 bytes.
    kv_bytes_per_token: int = 2 * 40 * 5120 * 2
    # The link a decode instance reads a prefill instance's KV blocks over, in bytes/s: 25e9 is
    # what a PCIe 4.0 x16 link moves in practice (32 GB/s raw per direction). Not scaled by
    # `speed`: a slow card does not make the wire slower.
    kv_link_bytes_per_s: float = 25e9
    # Seconds a prefill instance holds blocks no decode instance has read before it frees them
    # (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 by default).
    kv_hold_timeout_s: float = 480.0
    # vLLM's --kv-events-config (publisher "zmq"): the prefix cache's block changes, one
    # batch per engine step (sim_kv_events.py). Endpoints are bound, `tcp://HOST:PORT`, HOST
    # `*` for the instance's own loopback address, PORT 0 for any free one (see parse_endpoint).
    kv_events_endpoint: str | None = None  # the PUB socket; None: no events
    kv_events_replay_endpoint: str | None = None  # the ROUTER that replays; None: no replay
    kv_events_topic: str = "kv-events"  # the gateway's name for it (vLLM's default is "")
    kv_events_encoding: KvEventsEncoding = "map"  # "array": older vLLM's array_like structs
    kv_events_buffer_steps: int = 10_000  # batches kept for replay (vLLM's buffer_steps)
    # For tests: every Nth batch is lost on the wire (never sent) but kept for replay; 0: none.
    kv_events_drop_every: int = 0
    # vLLM's --enable-prompt-tokens-details: usage says how many prompt tokens were found
    # in the prefix cache (`prompt_tokens_details.cached_tokens`); off, as vLLM's default.
    enable_prompt_tokens_details: bool = False

    def __post_init__(self) -> None:
        if self.speed <= 0 or self.prefill_tokens_per_s <= 0 or self.decode_s_per_token < 0:
            raise ValueError("speed and prefill_tokens_per_s must be > 0, decode time >= 0")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling_policy!r}"
            )
        if self.prefix_cache_blocks < 0 or self.block_size < 1:
            raise ValueError("prefix_cache_blocks must be >= 0 and block_size >= 1")
        if self.model in self.lora_adapters:
            raise ValueError("a LoRA adapter cannot share the base model's name")
        if self.kv_bytes_per_token < 1 or self.kv_link_bytes_per_s <= 0:
            raise ValueError("kv_bytes_per_token must be >= 1 and kv_link_bytes_per_s > 0")
        if self.kv_hold_timeout_s <= 0:
            raise ValueError("kv_hold_timeout_s must be > 0")
        if self.answer_tokens_median < 1:
            raise ValueError("answer_tokens_median must be >= 1")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError("default_max_tokens must be >= 1 (or None: the rest of the context)")
        self._check_kv_events()

    def _check_kv_events(self) -> None:
        if self.kv_events_endpoint is None:
            if self.kv_events_replay_endpoint is not None:
                raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
            return
        parse_endpoint(self.kv_events_endpoint)
        if self.kv_events_replay_endpoint is not None:
            parse_endpoint(self.kv_events_replay_endpoint)
        if not self.prefix_caching:
            raise ValueError(
                "kv_events_endpoint needs prefix_cache_blocks > 0: vLLM publishes its prefix "
                "cache's blocks, and there is none"
            )
        if self.kv_events_encoding not in KV_EVENTS_ENCODINGS:
            raise ValueError(
                f"kv_events_encoding must be one of {KV_EVENTS_ENCODINGS}, "
                f"got {self.kv_events_encoding!r}"
            )
        if self.kv_events_buffer_steps < 1 or self.kv_events_drop_every < 0:
            raise ValueError(
                "kv_events_buffer_steps must be >= 1 and kv_events_drop_every >= 0, got "
                f"{self.kv_events_buffer_steps} and {self.kv_events_drop_every}"
            )

    @property
    def prefix_caching(self) -> bool:
        return self.prefix_cache_blocks > 0

    @property
    def served_models(self) -> tuple[str, ...]:
        """The names a request's `model` may take: the base model and its adapters."""
        return (self.model, *self.lora_adapters)


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """(host, port) of a ZMQ endpoint the simulator binds: `tcp://HOST:PORT`, HOST `*` (kept:
    the instance's own address) or a loopback address (IPv6 in brackets), PORT 0 or `*` for
    any free port (returned as 0). The simulator never listens beyond this machine."""
    scheme, _, rest = endpoint.partition("://")
    host, sep, port = rest.rpartition(":")
    if scheme != "tcp" or not sep or not host:
        raise ValueError(f"a KV events endpoint is tcp://HOST:PORT, got {endpoint!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host not in ("*", "localhost"):
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ValueError(f"refusing to bind KV events beyond loopback: {endpoint!r}")
    if port == "*":
        return host, 0
    if not port.isdigit() or int(port) > 65535:
        raise ValueError(f"a KV events endpoint's port is 0-65535 or *, got {endpoint!r}")
    return host, int(port)


@dataclass
class SimStats:
    """Live counters of one simulated instance."""

    requests: int = 0  # /v1 POSTs received
    completed: int = 0
    cancelled: int = 0  # client left before the answer finished
    rejected: int = 0  # 503 busy, fault statuses and simulated connection drops
    running: int = 0
    waiting: int = 0
    peak_held: int = 0  # the most requests it ever held at once, running and waiting
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached (their prefill skipped)
    prefill_tokens_computed: int = 0  # prompt tokens the engine really prefilled
    # The KV connector (sim_kv_transfer.py), as a prefill instance (producer) ...
    kv_produced: int = 0  # prefill legs answered with kv_transfer_params
    kv_blocks_held: int = 0  # blocks held for decode instances, as of the last look
    kv_blocks_expired: int = 0  # held blocks freed because no one read them in time
    # ... and as a decode instance (consumer).
    kv_transfers: int = 0  # decode legs that read their prompt's KV from a prefill instance
    kv_fallbacks: int = 0  # decode legs whose params were unusable: prefilled locally
    last_headers: dict[str, str] = field(default_factory=dict)  # lower-cased names
    last_upload: str = ""  # sha256 of the last multipart body, as it arrived
    last_body: bytes = b""  # the last JSON body, as it arrived
    paths: collections.Counter[str] = field(default_factory=collections.Counter)  # POSTs
    seen_request_ids: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=1000)
    )


def count_tokens(text: str) -> int:
    """Token count of a text under the simulator's tokenizer (about 4 bytes a token)."""
    return max(1, (len(text.encode()) + 3) // 4)


def _message_text(message: Any) -> str:
    if not isinstance(message, Mapping):
        return ""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        # Multimodal content: only the text parts cost tokens here.
        return "".join(
            str(part.get("text", ""))
            for part in content
            if isinstance(part, Mapping) and part.get("type") == "text"
        )
    return ""


def count_message_tokens(messages: Iterable[Any]) -> int:
    """Token count of chat messages: contents plus 4 template tokens per message."""
    return sum(count_tokens(_message_text(m)) + len(_TEMPLATE_IDS) for m in messages)


def _tools_text(tools: Any) -> str:
    # vLLM hands the tools to the chat template, which writes their JSON schemas into the
    # prompt (most templates near the start, in the system turn), so they cost what the JSON
    # text costs; a request without tools adds nothing.
    return dumps(tools) if tools else ""


def count_tool_tokens(tools: Any) -> int:
    """Prompt tokens of a request's tool definitions (0 without tools)."""
    return count_tokens(_tools_text(tools)) if tools else 0


def tokenize_tools(tools: Any) -> list[int]:
    """Token ids of a request's tool definitions; always count_tool_tokens(tools) of them."""
    return tokenize_text(_tools_text(tools)) if tools else []


def parse_tools(body: Mapping[str, Any]) -> list[Any]:
    """A chat request's `tools`: a list of objects, or none (vLLM's model refuses the rest)."""
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
        raise ApiError(400, "tools: Input should be a valid list of objects")
    return tools


def tokenize_text(text: str) -> list[int]:
    """Token ids of a text; always count_tokens(text) of them."""
    data = text.encode()
    chunks = [data[i : i + 4] for i in range(0, len(data), 4)] or [b""]
    return [int.from_bytes(chunk, "little") % _VOCAB_SIZE for chunk in chunks]


def open_message_ids(message: Any) -> list[int]:
    """Token ids of a final message rendered open, to be continued (vLLM's
    `continue_final_message`): its text, its header standing where the generation prompt
    stood (which this model counts as nothing), no end of turn."""
    return tokenize_text(_message_text(message))


def tokenize_messages(messages: Iterable[Any]) -> list[int]:
    """Token ids of chat messages; always count_message_tokens(messages) of them."""
    ids: list[int] = []
    for message in messages:
        ids.extend(_TEMPLATE_IDS)
        ids.extend(tokenize_text(_message_text(message)))
    return ids


# --- request validation, as vLLM's pydantic models answer it -----------------------------

BUSY_MESSAGE = (
    "The engine is currently busy with too many queued requests. "
    "Please try again later or on a different instance."
)
_ERROR_TYPES = MappingProxyType(
    {
        400: "BadRequestError",
        401: "AuthenticationError",
        404: "NotFoundError",
        429: "RateLimitError",
        500: "InternalServerError",
        503: "ServiceUnavailableError",
    }
)


@dataclass
class Faults:
    """Failure switches that tests flip while the instance runs."""

    status: int | None = None
    busy: bool = False
    health_status: int = 200
    hang_before_headers: bool = False
    die_after_chunks: int | None = None
    models_status: int = 200  # not 200: /v1/models answers that, as behind a proxy hiding it


class Dropped(Exception):
    """The simulated server died mid-request (Faults.die_after_chunks)."""


class _Writable(Protocol):
    async def write(self, data: bytes) -> None: ...


class DyingWriter:
    """Writes a streamed answer's events, and dies as `Faults.die_after_chunks` says:
    `Dropped` instead of the event past that many (every route streams through one)."""

    def __init__(self, die_after: int | None) -> None:
        self.die_after = die_after
        self.resp: _Writable | None = None  # the started stream
        self.sent = 0

    async def send(self, events: list[bytes]) -> None:
        assert self.resp is not None
        for event in events:
            if self.die_after is not None and self.sent >= self.die_after:
                raise Dropped
            await self.resp.write(event)
            self.sent += 1


class ApiError(Exception):
    """An error answered with vLLM's OpenAI-style error body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        phrase = HTTPStatus(status).phrase.replace(" ", "").replace("-", "")
        self.err_type = _ERROR_TYPES.get(status, phrase + "Error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": None,
                "code": self.status,
            }
        }


def parse_max_tokens(body: Mapping[str, Any], default: int | None, prompt_tokens: int) -> int:
    """max_completion_tokens or max_tokens, checked against the context length like vLLM;
    without either, `default`, or (None) the rest of the context as vLLM gives it."""
    value = body.get("max_completion_tokens") or body.get("max_tokens")
    if value is None:
        return default if default is not None else max(1, MAX_MODEL_LEN - prompt_tokens)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {value}.")
    if prompt_tokens + value > MAX_MODEL_LEN:
        raise ApiError(
            400,
            f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you "
            f"requested {prompt_tokens + value} tokens ({prompt_tokens} in the messages, "
            f"{value} in the completion). Please reduce the length of the messages or "
            "completion.",
        )
    return value


class _StreamOptions(BaseModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class _StreamFields(BaseModel):
    """The stream fields of vLLM's (Chat)CompletionRequest, validated as vLLM does (lax)."""

    stream: bool | None = False
    stream_options: _StreamOptions | None = None


def parse_stream(body: Mapping[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage) of a generation request, as vLLM reads them.

    pydantic's lax bool takes "true", "yes", 1 and the like. vLLM checks `stream_options`
    against the raw `stream` before validation, so `"stream": 0` with options is refused.
    Options without `include_usage` include it (its default is True).
    """
    if body.get("stream_options") and not body.get("stream"):
        raise ApiError(400, "Stream options can only be defined when `stream=True`.")
    raw = {k: body[k] for k in ("stream", "stream_options") if k in body}
    try:
        fields = _StreamFields.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors(include_url=False)
        )
        raise ApiError(400, problems) from None
    options = fields.stream_options
    return bool(fields.stream), bool(options is not None and options.include_usage)


def answer_tokens(seed: int, prompt: object, median: int) -> int:
    """How many tokens the simulated model answers `prompt` (any JSON: the messages and tools,
    a prompt text) with before its end-of-sequence token: a log-normal draw around `median`
    (ANSWER_SIGMA), fixed by the seed and the prompt, so a request gets the same length on
    every run and on every instance of the same seed. At least 1, at most the context."""
    digest = hashlib.sha256(f"{seed}\n{dumps(prompt)}".encode()).digest()
    uniform = (int.from_bytes(digest[:8], "big") + 0.5) / 2**64  # strictly inside (0, 1)
    drawn = median * math.exp(ANSWER_SIGMA * NormalDist().inv_cdf(uniform))
    return max(1, min(MAX_MODEL_LEN, round(drawn)))


class _IgnoreEosField(BaseModel):
    """vLLM's `ignore_eos` sampling field (lax: "true" and 1 are True)."""

    ignore_eos: bool = False


def parse_ignore_eos(body: Mapping[str, Any]) -> bool:
    """A completions or chat request's `ignore_eos`: generate all of max_tokens."""
    try:
        return _IgnoreEosField.model_validate(
            {"ignore_eos": body["ignore_eos"]} if "ignore_eos" in body else {}
        ).ignore_eos
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors(include_url=False)
        )
        raise ApiError(400, problems) from None


def tokens_to_generate(
    config: SimConfig, prompt: object, max_tokens: int, *, ignore_eos: bool
) -> int:
    """The answer's length: its natural length (answer_tokens) unless max_tokens cuts it first,
    or all of max_tokens with ignore_eos, as vLLM's `vllm bench serve` asks for."""
    if ignore_eos:
        return max_tokens
    return min(max_tokens, answer_tokens(config.seed, prompt, config.answer_tokens_median))


class _PriorityField(BaseModel):
    """The `priority` field of vLLM's request models (its PriorityRequestMixin)."""

    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)


def parse_priority(body: Mapping[str, Any]) -> int:
    """A generation or pooling request's `priority`, as vLLM validates it (lax: "3" is 3).

    Lower is served earlier under the priority policy. Under fcfs vLLM (v1 engine) takes any
    value and ignores it: the check that refused a nonzero one went with the v0 engine.
    """
    try:
        return _PriorityField.model_validate(
            {"priority": body["priority"]} if "priority" in body else {}
        ).priority
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors(include_url=False)
        )
        raise ApiError(400, problems) from None


def parse_cache_salt(body: Mapping[str, Any]) -> str | None:
    """A completions or chat request's `cache_salt` (vLLM's field; it goes into the hash of
    the prompt's first KV block, so requests of different salts share no cached block):
    None when absent or null, else a non-empty string, as vLLM's model validator demands."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ApiError(
            400, "Value error, Parameter 'cache_salt' must be a non-empty string if provided."
        )
    return salt


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) for t in value)


def prompt_token_count(prompt: Any) -> int:
    """Tokens of a completions prompt: a string or token ids, alone or as a list of one."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return count_tokens(prompt)
    if _is_token_ids(prompt):
        return len(prompt)
    raise ApiError(400, "prompt: a string or one list of token ids is required")


def prompt_token_ids(prompt: Any) -> list[int]:
    """Token ids of a completions prompt already checked by prompt_token_count."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    return tokenize_text(prompt) if isinstance(prompt, str) else list(prompt)


def embedding_inputs(raw: Any) -> list[tuple[str, int]]:
    """(key, token count) per input of an embeddings request."""
    inputs: list[Any] = raw if isinstance(raw, list) and raw else [raw]
    if _is_token_ids(inputs):
        inputs = [inputs]
    parsed: list[tuple[str, int]] = []
    for item in inputs:
        if isinstance(item, str):
            parsed.append((item, count_tokens(item)))
        elif _is_token_ids(item):
            parsed.append((str(item), len(item)))
        else:
            raise ApiError(400, "input: a string, list of strings or token ids is required")
    return parsed


def usage_body(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
) -> dict[str, Any]:
    """OpenAI usage object as vLLM fills it (`cached_tokens` with its
    --enable-prompt-tokens-details; else no details)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None
        if cached_tokens is None
        else {"cached_tokens": cached_tokens},
    }


def embedding_vector(key: str) -> list[float]:
    """A deterministic unit vector of 8 floats for a key (vLLM normalizes embeddings)."""
    rng = random.Random(key)
    vector = [rng.uniform(-1.0, 1.0) for _ in range(8)]
    norm = sum(v * v for v in vector) ** 0.5 or 1.0
    return [v / norm for v in vector]


@dataclass
class Generation:
    """Builds one request's response bodies and SSE events in vLLM's exact shapes."""

    id: str
    created: int
    model: str
    chat: bool
    prompt_tokens: int
    max_tokens: int
    tokens: list[str] = field(default_factory=list)
    cached_tokens: int | None = None  # prompt tokens the prefix cache held, if told

    @property
    def finish_reason(self) -> str:
        # vLLM checks the length cap before the stop token: an answer that ends exactly at
        # max_tokens is "length".
        return "length" if len(self.tokens) >= self.max_tokens else "stop"

    def _envelope(self, choices: list[dict[str, Any]], obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _event(self, payload: object) -> bytes:
        return f"data: {dumps(payload)}\n\n".encode()

    def full_body(self) -> dict[str, Any]:
        text = "".join(self.tokens)
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {
                "role": "assistant",
                "content": text,
                "refusal": None,
                "tool_calls": [],
                "reasoning_content": None,
            }
        else:
            choice["text"] = text
        choice.update(logprobs=None, finish_reason=self.finish_reason, stop_reason=None)
        body = self._envelope([choice], "chat.completion" if self.chat else "text_completion")
        body["usage"] = usage_body(self.prompt_tokens, len(self.tokens), self.cached_tokens)
        return body

    def token_events(self, last: bool) -> list[bytes]:
        """The SSE events that carry the newest token (and the role chunk before the first)."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        finish: dict[str, Any] = {"finish_reason": self.finish_reason, "stop_reason": None}
        if not last:
            finish = {"finish_reason": None}
        events = []
        if self.chat and len(self.tokens) == 1:
            delta = {"role": "assistant", "content": ""}
            role_choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
            events.append(self._event(self._envelope([role_choice], obj)))
        content: dict[str, Any] = (
            {"delta": {"content": self.tokens[-1]}} if self.chat else {"text": self.tokens[-1]}
        )
        choice = {"index": 0, **content, "logprobs": None, **finish}
        events.append(self._event(self._envelope([choice], obj)))
        return events

    def tail_events(self, include_usage: bool) -> list[bytes]:
        """Optional usage chunk, then the [DONE] terminator."""
        events = []
        if include_usage:
            obj = "chat.completion.chunk" if self.chat else "text_completion"
            body = self._envelope([], obj)
            body["usage"] = usage_body(self.prompt_tokens, len(self.tokens), self.cached_tokens)
            events.append(self._event(body))
        events.append(b"data: [DONE]\n\n")
        return events
