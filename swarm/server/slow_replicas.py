"""Whether this replica stands by: the decision of :func:`swarm.policy.slow_replicas.standby_verdict`,
taken on the run's DHT records and said in the peer's log, one line each time it changes; and the
speed that decision (and every trainer's routing) starts from.

A replica times itself on made-up samples when it takes up a stage, again whenever its meter has
had no served call for so long that its figure went stale, and every ``RETIME_S`` while it stands
by (it gets no served call to correct a figure that a busy moment made too slow): it announces a
speed without trainers timing it on their micro-batches, which on a replica 50x slower than its
stage-mates would hold their slots for 50x a normal call.

A replica standing by stays online: it averages with its stage-mates and serves its state, and
trainers, which route by the same rule (:func:`swarm.policy.slow_replicas.worth_waiting_for`), send it
no work while its stage-mates are faster by more than the tolerance. Runs as a task of the peer's
event loop.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Protocol

from hivemind.utils import get_logger

from swarm.policy.slow_replicas import SLOW_TOLERANCE, StandbyVerdict, standby_verdict
from swarm.dht.records import to_peer_infos

from swarm.server.host import CurrentStage, Loops, Records, Settings, served
from swarm.server.lifecycle import PeerState

__all__ = ["StandbyWatch", "StandbyHost", "CHECK_PERIOD_S"]

logger = get_logger(__name__)
CHECK_PERIOD_S = 5.0  # seconds between two decisions (records carry throughputs measured over seconds)
READ_TIMEOUT_S = 10.0  # seconds one read of the run's records may take
RETIME_S = 30.0  # seconds between two speed tests of a replica standing by


class StandbyHost(Settings, CurrentStage, Loops, Records, Protocol):
    """What the standby decision reads of the peer: its stage, its runner's speed and the run's records."""


class StandbyWatch:
    """Decides every ``CHECK_PERIOD_S`` whether ``peer`` stands by; ``standing_by`` and ``verdict`` hold the last decision."""

    def __init__(self, peer: StandbyHost, tolerance: float = SLOW_TOLERANCE):
        self.peer, self.tolerance = peer, tolerance
        self.standing_by = False
        self.verdict: StandbyVerdict = StandbyVerdict(False, "not decided yet")
        self.timed_at = -math.inf  # when this replica last timed itself (monotonic clock)

    async def measure_speed(self) -> float:
        """Time the stage on ``speed_test_samples`` made-up samples in the compute thread (queued behind any
        served call); returns the samples/s the peer then announces (0.0 with the test off)."""
        peer = self.peer
        samples = peer.config.speed_test_samples
        if not samples or peer.runner is None:
            return 0.0
        try:
            speed = await peer.compute.run(peer.runner.measure_speed, samples)
        except Exception as e:  # served calls will measure it; trainers meanwhile time it themselves
            logger.warning(f"stage {peer.stage}: the speed test failed ({type(e).__name__}: {e}); announcing no speed")
            return 0.0
        finally:
            self.timed_at = time.monotonic()
        logger.info(f"stage {peer.stage}: timed at {speed:.1f} samples/s on {samples} made-up samples")
        return speed

    async def run(self) -> None:
        peer = self.peer
        while not peer.stopping.is_set():
            try:
                await asyncio.sleep(CHECK_PERIOD_S)
                if peer.state == PeerState.ONLINE and peer.runner is not None and self.retime_due():
                    await self.measure_speed()
                if peer.state == PeerState.ONLINE:
                    records = await asyncio.wait_for(peer.fetch_records(), READ_TIMEOUT_S)
                    self.decide(to_peer_infos(records, peer.run.num_stages))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a failed DHT read: keep the last decision, try again next period
                logger.info(f"standby check failed ({type(e).__name__}: {e}); keeping the last decision")

    def retime_due(self) -> bool:
        """Whether to time the replica again: its figure went stale (no served call for the meter's
        ``stale_s``), or it stands by and last timed itself ``RETIME_S`` ago."""
        stale = served(self.peer.runner, "runner").meter.samples_per_s <= 0
        return stale or (self.standing_by and time.monotonic() - self.timed_at >= RETIME_S)

    def decide(self, snapshot) -> StandbyVerdict:
        """Take the decision on ``snapshot``; log one line when it changes."""
        verdict = standby_verdict(self.peer.peer_id, snapshot, self.tolerance, self.standing_by)
        if verdict.standby != self.standing_by:
            if verdict.standby:
                logger.warning(verdict.reason)
            else:
                logger.info(f"resuming work: {verdict.reason}")
        self.standing_by, self.verdict = verdict.standby, verdict
        return verdict
