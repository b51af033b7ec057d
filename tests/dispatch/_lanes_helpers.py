"""What the lane-split tests share: the learned prefill rate of a speed-1 card."""

from __future__ import annotations

FAST = 20_000.0  # learned prefill tokens/s of a speed-1 card
