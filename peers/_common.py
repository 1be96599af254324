"""What every runnable role shares: logging, signal handling, a machine-readable ready line."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import warnings
from typing import Any, Dict


def setup_logging() -> None:
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    from hivemind.utils.logging import use_hivemind_log_handler

    use_hivemind_log_handler("in_root_logger")  # one format for hivemind's messages and ours
    logging.getLogger().setLevel(logging.INFO)


def emit(event: str, **fields: Any) -> None:
    """One JSON line on stdout, for launchers and tests that watch a role's progress."""
    print(json.dumps({"event": event, **fields}), flush=True)


def stop_event() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT, so a role can leave gracefully."""
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, event.set)
    return event


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return 1
