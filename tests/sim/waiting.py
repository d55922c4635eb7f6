"""Waiting for a condition instead of sleeping a fixed time.

A fixed ``trio.sleep(1)`` "to let things settle" hides what a test depends on and
is either too short (flaky) or too long (slow). :func:`wait_until` names the
condition; on trio's virtual clock (the ``autojump_clock`` fixture) polling costs
no wall time, and a condition that never holds fails after ``timeout`` with the
condition in the message.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import trio


def describe(predicate: Callable[[], object]) -> str:
    """The predicate's source line (a lambda names its condition there), else its name."""
    try:
        return inspect.getsource(predicate).strip()
    except (OSError, TypeError):
        return getattr(predicate, "__qualname__", repr(predicate))


# The timeout is a parameter (not the caller's fail_after) because the error names it
# together with the condition.
async def wait_until(
    predicate: Callable[[], object],
    timeout: float = 10.0,  # noqa: ASYNC109
    *,
    interval: float = 0.05,
) -> None:
    """Poll ``predicate`` every ``interval`` seconds of trio's clock until it is true.

    Returns at once if it already holds. Raises :class:`trio.TooSlowError` naming the
    predicate when it still does not hold after ``timeout`` seconds.
    """
    if timeout < 0 or interval <= 0:
        raise ValueError("timeout must be >= 0 and interval > 0")
    deadline = trio.current_time() + timeout
    # Bounded in count as well as in time: on a real clock each sleep lasts at least
    # ``interval``, on the virtual clock exactly that.
    for _ in range(math.ceil(timeout / interval) + 1):
        if predicate():
            return
        remaining = deadline - trio.current_time()
        if remaining <= 0:
            break
        await trio.sleep(min(interval, remaining))
    if predicate():
        return
    raise trio.TooSlowError(f"still false after {timeout} s: {describe(predicate)}")
