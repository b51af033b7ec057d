"""What one instance's prefix cache holds, exactly, from the KV events its engine publishes.

vLLM (`--kv-events-config`, `vllm/distributed/kv_events.py`) publishes every engine step's
block changes: `BlockStored` (the blocks' hashes, their parent's, their token ids),
`BlockRemoved` (hashes only) and `AllBlocksCleared`, numbered by a sequence that counts
from 0 at the engine's start. The gateway cannot compute the engine's own hashes (sha256
with a seed, or a hash whose output changed between versions), and need not: as llm-d's
indexer does, it chains a hash of its own over the token ids the events carry, keeps a map
from the engine's hash to its own so that a removal (hashes only) finds its block, and
hashes a request's token ids the same way to look them up. Its hash is Python's own of a
tuple (C speed; not salted for ints, and each process hashes both sides itself, so a
string's salt is the same on both).

A block's key is what vLLM's is: the parent block, the block's tokens and its extra keys
(the LoRA adapter's name, a `cache_salt` on the first block, multimodal hashes), so a salt
or an adapter never shares blocks with another.

The index is *whole* when it has seen every event since the engine started or last
cleared its cache: it is then the cache, and a request's cached prefix is what it says.
It is *partial* when events were lost and could not be replayed, or when the gateway
joined a running engine whose replay buffer no longer reaches its start: what it holds is
surely there, what it lacks may be there too, so the approximate index (affinity.py)
still counts. It is *stale* when events stopped: the engine computed a prompt of ours and
said nothing within a health interval. The approximate index then decides alone; if the
next batch comes in order, nothing was missed and the index is what it was, and if not,
the gap goes as any gap does. An engine whose numbering goes back started again: its
cache is empty, and the index starts over from its batch 0 (replayed if it went by).

Requests placed but not yet prefilled are not in the cache yet, but a request of the
same prefix placed behind one of them finds it computed by its turn: their blocks are
kept apart as *pending* and attract such requests, as the approximate index's unsettled
blocks do.

Pure: the shell (fleet/kv_events.py) reads the sockets and feeds decoded events in.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

ROOT = 0x6B76  # the parent of a prompt's first block, in our chain


class KvState(enum.Enum):
    WAITING = "waiting"  # configured; no event yet (the approximate index decides)
    WHOLE = "whole"  # every event since the engine's start or last clear: exact
    PARTIAL = "partial"  # some were lost: what it holds counts, beside the approximate index
    STALE = "stale"  # events stopped: not trusted, the approximate index decides


@dataclass(frozen=True)
class StoredBlocks:
    """Consecutive blocks of one chain computed and cached (vLLM's BlockStored)."""

    block_hashes: Sequence[Hashable]  # the engine's: int (its low 64 bits) or bytes
    parent: Hashable | None  # the engine's hash of the block before the first; None: a root
    token_ids: Sequence[int]  # len(block_hashes) * block_size of them
    block_size: int
    # One per block, or None: vLLM's extra keys (LoRA name, cache_salt, multimodal hashes).
    # Older versions send none: then only `lora_name` keeps adapters apart.
    extra_keys: Sequence[tuple[Hashable, ...] | None] | None = None
    lora_name: str | None = None
    medium: str | None = None
    group: int | None = None  # the KV cache group (hybrid models); the first is indexed


@dataclass(frozen=True)
class RemovedBlocks:
    """Blocks evicted (vLLM's BlockRemoved)."""

    block_hashes: Sequence[Hashable]
    medium: str | None = None
    group: int | None = None


@dataclass(frozen=True)
class ClearedCache:
    """The engine emptied its cache (vLLM's AllBlocksCleared: /reset_prefix_cache)."""


Event = StoredBlocks | RemovedBlocks | ClearedCache


def request_extra_keys(
    index: int, lora_name: str | None, cache_salt: str | None
) -> tuple[Hashable, ...] | None:
    """The extra keys vLLM hashes into a text prompt's block `index`
    (`generate_block_hash_extra_keys`: the adapter's name on every block, the salt on the
    first only); None where there are none."""
    keys: tuple[Hashable, ...] = ()
    if lora_name:
        keys = (lora_name,)
    if index == 0 and cache_salt:
        keys = (*keys, cache_salt)
    return keys or None


def chain(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> tuple[int, ...]:
    """Our hash of every full block of a prompt's token ids: block k's names blocks 0..k."""
    out = []
    parent = ROOT
    for k, start in enumerate(range(0, len(token_ids) - block_size + 1, block_size)):
        extra = request_extra_keys(k, lora_name, cache_salt)
        parent = _link(parent, token_ids[start : start + block_size], extra)
        out.append(parent)
    return tuple(out)


def _link(parent: int, tokens: Sequence[int], extra: tuple[Hashable, ...] | None) -> int:
    """Our hash of one block after `parent`: a request's and an event's blocks alike."""
    return hash((parent, tuple(tokens), extra))


def _stored_extra(event: StoredBlocks, k: int) -> tuple[Hashable, ...] | None:
    if event.extra_keys is not None:
        extra = event.extra_keys[k] if k < len(event.extra_keys) else None
        return tuple(extra) if extra else None
    # An older engine: no extra keys on the wire, the adapter's name alone.
    return (event.lora_name,) if event.lora_name else None


Action = Literal["apply", "replay", "restart"]


@dataclass(frozen=True, slots=True)
class KvView:
    """One index, copied for the operator (/admin/instances, /metrics)."""

    state: str
    blocks: int
    block_size: int | None
    next_seq: int | None
    last_event_age: float | None  # seconds since the last batch; None: none yet
    batches_total: int
    events_total: int
    gaps_total: int
    replays_total: int
    replays_failed_total: int
    malformed_total: int
    unchained_total: int
    stale_total: int


class KvIndex:
    """One instance's cached blocks, by our chain hash, as its events say."""

    def __init__(self) -> None:
        self.state = KvState.WAITING
        self._before_stale = KvState.WAITING  # what it was when it went stale
        self.block_size: int | None = None  # learned from the first BlockStored
        self.next_seq: int | None = None  # the sequence number expected next
        self._held: Counter[int] = Counter()  # our hash -> engine blocks that are it
        self._ours: dict[Hashable, int] = {}  # the engine's hash -> ours
        self._media: dict[Hashable, set[str | None]] = {}  # the engine's hash -> where held
        self._pending: dict[int, _Pending] = {}  # placed tickets not prefilled yet
        self._computed: set[int] = set()  # of those, prefilled: released at the next batch
        self._pending_blocks: Counter[int] = Counter()
        self._version = 0  # counts changes to the blocks held, for `match`'s memo
        self._memo: tuple[Sequence[int], int, int] | None = None
        self.adapters: set[str] = set()  # LoRA names seen: a request for one hashes it in
        # Since when a prompt of ours was computed there and its blocks did not show (None:
        # nothing expected); an event clears it.
        self.expecting_since: float | None = None
        self.last_event_at: float | None = None
        # For the operator.
        self.batches_total = 0
        self.events_total = 0
        self.gaps_total = 0
        self.replays_total = 0
        self.replays_failed_total = 0
        self.malformed_total = 0
        self.unchained_total = 0  # stored blocks whose parent it never saw (skipped)
        self.stale_total = 0

    def __len__(self) -> int:
        return len(self._held)

    def __repr__(self) -> str:
        return f"<KvIndex {self.state.value} {len(self._held)} blocks next_seq={self.next_seq}>"

    def view(self, now: float) -> KvView:
        last = self.last_event_at
        return KvView(
            state=self.state.value,
            blocks=len(self._held),
            block_size=self.block_size,
            next_seq=self.next_seq,
            last_event_age=None if last is None else now - last,
            batches_total=self.batches_total,
            events_total=self.events_total,
            gaps_total=self.gaps_total,
            replays_total=self.replays_total,
            replays_failed_total=self.replays_failed_total,
            malformed_total=self.malformed_total,
            unchained_total=self.unchained_total,
            stale_total=self.stale_total,
        )

    # --- the sequence ------------------------------------------------------------------

    def arrival(self, seq: int) -> Action:
        """What batch `seq` from the PUB socket asks for: apply it (the next one, or the
        engine's first), replay what is missing before it (from `next_seq`, or from 0 for
        an index that never saw the start), or start over (the numbering went back: the
        engine started again, and its first batches may have gone before we reconnected)."""
        expected = self.next_seq
        if expected is None:
            return "apply" if seq == 0 else "replay"
        if seq == expected:
            return "apply"
        return "replay" if seq > expected else "restart"

    def restarted(self) -> None:
        """The engine started again: what it held is gone, and its events count from 0."""
        self._forget()
        self.state = KvState.WAITING
        self.next_seq = None

    def replay_from(self) -> int:
        return 0 if self.next_seq is None else self.next_seq

    def gap(self, *, replaying: bool) -> None:
        """Batches are missing before the one that came: count the gap (unless the index
        never saw a batch), and the replay if one is asked for."""
        if self.next_seq is not None:
            self.gaps_total += 1
        if replaying:
            self.replays_total += 1

    def unreplayed(self, seq: int) -> None:
        """The replay did not reach `seq`: what came before it is lost."""
        self.replays_failed_total += 1
        self._lost(seq)

    def malformed(self, seq: int) -> None:
        """Batch `seq` could not be read: its events are lost."""
        self.malformed_total += 1
        self._lost(seq + 1)

    def _lost(self, resume_at: int) -> None:
        # The index keeps what it holds (surely cached, if not evicted since) and is
        # partial; one that was whole cannot say what it missed, so it starts empty.
        if self._trusted() is KvState.WHOLE:
            self._forget()
        self.state = KvState.PARTIAL
        self.next_seq = resume_at

    def _trusted(self) -> KvState:
        """The state it has, or had before its events stopped."""
        return self._before_stale if self.state is KvState.STALE else self.state

    def apply_batch(self, seq: int, events: Sequence[Event], now: float) -> None:
        """Batch `seq`, in order (after `arrival` said so, or a replay brought it)."""
        if seq == 0:  # a new engine: its cache starts empty, and everything since is here
            self._forget()
            self.state = KvState.WHOLE
        elif self.state is KvState.WAITING:
            self.state = KvState.PARTIAL  # joined late and the replay did not reach the start
        elif self.state is KvState.STALE:
            # The next batch in order (a gap went through `_lost`): nothing was missed, the
            # engine was only silent; it is what it was.
            self.state = self._before_stale
        self.next_seq = seq + 1
        self.batches_total += 1
        self.last_event_at = now
        self.expecting_since = None
        for ticket_id in list(self._computed):  # stored by now, or stored by this batch
            self.release(ticket_id)
        for event in events:
            self.events_total += 1
            if isinstance(event, StoredBlocks):
                self._store(event)
            elif isinstance(event, RemovedBlocks):
                self._remove(event)
            else:
                self._forget()
                self.state = KvState.WHOLE  # a cleared cache is empty: known exactly

    def _store(self, event: StoredBlocks) -> None:
        if event.group:  # a hybrid model's other groups: the first group's blocks decide
            return
        size = event.block_size
        if size < 1 or len(event.token_ids) < size * len(event.block_hashes):
            return
        if self.block_size != size:
            if self.block_size is not None:
                self._forget()  # a new engine with another block size
            self.block_size = size
        if event.lora_name:
            self.adapters.add(event.lora_name)
        if event.parent is None:
            parent = ROOT
        else:
            known = self._ours.get(event.parent)
            if known is None:  # stored before we listened, or its event was lost
                self.unchained_total += len(event.block_hashes)
                return
            parent = known
        tokens = event.token_ids
        for k, engine_hash in enumerate(event.block_hashes):
            parent = _link(parent, tokens[k * size : (k + 1) * size], _stored_extra(event, k))
            media = self._media.setdefault(engine_hash, set())
            if not media:
                self._ours[engine_hash] = parent
                self._held[parent] += 1
                self._version += 1
            media.add(event.medium)  # a copy in another medium (CPU offload) is one block

    def _remove(self, event: RemovedBlocks) -> None:
        if event.group:
            return
        for engine_hash in event.block_hashes:
            media = self._media.get(engine_hash)
            if media is None:
                continue
            media.discard(event.medium)
            if not media:
                del self._media[engine_hash]
                self._drop(self._ours.pop(engine_hash))

    def _drop(self, ours: int) -> None:
        self._version += 1
        left = self._held[ours] - 1
        if left > 0:
            self._held[ours] = left
        else:
            del self._held[ours]

    def _forget(self) -> None:
        self._version += 1
        self._held.clear()
        self._ours.clear()
        self._media.clear()

    # --- staleness -----------------------------------------------------------------------

    def computed(self, ticket_id: int, now: float) -> None:
        """A prompt of ours placed there had its first token. Its blocks stay pending until
        the next batch comes (the one that stores them may still be on its way: meanwhile
        its prefix must not look cold there). If it held blocks the cache did not and no
        event at all came since it was placed, the engine owes one (computing a block
        stores it before the first token is sent); `check` says stale when none comes."""
        pending = self._pending.get(ticket_id)
        if pending is None:
            return
        self._computed.add(ticket_id)
        if not pending.owed or self.expecting_since is not None:
            return
        last = self.last_event_at
        if self.usable and (last is None or last < pending.placed_at):
            self.expecting_since = now

    def check(self, now: float, grace: float) -> bool:
        """True (once) when events owed for longer than `grace` did not come: the index is
        stale until a batch arrives."""
        since = self.expecting_since
        if since is None or now - since < grace or self.state is KvState.STALE:
            return False
        # Not trusted until events come again; kept, since they may come in order.
        self._before_stale = self.state
        self.state = KvState.STALE
        self.expecting_since = None
        self.stale_total += 1
        return True

    # --- lookups ---------------------------------------------------------------------------

    @property
    def usable(self) -> bool:
        return self.state in (KvState.WHOLE, KvState.PARTIAL)

    def match(self, chain_: Sequence[int]) -> int:
        """How many leading blocks of `chain_` are cached there: up to the first missing
        one, as vLLM's lookup walks (a block may outlive its parent there)."""
        # Placing one request asks this several times (each candidate's cost, the affinity
        # term, the long cap): the last answer stands while no block came or went.
        memo = self._memo
        if memo is not None and memo[0] is chain_ and memo[1] == self._version:
            return memo[2]
        held = self._held
        run = len(chain_)
        for k, block in enumerate(chain_):
            if block not in held:
                run = k
                break
        self._memo = (chain_, self._version, run)
        return run

    def match_pending(self, chain_: Sequence[int]) -> int:
        """How many leading blocks of `chain_` a request placed there and not yet prefilled
        will have computed (each pending chain is whole, so they form a leading run)."""
        pending = self._pending_blocks
        lo, hi = 0, len(chain_)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if chain_[mid - 1] in pending:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def hold(self, ticket_id: int, chain_: tuple[int, ...], now: float) -> None:
        """A ticket with this chain was placed there: its blocks are pending."""
        if chain_ and ticket_id not in self._pending:
            owed = self.match(chain_) < len(chain_)  # it will store blocks
            self._pending[ticket_id] = _Pending(chain_, now, owed)
            self._pending_blocks.update(chain_)

    def release(self, ticket_id: int) -> None:
        """It ended, or the batch after its first token came: its blocks are not pending."""
        self._computed.discard(ticket_id)
        pending = self._pending.pop(ticket_id, None)
        if pending is not None:
            blocks = self._pending_blocks
            blocks.subtract(pending.chain)
            for block in pending.chain:
                if blocks[block] <= 0:
                    del blocks[block]


@dataclass(frozen=True, slots=True)
class _Pending:
    chain: tuple[int, ...]
    placed_at: float
    owed: bool  # it held blocks the cache did not: computing them publishes an event
