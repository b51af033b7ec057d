"""What one gateway process publishes for the others, and how the others' are read and summed.

Pure: no Redis, no clock. `shared.py` moves these bytes; this module says what they mean.

Anything read from Redis is untrusted input: whoever can write there (or one buggy
replica) must not be able to take a replica down. So a publication is parsed into bounded
values here, at the seam, or refused whole with `Refused` and a short reason that the
caller counts: over `MAX_ENTRY_BYTES`; not the shape we write; a number that is not finite,
negative or beyond what any fleet holds. Instances the reader does not know are skipped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from gateway.dispatch import Lane, LocalShare, PeerLoad, PeerSpeed, Priority, SharedView
from gateway.dispatch.model import RateKey


@dataclass(frozen=True)
class PeerEntry:
    """One other process's publication, decoded."""

    share: LocalShare
    requests: int
    retries: int
    seq: int = 0  # the publisher's count of publications: a higher one is newer


def encode(share: LocalShare, requests: int, retries: int, seq: int = 0) -> bytes:
    """This process's publication: compact JSON, a few dozen bytes per instance."""
    body = {
        "loads": {
            name: [p.inflight, p.pending_prefill_tokens, p.long_prefilling, p.long_running]
            for name, p in share.loads.items()
        },
        "speeds": {
            name: [s.prefill, s.prefill_samples, s.tpot, s.tpot_samples]
            for name, s in share.speeds.items()
        },
        "queued": {lane.value: n for lane, n in share.queued.items()},
        # A batch class's rate carries its class; an interactive one's is three items, as
        # before classes were.
        "rates": [
            [lane.value, model, rate] + ([priority.value] if priority is Priority.BATCH else [])
            for (lane, model, priority), rate in share.rates.items()
        ],
        "queued_batch": {lane.value: n for lane, n in share.queued_batch.items()},
        "keys": {
            key: [share.key_queued.get(key, 0), share.key_service.get(key, 0.0)]
            for key in share.key_queued.keys() | share.key_service.keys()
        },
        "budget": [requests, retries],
        "seq": seq,
    }
    return json.dumps(body, separators=(",", ":")).encode()


# A publication is a few dozen bytes per instance; a thousand instances fit many times.
MAX_ENTRY_BYTES = 256 * 1024
# Bounds no honest process reaches: requests and tokens per instance, queue and budget
# counts, speeds (tokens/s, seconds a token), and the rates and models listed.
MAX_COUNT = 1_000_000
MAX_TOKENS = 10**10
MAX_RATE = 1e9
MAX_RATES = 1024
MAX_MODEL_CHARS = 512
MAX_KEYS = 4096  # keys with a fair-share count: the named keys and "default"
MAX_KEY_CHARS = 64  # as config/schema.py's KEY_NAME
MAX_SERVICE = 1e18  # weighted tokens: a fleet at a million tokens/s serves 1e18 in 30,000 years


class Refused(ValueError):
    """A publication not taken; `reason` is one word, for a counter's label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def decode(data: bytes | str, known: Collection[str] | None = None) -> PeerEntry:
    """Another process's publication, bounded; `Refused` (a ValueError) if it cannot be.

    With `known`, only those instances' loads and speeds are kept.
    """
    if len(data) > MAX_ENTRY_BYTES:
        raise Refused("too_large", f"{len(data)} bytes, over {MAX_ENTRY_BYTES}")
    try:
        body = json.loads(data)
    except ValueError as exc:
        raise Refused("malformed", f"not JSON: {exc}") from None
    except RecursionError:  # nested past the stack within the size bound
        raise Refused("malformed", "nested too deeply to read") from None
    try:
        return _decode(body, known)
    except Refused:
        raise
    except (KeyError, TypeError, IndexError, AttributeError, ValueError) as exc:
        raise Refused("malformed", f"{type(exc).__name__}: {exc}") from None


def _count(value: Any, bound: int = MAX_COUNT) -> int:
    """A non-negative whole number no larger than `bound` (a JSON float like 3.0 is one)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{value!r} is not a number")
    if not math.isfinite(value) or value < 0 or value > bound or value != int(value):
        raise Refused("out_of_bounds", f"{value!r} is not a count in 0..{bound}")
    return int(value)


def _real(value: Any, bound: float = MAX_RATE) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{value!r} is not a number")
    if not math.isfinite(value) or value < 0 or value > bound:
        raise Refused("out_of_bounds", f"{value!r} is not a value in 0..{bound:g}")
    return float(value)


def _speed(value: Any) -> float | None:
    """A learned speed (tokens/s, seconds a token): unknown, or positive."""
    if value is None:
        return None
    speed = _real(value)
    if speed <= 0:
        raise Refused("out_of_bounds", f"{value!r} is not a speed")
    return speed


def _decode(body: dict[str, Any], known: Collection[str] | None) -> PeerEntry:
    def ours(items: dict[str, Any]) -> list[tuple[str, Any]]:
        if not isinstance(items, dict):
            raise TypeError("not an object")
        return [(n, v) for n, v in items.items() if known is None or n in known]

    # A process from before long prefills (or long answers) were shared publishes two
    # (or three) numbers: what it leaves out counts zero.
    loads = {
        name: PeerLoad(_count(v[0]), _count(v[1], MAX_TOKENS), *(_count(x) for x in v[2:4]))
        for name, v in ours(body["loads"])
    }
    speeds = {
        name: PeerSpeed(_speed(v[0]), _count(v[1]), _speed(v[2]), _count(v[3]))
        for name, v in ours(body["speeds"])
    }
    queued = {Lane(lane): _count(n) for lane, n in body["queued"].items()}
    listed = body.get("rates", ())
    if len(listed) > MAX_RATES:
        raise Refused("out_of_bounds", f"{len(listed)} rates, over {MAX_RATES}")
    rates: dict[RateKey, float] = {}
    for lane, model, rate, *of_class in listed:
        if model is not None and (not isinstance(model, str) or len(model) > MAX_MODEL_CHARS):
            raise Refused("out_of_bounds", "a model name that is not one")
        priority = Priority(*of_class) if of_class else Priority.INTERACTIVE
        rates[(Lane(lane), model, priority)] = _real(rate)
    queued_batch = {Lane(lane): _count(n) for lane, n in body.get("queued_batch", {}).items()}
    keys = body.get("keys", {})  # absent from a process from before fair share
    if not isinstance(keys, dict):
        raise TypeError("keys: not an object")
    if len(keys) > MAX_KEYS:
        raise Refused("out_of_bounds", f"{len(keys)} keys, over {MAX_KEYS}")
    if any(len(key) > MAX_KEY_CHARS for key in keys):
        raise Refused("out_of_bounds", "a key name that is not one")
    # A key is listed when it has either; a zero of the other is "none", as published.
    key_queued = {key: n for key, v in keys.items() if (n := _count(v[0]))}
    key_service = {key: x for key, v in keys.items() if (x := _real(v[1], MAX_SERVICE))}
    requests, retries = (_count(n) for n in body["budget"])
    seq = _count(body.get("seq", 0), 2**62)
    share = LocalShare(loads, speeds, queued, rates, queued_batch, key_queued, key_service)
    return PeerEntry(share, requests, retries, seq)


def newest(old: PeerEntry | None, new: PeerEntry) -> PeerEntry:
    """Of two publications by one process, the later one (pushes and keys arrive unordered)."""
    return new if old is None or new.seq >= old.seq else old


def push_key(share: LocalShare) -> tuple[object, ...]:
    """What a push is sent for: the load and the queues (speeds and budget ride along)."""
    return (share.loads, share.queued)


Placements = list[tuple[str, list[int]]]  # (instance, a prompt's block hashes) each


def push_message(
    process_id: str,
    payload: bytes,
    placements: Sequence[tuple[str, Sequence[int]]] = (),
    settled: Sequence[tuple[str, Sequence[int]]] = (),
) -> bytes:
    """The process id, a space, the publication and, each on a line of its own, the prompts
    placed since the last push and those that had their first token (so the others'
    prefix indexes learn where a prefix lives, and that it is computed there, at once)."""
    message = process_id.encode() + b" " + payload
    if placements or settled:
        message += b"\n" + json.dumps(placements, separators=(",", ":")).encode()
    if settled:
        message += b"\n" + json.dumps(settled, separators=(",", ":")).encode()
    return message


def parse_push(data: bytes | str) -> tuple[str, bytes, Placements, Placements]:
    """(process id, publication, placements, settled) of a push; ValueError if malformed."""
    raw = data.encode() if isinstance(data, str) else data
    process, sep, rest = raw.partition(b" ")
    if not sep or not process or len(process) > 256:
        raise Refused("malformed", "a push without a process id")
    payload, _, rest = rest.partition(b"\n")
    placed, _, settled = rest.partition(b"\n")
    return (
        process.decode(),
        payload,
        parse_placements(placed) if placed else [],
        parse_placements(settled) if settled else [],
    )


MAX_PLACEMENT_BYTES = 4 * 1024 * 1024  # a round's placements: 256 prompts of long documents


def parse_placements(data: bytes | str) -> Placements:
    """Placements as published (JSON pairs); `Refused` if they are malformed or too large."""
    if len(data) > MAX_PLACEMENT_BYTES:
        raise Refused("too_large", f"placements of {len(data)} bytes")
    try:
        return [(str(name), [int(b) for b in blocks]) for name, blocks in json.loads(data)]
    except (TypeError, ValueError, RecursionError) as exc:
        raise Refused("malformed", f"placements: {type(exc).__name__}") from None


def combine(entries: list[PeerEntry]) -> SharedView:
    """The others' publications summed into one view (speeds kept apart, to blend)."""
    loads: dict[str, PeerLoad] = {}
    speeds: dict[str, list[PeerSpeed]] = {}
    queued: dict[Lane, int] = {}
    rates: dict[RateKey, float] = {}
    queued_batch: dict[Lane, int] = {}
    key_queued: dict[str, int] = {}
    key_service: dict[str, float] = {}
    for entry in entries:
        for name, load in entry.share.loads.items():
            total = loads.get(name, PeerLoad())
            loads[name] = PeerLoad(
                total.inflight + load.inflight,
                total.pending_prefill_tokens + load.pending_prefill_tokens,
                total.long_prefilling + load.long_prefilling,
                total.long_running + load.long_running,
            )
        for name, speed in entry.share.speeds.items():
            speeds.setdefault(name, []).append(speed)
        for lane, n in entry.share.queued.items():
            queued[lane] = queued.get(lane, 0) + n
        for lane, n in entry.share.queued_batch.items():
            queued_batch[lane] = queued_batch.get(lane, 0) + n
        for key, rate in entry.share.rates.items():
            rates[key] = rates.get(key, 0.0) + rate
        for name, n in entry.share.key_queued.items():
            key_queued[name] = key_queued.get(name, 0) + n
        for name, service in entry.share.key_service.items():
            key_service[name] = key_service.get(name, 0.0) + service
    return SharedView(
        loads=loads,
        speeds=speeds,
        queued=queued,
        peers=len(entries),
        rates=rates,
        queued_batch=queued_batch,
        key_queued=key_queued,
        key_service=key_service,
    )


def redacted(url: str) -> str:
    """The URL without its password, for logs."""
    parts = urlsplit(url)
    host = parts.hostname or parts.path or "?"
    return f"{parts.scheme}://{host}" + (f":{parts.port}" if parts.port else "")
