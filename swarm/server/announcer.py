"""What a stage peer announces in the DHT, and how often.

The record (:class:`PeerRecord`) is re-stored every announce period (tens of seconds by default) with an
expiration of a few periods, so a peer that dies disappears on its own, and at once when the peer's
state changes (it joins a stage, goes online, leaves). What changes with every backward pass (pending
samples, the step reached) does not make a peer store its record again: stage-mates exchange it by
direct progress calls (:mod:`swarm.server.progress`), and trainers learn what they route by from the
replies they get. Every store costs the DHT nodes that keep the record as much as it costs the peer.
"""

from __future__ import annotations

from typing import List, Optional, Protocol

from swarm import PROTOCOL_VERSION
from swarm.dht.directory import Directory
from swarm.dht.records import PeerRecord
from swarm.server.host import CurrentStage, Loops, Settings, served
from swarm.server.lifecycle import PeerState
from swarm.server.steps import StepCoordinator

__all__ = ["Announcer", "AnnouncerHost"]


class AnnouncerHost(Settings, CurrentStage, Loops, Protocol):
    """What the announcer reads of the peer: who it is, where it is reached, and the figures its record carries."""

    run_hash: str
    maddrs: List[str]
    steps: Optional[StepCoordinator]
    directory: Optional[Directory]

    @property
    def queued(self) -> int: ...


class Announcer:
    """Stores the peer's record in the DHT: every announce period, and when the peer's state changes."""

    def __init__(self, peer: AnnouncerHost):
        self.peer = peer
        self.stores = 0  # records stored (each at every level its stage is read at)

    def record(self) -> PeerRecord:
        peer, runner, steps = self.peer, self.peer.runner, self.peer.steps
        base, bits = steps.contributed if steps is not None else (0, 0)
        step, digest = runner.version if runner else (0, "")
        state = PeerState(peer.state)
        if state is PeerState.STOPPED:
            raise ValueError(f"peer {peer.peer_id} is stopped: it has no record to announce")
        return PeerRecord(
            version=PROTOCOL_VERSION,
            peer_id=peer.peer_id,
            stage=served(peer.stage, "stage"),
            state=state.value,
            throughput=runner.meter.samples_per_s if runner else 0.0,
            queue_length=peer.queued,
            step=step,
            accum_step=runner.accum_step if runner else 0,
            samples_pending=runner.samples_pending if runner else 0,
            samples_frozen=runner.frozen.samples if runner is not None and runner.frozen is not None else 0,
            samples_admitted=steps.admitted if steps is not None else 0,
            samples_applied=runner.samples_applied if runner else 0,
            digest=digest,
            samples_processed=runner.samples_processed if runner else 0,
            contributed_base=base,
            contributed_bits=bits,
            tentative_bits=steps.tentative_bits() if steps is not None else 0,
            resets=runner.resets if runner else 0,
            reset_from=runner.reset_from if runner else 0,
            run_hash=peer.run_hash,
            excluded=",".join(steps.excluded()) if steps is not None else "",
            maddrs=",".join(peer.maddrs),
        )

    async def announce(self) -> bool:
        """Store the record; returns whether every store succeeded."""
        peer, record = self.peer, self.record()
        if peer.directory is None:
            raise RuntimeError("the peer has not started: it has no directory to announce in")
        self.stores += 1
        return await peer.directory.store(record, peer.config.expiration_s)

    async def run(self) -> None:
        """Announce every announce period."""
        peer = self.peer
        while not peer.stopping.is_set():
            await self.announce()
            await peer.sleep_or_progress(None, peer.config.announce_period_s, 0.0)
