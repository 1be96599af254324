"""A small thread pool for CPU work on large payloads (encoding, decoding, sealing), shared by the whole
process, so that one large message does not stall the event loop that serves every other request."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, TypeVar

__all__ = ["OFF_LOOP_BYTES", "run_sized"]

OFF_LOOP_BYTES = 256 * 2**10  # work on payloads above this runs on the pool's threads
THREADS = 2

T = TypeVar("T")
_pool: Optional[ThreadPoolExecutor] = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    """Created on first use."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="swarm-codec")
        return _pool


async def run_sized(size: int, fn: Callable[..., T], *args) -> T:
    """``fn(*args)``: here for a payload of at most :data:`OFF_LOOP_BYTES`, on the pool for a larger one."""
    if size <= OFF_LOOP_BYTES:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(_executor(), fn, *args)
