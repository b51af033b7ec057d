"""What one gateway process publishes for the others, and how the others' are read and summed.

Pure: no Redis, no clock. `shared.py` moves these bytes; this module says what they mean.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from gateway.dispatch import Lane, LocalShare, PeerLoad, PeerSpeed, SharedView


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
        "rates": [[lane.value, model, rate] for (lane, model), rate in share.rates.items()],
        "budget": [requests, retries],
        "seq": seq,
    }
    return json.dumps(body, separators=(",", ":")).encode()


def decode(data: bytes | str) -> PeerEntry:
    """Another process's publication; ValueError if it is malformed."""
    try:
        return _decode(json.loads(data))
    except (KeyError, TypeError, IndexError, AttributeError) as exc:
        raise ValueError(f"malformed publication: {type(exc).__name__}: {exc}") from None


def _decode(body: dict[str, Any]) -> PeerEntry:
    # A process from before long prefills (or long answers) were shared publishes two
    # (or three) numbers: what it leaves out counts zero.
    loads = {
        name: PeerLoad(int(v[0]), int(v[1]), *(int(x) for x in v[2:4]))
        for name, v in body["loads"].items()
    }
    speeds = {
        name: PeerSpeed(
            None if v[0] is None else float(v[0]),
            int(v[1]),
            None if v[2] is None else float(v[2]),
            int(v[3]),
        )
        for name, v in body["speeds"].items()
    }
    queued = {Lane(lane): int(n) for lane, n in body["queued"].items()}
    rates: dict[tuple[Lane, str | None], float] = {
        (Lane(lane), None if model is None else str(model)): float(rate)
        for lane, model, rate in body.get("rates", ())
    }
    requests, retries = (int(n) for n in body["budget"])
    return PeerEntry(
        LocalShare(loads, speeds, queued, rates), requests, retries, int(body.get("seq", 0))
    )


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
    if not sep or not process:
        raise ValueError("malformed push: no process id")
    payload, _, rest = rest.partition(b"\n")
    placed, _, settled = rest.partition(b"\n")
    return (
        process.decode(),
        payload,
        parse_placements(placed) if placed else [],
        parse_placements(settled) if settled else [],
    )


def parse_placements(data: bytes | str) -> Placements:
    """Placements as published (JSON pairs); ValueError if they are malformed."""
    try:
        return [(str(name), [int(b) for b in blocks]) for name, blocks in json.loads(data)]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"malformed placements: {exc}") from None


def combine(entries: list[PeerEntry]) -> SharedView:
    """The others' publications summed into one view (speeds kept apart, to blend)."""
    loads: dict[str, PeerLoad] = {}
    speeds: dict[str, list[PeerSpeed]] = {}
    queued: dict[Lane, int] = {}
    rates: dict[tuple[Lane, str | None], float] = {}
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
        for key, rate in entry.share.rates.items():
            rates[key] = rates.get(key, 0.0) + rate
    return SharedView(loads=loads, speeds=speeds, queued=queued, peers=len(entries), rates=rates)


def redacted(url: str) -> str:
    """The URL without its password, for logs."""
    parts = urlsplit(url)
    host = parts.hostname or parts.path or "?"
    return f"{parts.scheme}://{host}" + (f":{parts.port}" if parts.port else "")
