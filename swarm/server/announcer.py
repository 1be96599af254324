"""What a stage peer announces in the DHT, and how often.

The record (:class:`PeerRecord`) is re-stored every announce period with an expiration, so a peer
that dies disappears on its own; while its stage nears a global step it is looked at every
``FAST_PERIOD_S`` (and at once when gradients arrive) and stored whenever it changed, so that
replicas see each other's progress in time to close steps on target. A record that did not change
is not stored again before the announce period is up: a replica that gets no work (standing by) or
waits for its stage-mates would otherwise store the same record 20 times a second, and every store
costs the DHT nodes that keep it as much as it costs the replica.
"""

from __future__ import annotations

import math
import time
from typing import List, Optional, Protocol

from swarm import PROTOCOL_VERSION
from swarm.dht.directory import Directory
from swarm.dht.records import PeerRecord
from swarm.server.host import CurrentStage, Loops, Settings, served
from swarm.server.lifecycle import PeerState
from swarm.server.steps import FAST_PERIOD_S, StepCoordinator

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
    """Stores the peer's record in the DHT: every announce period, and as it changes while a step is near."""

    def __init__(self, peer: AnnouncerHost):
        self.peer = peer
        self.last: Optional[PeerRecord] = None  # the last record stored (every store of it succeeded)
        self.last_at = -math.inf  # when, on the monotonic clock

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

    async def announce(self, only_if_changed: bool = False) -> bool:
        """Store the record; with ``only_if_changed``, only if it differs from the last one stored or the
        announce period has passed since. Returns whether it stored (and every store succeeded)."""
        peer, record = self.peer, self.record()
        if only_if_changed and record == self.last and time.monotonic() - self.last_at < peer.config.announce_period_s:
            return False
        if peer.directory is None:
            raise RuntimeError("the peer has not started: it has no directory to announce in")
        stored = await peer.directory.store(record, peer.config.expiration_s)
        if stored:
            self.last, self.last_at = record, time.monotonic()
        return stored

    async def run(self) -> None:
        """Announce every announce period; while the stage nears its global batch, every ``FAST_PERIOD_S``
        that the record changed."""
        peer = self.peer
        while not peer.stopping.is_set():
            near = peer.steps is not None and peer.steps.near_target()
            await self.announce(only_if_changed=near)
            if near:
                await peer.sleep_or_progress("announce", FAST_PERIOD_S, FAST_PERIOD_S)
            else:  # far from a step: no need to tell anyone about every backward pass
                await peer.sleep_or_progress(None, peer.config.announce_period_s, 0.0)
