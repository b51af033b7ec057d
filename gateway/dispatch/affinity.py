"""Affinity: how much of a prompt an instance probably holds in its prefix cache.

vLLM's automatic prefix caching keeps the KV blocks of recent prompts, keyed by a hash
chain (each block's hash covers the blocks before it), and skips the prefill of a new
prompt's leading blocks that it finds. The gateway cannot see an instance's cache, but it
knows what it sent there. So it keeps, per instance, a bounded index of the prompt blocks
it sent, evicted least-recently-used like the instance's own cache, and estimates a new
prompt's cached tokens there as the length of its leading run of blocks in the index.

The blocks are of the prompt *text* as the instance will see it (roles and contents of
chat messages, or the completion prompt), `BLOCK_BYTES` bytes each: about `BLOCK_TOKENS`
tokens at the gateway's 4 bytes a token. They need not line up with vLLM's 16-token
blocks: a shared text prefix is a shared token prefix, and the estimate is off by less
than a block. Hashes chain with running CRC-32 and Adler-32 (64 bits, the same in every
process, so replicas agree), at C speed: a 16k-token prompt is 250 blocks.

Within an index a prompt's blocks are touched deepest first, so a prompt's first block is
always its most recently used: eviction takes the tails of old prompts before their
heads, as vLLM frees a sequence's last blocks first, and the blocks present along any
chain are a leading run. That makes `match` a binary search.
"""

from __future__ import annotations

import array
import sys
import zlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

BYTES_PER_TOKEN = 4  # the gateway's estimate (tokens.py)
BLOCK_TOKENS = 64
BLOCK_BYTES = BLOCK_TOKENS * BYTES_PER_TOKEN
# A typical instance's KV cache holds a few hundred thousand tokens (an 8B model on one
# 80 GB card: about 450k; a 70B on four: about 300k). 8,192 blocks of 64 is 524k tokens.
DEFAULT_INDEX_BLOCKS = 8192


def prompt_blocks(text: bytes, block_bytes: int = BLOCK_BYTES) -> tuple[int, ...]:
    """The chained hash of every full block of `text`: block k's covers its first k+1 blocks."""
    view = memoryview(text)
    crc, adler = 0, 1
    out = []
    for start in range(0, len(view) - block_bytes + 1, block_bytes):
        chunk = view[start : start + block_bytes]
        crc = zlib.crc32(chunk, crc)
        adler = zlib.adler32(chunk, adler)
        out.append(crc << 32 | adler)
    return tuple(out)


def _content_bytes(content: Any, out: list[bytes]) -> None:
    if isinstance(content, str):
        out.append(content.encode("utf-8", "surrogatepass"))
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, Mapping):
                text = part.get("text")
                if isinstance(text, str):
                    out.append(text.encode("utf-8", "surrogatepass"))
                else:  # an image or audio part: its URL or data stands for it
                    out.append(repr(sorted(part.items(), key=lambda kv: str(kv[0]))).encode())


def prompt_text(payload: Mapping[str, Any]) -> bytes:
    """The prompt as the instance will see it, enough to compare prefixes (not to bill)."""
    messages = payload.get("messages")
    out: list[bytes] = []
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, Mapping):
                out.append(str(message.get("role", "")).encode() + b"\n")
                _content_bytes(message.get("content"), out)
                out.append(b"\n\n")
        return b"".join(out)
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return prompt.encode("utf-8", "surrogatepass")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        # Token ids: 4 bytes each, so a block is still BLOCK_TOKENS of them. Ids that are
        # not 32-bit ints (array "i" is a C int, 4 bytes) are the instance's to refuse;
        # they get no affinity, not a 500.
        try:
            ids = array.array("i", prompt)
        except (TypeError, OverflowError):
            return b""
        if sys.byteorder == "big":
            ids.byteswap()  # little-endian everywhere, so replicas agree
        return ids.tobytes()
    return b""


class PrefixIndex:
    """The prompt blocks recently sent to one instance, at most `capacity` of them (LRU).

    A block is *settled* once a request that carried it has had its first token there:
    only then is it surely in the instance's cache. Until then it still attracts requests
    of the same prefix (they would queue behind it and find it computed), but it does not
    make a long prompt cheap (`settled=True` in `match`).
    """

    def __init__(self, capacity: int = DEFAULT_INDEX_BLOCKS) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[int, bool] = OrderedDict()  # block -> settled

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, blocks: Sequence[int], *, settled: bool = False) -> int:
        """How many of `blocks`' leading blocks the index holds (binary search on the run);
        with `settled`, only blocks whose prefill is known to be done."""
        held = self._blocks
        lo, hi = 0, len(blocks)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            found = held.get(blocks[mid - 1])
            if found is not None and (found or not settled):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def insert(self, blocks: Sequence[int]) -> None:
        """A prompt was sent: its blocks become the most recent, its first block most of all."""
        if self.capacity <= 0:
            return
        held = self._blocks
        for block in reversed(blocks):
            held[block] = held.get(block, False)
            held.move_to_end(block)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def settle(self, blocks: Sequence[int]) -> None:
        """A request carrying `blocks` had its first token: they are computed there now."""
        held = self._blocks
        for block in blocks:
            if block in held:
                held[block] = True

    def resize(self, capacity: int) -> None:
        """Hold at most `capacity` blocks from now on (the least recent go first)."""
        self.capacity = max(0, capacity)
        held = self._blocks
        while len(held) > self.capacity:
            held.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()

    def __repr__(self) -> str:
        return f"<PrefixIndex {len(self._blocks)}/{self.capacity} blocks>"
