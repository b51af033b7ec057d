"""The pure dispatch core: decides, never waits.

No asyncio, aiohttp, time, random (beyond the `random.Random` type passed in),
structlog or prometheus here; `tests/dispatch/test_purity.py` enforces it.
"""

from .model import (
    Assigned,
    Decision,
    HealthPolicy,
    InstanceSpec,
    InstanceState,
    Lane,
    Limits,
    LoadReport,
    LocalShare,
    Outcome,
    PeerLoad,
    Queued,
    Rejected,
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
from .scheduler import Scheduler, UnknownTicket
from .select import STRATEGIES, Score, score_all
from .speed import PeerSpeed

__all__ = [
    "STATUS_VERDICTS",
    "STRATEGIES",
    "Assigned",
    "Decision",
    "GiveUp",
    "HealthPolicy",
    "InstanceSpec",
    "InstanceState",
    "Lane",
    "Limits",
    "LoadReport",
    "LocalShare",
    "Outcome",
    "PeerLoad",
    "PeerSpeed",
    "Queued",
    "Rejected",
    "RetryAfter",
    "RetryBudget",
    "Scheduler",
    "Score",
    "SharedView",
    "Ticket",
    "UnknownTicket",
    "Verdict",
    "judge_status",
    "plan_retry",
    "reason_for_status",
    "score_all",
]
