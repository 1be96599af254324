"""What the peer's mechanisms read of it, as small ``Protocol`` pieces each mechanism composes.

Every mechanism of a stage peer (handlers, announcer, steps, joining, checkpoints, standby, rebalancing)
names, next to its own code, the protocol of exactly what it uses; the pieces here are the ones several
share. :class:`swarm.server.peer.StagePeer` provides them all, and mypy checks each mechanism against its
own protocol, so a mechanism that starts to reach for more of the peer says so in its signature. The parts
of the stage served (runner, averager, step coordinator) are None until the peer takes up a stage; a
mechanism that runs only after that reads them through :func:`served`.
"""

from __future__ import annotations

import asyncio
from typing import Dict, Optional, Protocol, TypeVar

from swarm.config.settings import PeerConfig, RunConfig
from swarm.dht.records import PeerRecord
from swarm.server.compute import ComputeThread
from swarm.server.lifecycle import PeerState
from swarm.server.runner import StageRunner

__all__ = ["Settings", "CurrentStage", "Loops", "Records", "served"]

_Part = TypeVar("_Part")


class Settings(Protocol):
    """Who the peer is and the settings it runs with."""

    config: PeerConfig
    run: RunConfig

    @property
    def peer_id(self) -> str: ...


class CurrentStage(Protocol):
    """The stage the peer serves now (None before it chose one) and the runner computing it."""

    stage: Optional[int]
    runner: Optional[StageRunner]
    compute: ComputeThread


def served(part: Optional[_Part], name: str) -> _Part:
    """``part`` of the stage the peer serves (its runner, averager, step coordinator, batcher, the stage's index),
    which is None until the peer takes up a stage. The mechanisms that run only once it serves one read such a
    part through here: the type then says it is there, and a call made before fails saying why."""
    if part is None:
        raise RuntimeError(f"the peer has no {name} yet: it is not serving a stage")
    return part


class Loops(Protocol):
    """The lifecycle as a loop sees it: the state, the event to stop on, the shared wait."""

    @property
    def state(self) -> PeerState: ...

    @property
    def stopping(self) -> asyncio.Event: ...

    async def sleep_or_progress(self, waker: Optional[str], period_s: float, min_period_s: float) -> None: ...


class Records(Protocol):
    """The run's peer records as the peer reads them."""

    async def fetch_records(
        self,
        ask: bool = False,
        fresh: bool = False,
        every_stage: bool = False,
        tell: bool = False,
        ask_clock: bool = False,
    ) -> Dict[str, PeerRecord]: ...
