"""When the OpenAI SDK would send a request again, and after how long.

A gateway that refuses a request (429 with `Retry-After`, or 503) counts on its client to
come back. Users reach the gateway through the OpenAI SDK, which does: `max_retries = 2`
by default (three attempts), on 408, 409, 429, any status of 500 and more, and connection
errors and timeouts. So a load generator that counts every refusal as lost measures a
client nobody runs, and one that drops the refused from its TTFT percentiles flatters the
gateway that refuses. With retries on, a request is timed from its first attempt: a
refusal's wait and the delay before the retry are in its TTFT and end-to-end latency.

This follows openai-python 3.57.0 (`_base_client.py`: `_should_retry`,
`_calculate_retry_timeout`, `_parse_retry_after_header`; `_constants.py`):
- `x-should-retry: true | false` from the server overrides the status;
- the delay is `retry-after-ms`, else `retry-after` (seconds), when it is above 0 and at
  most 120 s; a `Retry-After` above 120 s means no retry at all;
- otherwise 0.5 s x 2^n (n: retries already made), at most 8 s, less a random 0-25%.
`Retry-After` as an HTTP date is not read: the gateway sends seconds. The load generator's
own timeout (`Client`, 120 s for the whole request) is not the SDK's (600 s to read, 5 s
to connect), so a timeout would be retried at another moment than the SDK's.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping

SDK_MAX_RETRIES = 2  # openai-python's DEFAULT_MAX_RETRIES
INITIAL_DELAY = 0.5
MAX_DELAY = 8.0
MAX_RETRY_AFTER = 120.0
_INFINITY = ("inf", "+inf", "infinity", "+infinity")  # spelled out, not an overflow


def retry_after(headers: Mapping[str, str]) -> float | None:
    """The server's delay in seconds (`retry-after-ms` first), or None if it gave none.

    >>> retry_after({"retry-after": "2"}), retry_after({"retry-after-ms": "250"})
    (2.0, 0.25)
    """
    for name, divisor in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            delay = float(value)
        except ValueError:
            continue
        if delay == math.inf and value.strip().lower() not in _INFINITY:
            return MAX_RETRY_AFTER + 1  # an overflow is a long delay, as the SDK reads it
        return delay / divisor
    return None


def should_retry(status: int, headers: Mapping[str, str]) -> bool:
    """Whether the SDK sends again after this answer (status 0: no answer, a connection
    error or a timeout, which it always retries).

    >>> should_retry(429, {}), should_retry(400, {}), should_retry(503, {"x-should-retry": "false"})
    (True, False, False)
    """
    if status == 0:
        return True
    if status < 400:  # the SDK judges only error answers
        return False
    delay = retry_after(headers)
    if delay is not None and math.isfinite(delay) and delay > MAX_RETRY_AFTER:
        return False
    verdict = headers.get("x-should-retry")
    if verdict in ("true", "false"):
        return verdict == "true"
    return status in (408, 409, 429) or status >= 500


def delay(retries_made: int, headers: Mapping[str, str], rng: random.Random) -> float:
    """Seconds the SDK sleeps before its next attempt, `retries_made` retries in.

    >>> delay(0, {"retry-after": "1"}, random.Random(0))
    1.0
    >>> 0.375 <= delay(0, {}, random.Random(0)) <= 0.5
    True
    """
    server = retry_after(headers)
    if server is not None and math.isfinite(server) and 0 < server <= MAX_RETRY_AFTER:
        return server
    backoff = min(INITIAL_DELAY * 2.0 ** min(retries_made, 1000), MAX_DELAY)
    return max(0.0, backoff * (1 - 0.25 * rng.random()))
