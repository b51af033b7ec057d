"""The shape of `config.toml` and `settings.json`: one frozen pydantic model per section.

Unknown keys are errors (`extra="forbid"`), so a typo never passes silently. Loading,
`${VAR}` expansion and error messages live in `config/load.py`.
"""

from __future__ import annotations

import ipaddress
import re
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Literal, get_args
from urllib.parse import urlsplit, urlunsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gateway.config.urls import LOOPBACK, check_http_url, endpoint
from gateway.dispatch.model import InstanceLane, Role
from gateway.dispatch.strategies import STRATEGIES

# RFC 9110 5.6.2: a field name is a token; a field value has no control character but tab.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# A named key's name is a metric label and a Redis key part: short, and nothing to escape.
KEY_NAME = r"^[A-Za-z0-9._-]{1,64}$"
# The unnamed keys (`api_key`, `api_key_env`) are one key by this name.
UNNAMED_KEY = "default"
PRIORITIES = ("interactive", "batch")  # a key's class (dispatch.Priority), first the default
# A header value may not hold one (a header with a line break cannot be written).
CONTROL_CHARACTER = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


class Frozen(BaseModel):
    """Immutable once validated; unknown keys are errors; a string written in a file never
    stands for a number or a boolean (`port = "8080"`, `workers = "2"` are type errors, as
    a typo should be). Only a `${VAR}` reference may (load.py marks what it expanded). No
    number is infinite or NaN: TOML and JSON-with-extensions can spell them, and an
    infinite timeout or interval turns its protection off (`header_timeout = inf`) or
    waits forever (`drain_timeout = inf`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_string_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name is None or not isinstance(value, str | bool):
            return value
        annotation = cls.model_fields[info.field_name].annotation
        kinds = set(get_args(annotation)) or {annotation}
        if type(value) is str and str not in kinds:
            if bool in kinds:
                raise ValueError("expected true or false, not a string")
            if kinds & {int, float}:
                raise ValueError("expected a number, not a string")
        if isinstance(value, bool) and bool not in kinds and kinds & {int, float}:
            raise ValueError("expected a number, not a boolean")  # lax int takes true as 1
        return value


# ---------------------------------------------------------------- config.toml


class GatewaySection(Frozen):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    base_url: str | None = None
    api_key_env: str | None = "GATEWAY_API_KEY"
    request_timeout: float = Field(120.0, gt=0)
    max_connections: int = Field(64, ge=1)
    # Long-lane prompts are tens of KiB; base64 images are MiBs. 16 MiB covers both.
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    drain_timeout: float = Field(30.0, ge=0)
    # After SIGTERM, /readyz answers 503 this long while everything is still served, so
    # a load balancer or Kubernetes' endpoint controller sees it before the listener closes.
    drain_delay: float = Field(5.0, ge=0)
    # Client connections (nginx's client_header_timeout / client_body_timeout /
    # keepalive_timeout, HAProxy's maxconn). Headers are a few hundred bytes: 10 s is
    # generous for any real client and short for a slowloris.
    header_timeout: float = Field(10.0, gt=0)
    # The whole body, not one read: 16 MiB in 60 s needs about 2.2 Mbit/s.
    body_timeout: float = Field(60.0, gt=0)
    # Longer than the pool expiry of common clients (httpx 5 s, aiohttp 15 s), so a
    # pooled client never reuses a connection we are closing.
    idle_timeout: float = Field(30.0, gt=0)
    # Below a default `ulimit -n` of 1024 with room for the upstream connections.
    max_client_connections: int = Field(900, ge=1)
    # Processes serving the port (workers.py); 1 is the single process. 256 is far past
    # any machine's cores: a larger number is a typo, not a plan.
    workers: int = Field(1, ge=1, le=256)
    # Load balancers whose Forwarded / X-Forwarded-For name the client (observe/
    # client_address.py); none: the peer is the client.
    trusted_proxies: list[str] = Field(default_factory=list)
    # A second listener for /metrics, /admin/*, /healthz and /readyz; the main port then
    # serves only the API. None: everything on the main port.
    admin_port: int | None = Field(None, ge=0, le=65535)
    admin_host: str | None = None  # default: `host`
    # What /readyz answers: "fleet", 503 while no instance is up (a balancer then sends
    # nothing here); "process", 200 whenever this process serves, so clients get our own
    # 503 with Retry-After, not the balancer's, when the fleet is down. Both 503 draining.
    readiness: Literal["fleet", "process"] = "fleet"
    # Reload when config.toml, settings.json or a key_file changes on disk, as on SIGHUP
    # (process/watch.py): a ConfigMap update then needs no signal.
    reload_on_change: bool = False

    @model_validator(mode="after")
    def _admin_port_fixed_for_workers(self) -> GatewaySection:
        if self.admin_port == 0 and self.workers > 1:
            raise ValueError("admin_port: every worker must listen on one admin port, not 0")
        if self.admin_port and self.admin_port == self.port:
            raise ValueError(f"admin_port: {self.admin_port} is the API's port too")
        return self

    @field_validator("trusted_proxies")
    @classmethod
    def _cidrs(cls, value: list[str]) -> list[str]:
        for cidr in value:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ValueError(f"{cidr!r} is not an address or CIDR block") from None
        return value

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None:
            check_http_url(value)
        return value


class HealthSection(Frozen):
    rise: int = Field(2, ge=1)
    fall: int = Field(3, ge=1)
    probe_timeout: float = Field(2.0, gt=0)
    eject_after_failures: int = Field(5, ge=1)


class DispatchSection(Frozen):
    strategy: str = "least_busy"
    health_check_interval: float = Field(10.0, gt=0)
    max_queue_per_instance: int = Field(32, ge=0)
    # vLLM's own default; set it to the --max-num-seqs your instances run with.
    max_num_seqs: int = Field(256, ge=1)
    gateway_queue_size: int = Field(1024, ge=0)
    # Longest wait in the gateway queue; None: each lane's [slo] TTFT objective, since a
    # request that waited longer has missed it already and its client is better told now.
    max_queue_wait: float | None = Field(None, gt=0)
    # Blocks of 64 prompt tokens remembered per instance for prefix affinity; 0 turns
    # affinity off. None: as many as each instance's KV cache holds, from its
    # vllm:cache_config_info (8,192, about 524k tokens, until it says).
    prefix_index_blocks: int | None = Field(None, ge=0)
    # How often the host name of each `"discover": "dns"` instance entry is resolved again
    # (fleet/discovery.py); the resolver's own cache may hold an answer longer.
    discovery_interval: float = Field(5.0, gt=0)
    health: HealthSection = HealthSection()

    @field_validator("strategy")
    @classmethod
    def _known_strategy(cls, value: str) -> str:
        if value not in STRATEGIES:
            names = ", ".join(sorted(STRATEGIES))
            raise ValueError(f"unknown strategy {value!r}; expected one of {names}")
        return value


class PrefillSection(Frozen):
    tag: str = Field("prefill", min_length=1, max_length=64)
    long_input_threshold: int = Field(4096, ge=1)
    max_long_per_instance: int = Field(2, ge=1)
    # None: estimate; "instance": ask an instance's /tokenize near the threshold;
    # a path: a local HuggingFace tokenizer.json (needs the `tokenizers` package).
    tokenizer: str | None = None
    # What one image, audio clip or video counts in the estimate (see README, Dispatch).
    image_tokens: int = Field(1500, ge=0)
    image_pixels_per_token: int = Field(784, ge=0)  # 0: every image counts image_tokens
    audio_tokens: int = Field(750, ge=0)
    video_tokens: int = Field(8192, ge=0)

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_source(cls, value: str | None) -> str | None:
        if value is None or value == "instance":
            return value
        if not Path(value).is_file():
            raise ValueError("expected 'instance' or the path of a tokenizer.json")
        try:
            import tokenizers  # noqa: F401
        except ImportError:
            raise ValueError(
                "a tokenizer.json needs the 'tokenizers' package: pip install tokenizers"
            ) from None
        return value


class BatchSlo(Frozen):
    """The batch class's objectives per lane, in seconds ([slo.batch]): a batch request
    waits in the gateway queue up to its TTFT objective, behind interactive ones."""

    ttft: float = Field(30.0, gt=0)
    tpot: float = Field(0.2, gt=0)
    long_ttft: float = Field(120.0, gt=0)
    long_tpot: float = Field(0.2, gt=0)


class SloSection(Frozen):
    """Objectives per lane, in seconds; goodput counts streamed requests that meet both.
    These are the interactive class's (every key's unless it says `"priority": "batch"`)."""

    ttft: float = Field(2.0, gt=0)
    tpot: float = Field(0.1, gt=0)
    long_ttft: float = Field(15.0, gt=0)
    long_tpot: float = Field(0.1, gt=0)
    batch: BatchSlo = BatchSlo()

    @model_validator(mode="after")
    def _batch_waits_longer(self) -> SloSection:
        # Batch waits behind interactive until its own limit nears: a shorter one would
        # put it first.
        for name in ("ttft", "long_ttft"):
            if getattr(self.batch, name) < getattr(self, name):
                raise ValueError(
                    f"batch.{name} ({getattr(self.batch, name):g} s) must be at least "
                    f"{name} ({getattr(self, name):g} s): batch requests wait behind "
                    "interactive ones"
                )
        return self


class SharedSection(Frozen):
    """The shared view across workers and replicas; without `redis_url`, one process alone."""

    redis_url: SecretStr | None = None  # may hold a password: never logged
    publish_interval: float = Field(0.25, gt=0, le=5)
    # Between rounds, a changed load is pushed within this (0: rounds only).
    push_interval: float = Field(0.02, ge=0, le=5)
    ttl: float = Field(3.0, gt=0, le=60)  # a process's entries vanish this long after it died
    namespace: str = Field("gateway", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    # A place on an instance is a lease taken atomically in Redis: caps hold exactly across
    # replicas, at one Redis round trip per request (fleet/shared_leases.py).
    strict_caps: bool = False

    @model_validator(mode="after")
    def _ttl_covers_publishing(self) -> SharedSection:
        if self.ttl < 2 * self.publish_interval:
            raise ValueError(
                f"ttl ({self.ttl:g} s) must be at least twice publish_interval "
                f"({self.publish_interval:g} s), or live processes would vanish between writes"
            )
        return self

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            scheme = value.get_secret_value().partition("://")[0]
            if scheme not in ("redis", "rediss", "unix"):
                raise ValueError("expected a redis://, rediss:// or unix:// URL")
        return value


class TracingSection(Frozen):
    """OpenTelemetry spans (the `otel` extra); off unless an OTLP endpoint is given."""

    otlp_endpoint: str | None = None  # OTLP/HTTP, e.g. http://collector:4318

    @field_validator("otlp_endpoint")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None:
            check_http_url(value)
        return value


class ConfigFile(Frozen):
    gateway: GatewaySection = GatewaySection()
    dispatch: DispatchSection = DispatchSection()
    prefill: PrefillSection = PrefillSection()
    slo: SloSection = SloSection()
    shared: SharedSection = SharedSection()
    tracing: TracingSection = TracingSection()


# -------------------------------------------------------------- settings.json


class Timeouts(Frozen):
    connect: float = Field(10.0, gt=0)
    read: float = Field(120.0, gt=0)
    write: float = Field(30.0, gt=0)


class RetrySettings(Frozen):
    max_attempts: int = Field(3, ge=1, le=10)
    backoff_base: float = Field(0.5, ge=0)
    backoff_max: float = Field(8.0, ge=0)
    # Continuations of a stream its instance broke after the client got part of it, on
    # other instances (relay/continuation.py); 0: such a stream ends with the in-band error.
    migrations: int = Field(2, ge=0, le=10)


class KeyEntry(Frozen):
    """A named key: who a client is, the models it may use and its limits (channel.keys).

    The key itself comes from exactly one of `key` (usually `"${VAR}"`), `key_env` or
    `key_file` (read again by a reload: the way to rotate it without a restart).
    """

    name: str = Field(pattern=KEY_NAME)
    key: SecretStr | None = None
    key_env: str | None = None
    key_file: str | None = None
    models: list[str] | None = Field(None, min_length=1)  # None: every model
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    max_concurrent: int | None = Field(None, ge=1)
    # Opens /admin/* (the fleet's config, every key's usage): the unnamed keys always do,
    # a named key only with this, so a client's key never reads its neighbours' usage.
    admin: bool = False
    # "interactive", "batch", or vLLM's own priority value (lower runs first; above 0 is
    # the batch class here), sent to instances whose scheduling_policy is "priority".
    priority: str | int = PRIORITIES[0]
    # Its part of a saturated fleet against the other keys of its class (the unnamed keys
    # are one key, `default`, with 1): share 2 is served twice what share 1 is while both
    # wait (dispatch/fairness.py).
    share: float = Field(1.0, gt=0, le=1000)

    @field_validator("priority")
    @classmethod
    def _priority_class(cls, value: str | int) -> str | int:
        if isinstance(value, str) and value not in PRIORITIES:
            raise ValueError(f"expected {' or '.join(map(repr, PRIORITIES))}, or a number")
        if isinstance(value, int) and not -(2**63) <= value < 2**63:
            raise ValueError("vLLM's priority is a 64-bit integer")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> KeyEntry:
        given = [f for f in ("key", "key_env", "key_file") if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError(
                f"key {self.name!r}: give exactly one of key, key_env or key_file"
                + (f", not {' and '.join(given)}" if given else "")
            )
        return self


class Channel(Frozen):
    base_url: str | None = None
    api_key: SecretStr | list[SecretStr] | None = None
    api_key_env: str | None = None
    keys: list[KeyEntry] = Field(default_factory=list)
    default_model: str | None = None
    timeout: Timeouts = Timeouts()
    retry: RetrySettings = RetrySettings()
    headers: dict[str, str] = Field(default_factory=dict)

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None:
            check_http_url(value)
        return value

    @field_validator("keys")
    @classmethod
    def _unique_names(cls, value: list[KeyEntry]) -> list[KeyEntry]:
        seen: dict[str, int] = {}
        for index, entry in enumerate(value):
            first = seen.setdefault(entry.name, index)
            if first != index:
                raise ValueError(f"key name {entry.name!r} is used twice ([{first}] and [{index}])")
        return value

    @field_validator("headers")
    @classmethod
    def _sendable(cls, value: dict[str, str]) -> dict[str, str]:
        # Either would fail every request sent to an instance (aiohttp raises on CR/LF,
        # an HTTP server answers 400 to a bad name): fail here, at --check, instead.
        for name, text in value.items():
            if not _TOKEN.fullmatch(name):
                raise ValueError(
                    f"header name {name!r} is not a valid HTTP header name "
                    "(letters, digits and !#$%&'*+-.^_`|~ only; no spaces or colons)"
                )
            if CONTROL_CHARACTER.search(text):
                # The value itself is not shown: a header may carry a credential.
                raise ValueError(
                    f"the value of header {name!r} contains a control character "
                    "(CR, LF or another below 0x20 except tab); it cannot be sent"
                )
        return value


class KvEventsConfig(Frozen):
    """Where an instance publishes its KV cache events: the `endpoint`, `replay_endpoint`
    and `topic` of the `--kv-events-config` it was started with, copied as they are. A `*`
    host (vLLM binds there) stands for the instance's own host, so one entry serves every
    instance a `"discover": "dns"` entry finds."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""  # vLLM's default: the empty topic, which matches any

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _zmq_endpoint(cls, value: str | None) -> str | None:
        if value is None:
            return value
        scheme, sep, rest = value.partition("://")
        if scheme == "ipc" and sep and rest:
            return value
        host, colon, port = rest.rpartition(":")
        if scheme != "tcp" or not sep or not colon or not host or not port.isdigit():
            raise ValueError(
                f"{value!r} is not a ZMQ endpoint: write tcp://host:port (a * host is the "
                "instance's own, as vLLM's --kv-events-config binds it) or ipc://path"
            )
        if not 0 < int(port) < 65536:
            raise ValueError(f"bad port in {value!r}")
        return value


class InstanceConfig(Frozen):
    url: str
    name: str | None = None
    lane: InstanceLane = "any"
    api_key_env: str | None = None
    weight: float = Field(1.0, gt=0)
    max_num_seqs: int | None = Field(None, ge=1)
    # The models (and LoRA adapters) it serves, for instances that hide /v1/models;
    # without it they are learned from /v1/models every health round.
    models: list[str] | None = Field(None, min_length=1)
    # Prefill/decode disaggregation (vLLM's KV connector on both): "prefill" takes only
    # the prompts worth a second hop, "decode" the answers (and short prompts whole).
    role: Role = "both"
    # As started with vLLM's --scheduling-policy: with "priority" it orders its own queue
    # by the `priority` field the gateway writes from the key. Under fcfs the field means
    # nothing (vLLM v1 ignores it, v0 refused a nonzero one): it is written only there.
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    # "dns": the URL's host name stands for every address it resolves to, each one
    # instance with this entry's other fields (fleet/discovery.py): a Kubernetes headless
    # Service's pods, found again every `[dispatch] discovery_interval`.
    discover: Literal["dns"] | None = None
    # It publishes its KV cache events (vLLM's --kv-events-config): its prefix cache is
    # read from them (fleet/kv_events.py) instead of inferred from what was sent there.
    kv_events: KvEventsConfig | None = None

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        check_http_url(value)
        parts = urlsplit(value)
        if parts.path.rstrip("/"):
            # The gateway appends /health, /metrics and /v1/... itself; `host:8000/v1`
            # would probe /v1/health, find nothing, and mark the instance down.
            root = urlunsplit((parts.scheme, parts.netloc, "", "", ""))
            raise ValueError(
                f"an instance URL must not have a path: write {root!r} "
                "(the gateway adds /v1/... and /health itself)"
            )
        return value.rstrip("/")

    @model_validator(mode="after")
    def _srv_needs_the_dns_extra(self) -> InstanceConfig:
        host = urlsplit(self.url).hostname or ""
        if self.discover == "dns" and host.startswith("_") and find_spec("dns") is None:
            raise ValueError(
                f"{host!r} is an SRV name (_service._proto.name): reading SRV records needs "
                "the dns extra (pip install 'vllm-dispatch-gateway[dns]', dnspython)"
            )
        return self

    @property
    def endpoint(self) -> tuple[str, int]:
        """The host and port this URL reaches; every loopback name is one host, `loopback`."""
        return endpoint(self.url)

    @property
    def label(self) -> str:
        """The name used in metrics and logs: the configured name, else host:port."""
        if self.name:
            return self.name
        parts = urlsplit(self.url)
        # Never user:password@ from the URL: the label goes into metrics and logs.
        return parts.netloc.rpartition("@")[2] + parts.path


class VllmSection(Frozen):
    instances: list[InstanceConfig] = Field(min_length=1)
    tensor_parallel_size: int = Field(1, ge=1)

    @field_validator("instances", mode="before")
    @classmethod
    def _strings_are_urls(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [{"url": item} if isinstance(item, str) else item for item in value]
        return value

    @field_validator("instances")
    @classmethod
    def _unique(cls, value: list[InstanceConfig]) -> list[InstanceConfig]:
        # One instance listed twice gets twice its share of traffic and twice its slots
        # counted: it overloads while the gateway believes there is room.
        endpoints: dict[tuple[str, int], int] = {}
        labels: dict[str, int] = {}
        for index, spec in enumerate(value):
            first = endpoints.setdefault(spec.endpoint, index)
            if first != index:
                alias = spec.endpoint[0] == LOOPBACK and spec.url != value[first].url
                why = " (localhost, 127.x.x.x and ::1 are all this machine)" if alias else ""
                raise ValueError(
                    f"[{index}] {spec.url!r} is listed twice: it is the same instance as "
                    f"[{first}] {value[first].url!r}{why}"
                )
            first = labels.setdefault(spec.label, index)
            if first != index:
                raise ValueError(
                    f"instance name {spec.label!r} is used twice ([{first}] and [{index}])"
                )
        return value

    @field_validator("instances")
    @classmethod
    def _someone_decodes(cls, value: list[InstanceConfig]) -> list[InstanceConfig]:
        # A prefill instance computes a prompt and answers one token: without an instance
        # to decode, no request could ever be answered.
        if all(spec.role == "prefill" for spec in value):
            raise ValueError(
                'every instance has role "prefill": give at least one role "decode" or '
                '"both" (a prefill instance answers only the first token)'
            )
        return value


class Settings(Frozen):
    channel: Channel = Channel()
    vllm: VllmSection

    @model_validator(mode="before")
    @classmethod
    def _seed_block_name(cls, data: Any) -> Any:
        # The seed post calls the channel block after its hosted service.
        if isinstance(data, dict) and "taotoken" in data:
            if "channel" in data:
                raise ValueError("give either 'channel' or 'taotoken', not both")
            data = {("channel" if k == "taotoken" else k): v for k, v in data.items()}
        return data
