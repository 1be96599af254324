"""Waiting for a condition instead of sleeping for a guessed time.

A test that sleeps "long enough" is slow where the condition comes true at once and wrong where the machine
is loaded and it comes true later. Polling the condition itself, with a bound, makes a test as fast as the
system under test allows, and a loaded machine only slows it down: it fails only once the bound is spent,
with a message that says what it waited for.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Awaitable, Callable, TypeVar, Union, cast

__all__ = ["wait_until", "await_until", "DEFAULT_PERIOD_S"]

T = TypeVar("T")
DEFAULT_PERIOD_S = 0.05  # seconds between polls: short next to any bound a test waits for, cheap to evaluate


def _check_bounds(timeout: float, period: float) -> None:
    if not timeout > 0 or not period > 0:
        raise ValueError(f"need timeout > 0 and period > 0 (seconds), got timeout={timeout}, period={period}")


def wait_until(predicate: Callable[[], T], timeout: float, what: str = "the condition",
               period: float = DEFAULT_PERIOD_S) -> T:
    """Call ``predicate`` every ``period`` seconds until it returns something truthy, and return that.

    Raises :class:`TimeoutError` naming ``what`` once ``timeout`` seconds passed; the predicate is always
    called at least once, and once more at the deadline, so that a condition true by then is not missed."""
    _check_bounds(timeout, period)
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}; last value: {result!r}")
        time.sleep(min(period, left))


async def await_until(predicate: Callable[[], Union[T, Awaitable[T]]], timeout: float, what: str = "the condition",
                      period: float = DEFAULT_PERIOD_S) -> T:
    """:func:`wait_until` for a test's event loop: it sleeps with ``asyncio.sleep``, so that the loop's other
    tasks (the code under test) run between polls. ``predicate`` may be a plain function or return an
    awaitable (a coroutine function, such as a DHT read)."""
    _check_bounds(timeout, period)
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        result = cast(T, await value if inspect.isawaitable(value) else value)
        if result:
            return result
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}; last value: {result!r}")
        await asyncio.sleep(min(period, left))
