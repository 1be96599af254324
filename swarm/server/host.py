"""What the peer's mechanisms read of it, as small ``Protocol`` pieces each mechanism composes.

Every mechanism of a stage peer (handlers, announcer, steps, joining, checkpoints, standby, rebalancing)
names, next to its own code, the protocol of exactly what it uses; the pieces here are the ones several
share. :class:`swarm.server.peer.StagePeer` provides them all, and mypy checks each mechanism against its
own protocol, so a mechanism that starts to reach for more of the peer says so in its signature.
"""

from __future__ import annotations

import asyncio
from typing import Dict, Optional, Protocol

from swarm.config.settings import PeerConfig, RunConfig
from swarm.dht.records import PeerRecord
from swarm.server.compute import ComputeThread
from swarm.server.lifecycle import PeerState
from swarm.server.runner import StageRunner

__all__ = ["Settings", "CurrentStage", "Loops", "Records"]


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


class Loops(Protocol):
    """The lifecycle as a loop sees it: the state, the event to stop on, the shared wait."""

    @property
    def state(self) -> PeerState: ...

    @property
    def stopping(self) -> asyncio.Event: ...

    async def sleep_or_progress(self, waker: Optional[str], period_s: float, min_period_s: float) -> None: ...


class Records(Protocol):
    """The run's peer records as the peer reads them."""

    async def fetch_records(self) -> Dict[str, PeerRecord]: ...
