"""The pure dispatch core: decides, never waits.

No asyncio, aiohttp, time, random (beyond the `random.Random` type passed in),
structlog or prometheus here; `tests/dispatch/test_purity.py` enforces it.
"""

from .holding import UnknownTicket
from .model import (
    Assigned,
    Decision,
    HealthPolicy,
    Hop,
    InstanceSpec,
    InstanceState,
    Lane,
    Limits,
    LoadReport,
    LocalShare,
    Outcome,
    PeerLoad,
    Priority,
    Queued,
    Rejected,
    Role,
    SharedView,
    Ticket,
)
from .retry import (
    STATUS_VERDICTS,
    GiveUp,
    RetryAfter,
    RetryBudget,
    Verdict,
    judge_status,
    plan_retry,
    reason_for_status,
)
from .scheduler import Scheduler
from .select import Score, score_all
from .snapshot import InstanceSnapshot, Snapshot
from .speed import PeerSpeed
from .strategies import STRATEGIES

__all__ = [
    "STATUS_VERDICTS",
    "STRATEGIES",
    "Assigned",
    "Decision",
    "GiveUp",
    "HealthPolicy",
    "Hop",
    "InstanceSnapshot",
    "InstanceSpec",
    "InstanceState",
    "Lane",
    "Limits",
    "LoadReport",
    "LocalShare",
    "Outcome",
    "PeerLoad",
    "PeerSpeed",
    "Priority",
    "Queued",
    "Rejected",
    "RetryAfter",
    "RetryBudget",
    "Role",
    "Scheduler",
    "Score",
    "SharedView",
    "Snapshot",
    "Ticket",
    "UnknownTicket",
    "Verdict",
    "judge_status",
    "plan_retry",
    "reason_for_status",
    "score_all",
]
