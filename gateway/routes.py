"""The vLLM routes the gateway proxies: the path a client uses, the path an instance serves.

Every route is served under each of the config's route prefixes (`/v1`, bare, base_url's
path) and goes to the same place on the instance. vLLM serves its own extensions
(`/tokenize`, `/pooling`, `/score`, `/rerank`, ...) at the root and some of them under
`/v1` too; a client may use any of those spellings, and the instance always gets the one
vLLM documents. `/v2/rerank` (Cohere's v2 shape) is its own route, since vLLM serves it
apart, and is not nested under a `/v1` prefix.

Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`), which vLLM serves
natively, is routed like the rest; its routes differ in their `api` (the gateway's own
errors take Anthropic's shape there) and in their stream's events: a stream of named
events that ends at `message_stop`, whose first events (`message_start`,
`content_block_start`) come before any token.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gateway.errors import Api


@dataclass(frozen=True)
class Route:
    name: str  # label in metrics and logs
    upstream_path: str
    streams: bool  # the instance may answer with server-sent events (`stream` in the body)
    path: str = ""  # under each route prefix; "" means upstream_path without its /v1
    form: bool = False  # multipart/form-data (an upload), not JSON
    # The named events (`event: <name>`) that end a stream without `data: [DONE]`, as the
    # Responses API's and Anthropic's do (vLLM ends either with an `error` event when it
    # fails mid-way); none: it ends at `data: [DONE]`.
    end_events: tuple[str, ...] = ()
    # The named event that carries a token, when a stream's first events carry none
    # (Anthropic's `content_block_delta`); "": its first data event is its first token.
    token_event: str = ""
    # A stream's first token (as `token_event` says) is of a prompt the gateway counted, so
    # its TTFT and TPOT are measured, checked against the SLO and learned by least_time.
    # Not so for the Responses API (`response.created` comes first) or audio (no count).
    timed: bool = False
    # In a fleet with prefill instances its prompt may be prefilled apart, on a second hop
    # (proxy/disaggregate.py writes the hops' bodies of chat and completion requests).
    disaggregates: bool = False
    api: Api = "openai"  # whose API: the shape of the gateway's own errors on the route
    # It runs the model: its tokens count against a key's tokens_per_minute and in the
    # key's token counters (not so for tokenizing, counting tokens or audio).
    metered: bool = True
    # Its stream carries the usage only when asked (`stream_options.include_usage`): the
    # gateway asks for it, and keeps it from a client that did not.
    asks_usage: bool = False
    # vLLM reads a `priority` field on it: the key's is written there for instances that
    # run the priority scheduler.
    prioritized: bool = False
    # vLLM hands a body's `kv_transfer_params` to its KV connector on it (its chat and
    # completion machinery, which the Messages and Responses APIs go through): they name
    # hosts and KV blocks on the instances, so only the gateway may set them.
    kv_connected: bool = False

    @property
    def client_path(self) -> str:
        return self.path or self.upstream_path.removeprefix("/v1")

    @property
    def sse_done(self) -> bool:
        """Whether its stream ends with `data: [DONE]` (else at one of `end_events`)."""
        return not self.end_events


CHAT = Route(
    "chat.completions",
    "/v1/chat/completions",
    streams=True,
    timed=True,
    disaggregates=True,
    asks_usage=True,
    prioritized=True,
    kv_connected=True,
)
COMPLETIONS = Route(
    "completions",
    "/v1/completions",
    streams=True,
    timed=True,
    disaggregates=True,
    asks_usage=True,
    prioritized=True,
    kv_connected=True,
)
EMBEDDINGS = Route("embeddings", "/v1/embeddings", streams=False)
RESPONSES = Route(
    "responses",
    "/v1/responses",
    streams=True,
    end_events=("response.completed", "response.incomplete", "response.failed", "error"),
    kv_connected=True,
)
MESSAGES = Route(
    "messages",
    "/v1/messages",
    streams=True,
    end_events=("message_stop", "error"),
    token_event="content_block_delta",
    timed=True,
    api="anthropic",
    kv_connected=True,
)
COUNT_TOKENS = Route(
    "messages.count_tokens",
    "/v1/messages/count_tokens",
    streams=False,
    api="anthropic",
    metered=False,
)
TOKENIZE = Route("tokenize", "/tokenize", streams=False, metered=False)
DETOKENIZE = Route("detokenize", "/detokenize", streams=False, metered=False)
RERANK = Route("rerank", "/rerank", streams=False)
RERANK_V2 = Route("rerank", "/v2/rerank", streams=False, path="/v2/rerank")
SCORE = Route("score", "/score", streams=False)
POOLING = Route("pooling", "/pooling", streams=False)
CLASSIFY = Route("classify", "/classify", streams=False)
# vLLM streams transcriptions (form field `stream`) as chat-like chunks ending in [DONE].
TRANSCRIPTIONS = Route(
    "audio.transcriptions", "/v1/audio/transcriptions", True, form=True, metered=False
)
TRANSLATIONS = Route("audio.translations", "/v1/audio/translations", True, form=True, metered=False)

ROUTES = (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    RESPONSES,
    MESSAGES,
    COUNT_TOKENS,
    TOKENIZE,
    DETOKENIZE,
    RERANK,
    RERANK_V2,
    SCORE,
    POOLING,
    CLASSIFY,
    TRANSCRIPTIONS,
    TRANSLATIONS,
)


def mount(prefixes: Iterable[str]) -> list[tuple[str, Route]]:
    """Every (client path, route) pair to register: each route under each prefix, once."""
    paths: dict[str, Route] = {}
    for prefix in prefixes:
        for route in ROUTES:
            if route.client_path.startswith("/v2/") and prefix.endswith("/v1"):
                continue  # /v1/v2/rerank is nobody's spelling
            paths.setdefault(prefix + route.client_path, route)
    return list(paths.items())


def summary() -> str:
    """The routes there are, for the 404 of a path that is none of them."""
    posts = ", ".join(dict.fromkeys(r.upstream_path for r in ROUTES))
    return (
        f"the routes are POST {posts} (each also bare, under /v1 and under base_url's path) "
        "and GET /v1/models"
    )
