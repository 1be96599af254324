"""The peer's one compute thread, and the count of the work that waits for it or is being served.

All torch work of a stage peer runs on one thread, so that requests queue instead of competing for cores.
The counts are what the peer announces (``queue_length``) and what its leave waits on (``in_flight``);
they change only through the context managers here, so a request that fails or is cancelled midway never
leaves a count behind.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

__all__ = ["ComputeThread"]

T = TypeVar("T")


class ComputeThread:
    """Runs functions on the peer's single compute thread; counts queued and in-flight work."""

    def __init__(self) -> None:
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-compute")
        self.queued = 0  # requests waiting for the compute thread
        self.in_flight = 0  # forward/backward requests being served
        self._idle = asyncio.Event()
        self._idle.set()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the compute thread (torch work never runs on the event loop)."""
        with self.queue():
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    @contextmanager
    def queue(self) -> Iterator[None]:
        """Count one request as waiting for the compute thread while the block runs."""
        self.queued += 1
        try:
            yield
        finally:
            self.queued -= 1

    @contextmanager
    def serving(self) -> Iterator[None]:
        """Count one forward or backward request as in flight while the block runs."""
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight, at most ``timeout`` seconds; whether none is."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        return self.in_flight == 0

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
