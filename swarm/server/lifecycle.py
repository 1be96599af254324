"""Where a stage peer is in its life, as an explicit state machine, and the waits its loops share.

A peer is ``joining`` a stage (building it, downloading its state), ``online`` (serving it), ``leaving`` it
(to move to another stage, or to leave the run) and finally ``stopped``. :meth:`Lifecycle.to` allows only
the moves below and raises on any other, so a mechanism cannot put the peer in a state it cannot be in::

    joining -> online | leaving | stopped
    online  -> leaving | stopped
    leaving -> joining (it moves to another stage) | stopped
    stopped -> (nothing)

The peer's loops (announcing, stepping, checkpoints, rebalancing, standby) all wait the same way: a period,
cut short when gradients arrive (:meth:`notify_progress`) or when the peer stops or leaves its stage.
"""

from __future__ import annotations

import asyncio
import time
from enum import Enum
from typing import Dict, FrozenSet, Optional

__all__ = ["PeerState", "Lifecycle", "IllegalTransition"]


class PeerState(str, Enum):
    """A peer's state; its value is what its record announces."""

    JOINING = "joining"
    ONLINE = "online"
    LEAVING = "leaving"
    STOPPED = "stopped"

    def __str__(self) -> str:
        return self.value


_MOVES: Dict[PeerState, FrozenSet[PeerState]] = {
    PeerState.JOINING: frozenset({PeerState.ONLINE, PeerState.LEAVING, PeerState.STOPPED}),
    PeerState.ONLINE: frozenset({PeerState.LEAVING, PeerState.STOPPED}),
    PeerState.LEAVING: frozenset({PeerState.JOINING, PeerState.STOPPED}),
    PeerState.STOPPED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A move the state machine does not allow (a bug in the caller, never a network event)."""


class Lifecycle:
    """A peer's state, the events its loops stop on, and the wait they share."""

    WAKERS = ("coordinate",)  # loops that progress (gradients accumulated, a stage-mate's record) wakes early

    def __init__(self) -> None:
        self._state = PeerState.JOINING
        self.stopping = asyncio.Event()  # the peer is leaving the run
        self.stage_done = asyncio.Event()  # the peer is leaving its current stage (to move, or to leave)
        self._progress = {waker: asyncio.Event() for waker in self.WAKERS}

    @property
    def state(self) -> PeerState:
        return self._state

    @property
    def online(self) -> bool:
        return self._state is PeerState.ONLINE

    def to(self, state: PeerState) -> None:
        """Move to ``state``; :class:`IllegalTransition` if the machine does not allow it. Staying put is allowed."""
        state = PeerState(state)
        if state is not self._state and state not in _MOVES[self._state]:
            raise IllegalTransition(f"a peer cannot go from {self._state.value} to {state.value}")
        if state is PeerState.JOINING and self._state is not PeerState.JOINING:
            self.stage_done = asyncio.Event()  # a new stage: its coordinator runs until this one is set
        if state in (PeerState.LEAVING, PeerState.STOPPED):
            self.stage_done.set()
        self._state = state

    def notify_progress(self) -> None:
        """Gradients arrived: wake the loops that wait for progress."""
        for event in self._progress.values():
            event.set()

    async def sleep_or_progress(self, waker: Optional[str], period_s: float, min_period_s: float) -> None:
        """Wait ``period_s``, or less (but at least ``min_period_s``) when gradients arrive; stop on leave.
        ``waker`` names the loop waiting ("coordinate") or None for one that progress does not wake;
        the coordinator also stops waiting when the peer leaves its stage."""
        started = time.monotonic()
        events = [self.stopping, self.stage_done] if waker == "coordinate" else [self.stopping]
        if waker is not None:
            self._progress[waker].clear()
            events.append(self._progress[waker])
        waiters = {asyncio.ensure_future(event.wait()) for event in events}
        try:
            await asyncio.wait(waiters, timeout=period_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
        remaining = min_period_s - (time.monotonic() - started)
        if remaining > 0 and not self.stopping.is_set():
            await asyncio.sleep(remaining)
