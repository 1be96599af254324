"""Joining a stage and leaving it: choosing the stage, getting its current state, handing over.

A replica never serves before it holds the stage's current state: it downloads parameters, optimizer
state and step from a live replica, or restores its checkpoint; a stage starts from its
initialisation only at step 0 (or when told to), never silently in the middle of a run. Leaving
refuses new work, lets work in flight and any averaging round finish, then tells the DHT.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import TYPE_CHECKING, Optional

from hivemind.utils import get_logger

from swarm.policy.rebalance import choose_stage_for_new_peer, settle_join_choice
from swarm.records import to_peer_infos

if TYPE_CHECKING:
    from swarm.server.peer import StagePeer

__all__ = ["Joining"]

logger = get_logger(__name__)


class Joining:
    def __init__(self, peer: "StagePeer"):
        self.peer = peer

    async def choose_stage(self) -> int:
        peer = self.peer
        if peer.config.stage != "auto":
            return int(peer.config.stage)
        snapshot = to_peer_infos(await peer.fetch_records(), peer.run.num_stages)
        stage = choose_stage_for_new_peer(snapshot, peer.run.num_stages)
        return await self._settle_auto_stage(stage)

    async def _settle_auto_stage(self, stage: int) -> int:
        """Announce the automatic choice as 'joining', let peers that chose at the same moment
        announce theirs, and give way (see :func:`settle_join_choice`) if one of them got there first."""
        peer = self.peer
        peer.stage, peer.state = stage, "joining"
        await peer.announcer.announce()
        await asyncio.sleep(random.uniform(0.5, 1.5))
        snapshot = to_peer_infos(await peer.fetch_records(), peer.run.num_stages)
        settled = settle_join_choice(snapshot, peer.peer_id, stage, peer.run.num_stages)
        if settled != stage:
            logger.info(f"another peer is joining stage {stage} at the same time; joining stage {settled} instead")
        return settled

    async def join_stage(self) -> None:
        """Get the stage's current state before serving: from live replicas if there are any, else from
        this peer's checkpoint, else (only at step 0, or with ``reinitialize``) from its initialisation."""
        peer = self.peer
        records = await peer.fetch_records()
        others = [r for r in records.values() if r.stage == peer.stage and r.state == "online" and r.peer_id != peer.peer_id]
        if others:
            if not await self.download_state():
                raise RuntimeError(f"could not download stage {peer.stage} state from any of {len(others)} replicas")
        elif not await peer.checkpoints.restore():
            run_step = max((r.step for r in records.values()), default=0)
            if run_step > 0 and not peer.config.reinitialize:
                raise RuntimeError(
                    f"stage {peer.stage} has no live replica and no checkpoint in {peer.config.checkpoint_dir!r}, "
                    f"but the run is at step {run_step}: pass --checkpoint_dir with this stage's checkpoint, or "
                    f"--reinitialize true to restart the stage from scratch")
        peer.averager.allow_state_sharing = True

    async def download_state(self, max_attempts: Optional[int] = None) -> bool:
        """Adopt a live replica's state; retried within ``state_download_timeout_s`` (and at most
        ``max_attempts`` times: a replica catching up gives up soon when nobody serves the state)."""
        peer = self.peer
        timeout = peer.config.state_download_timeout_s
        deadline, attempts = time.monotonic() + timeout, 0
        while time.monotonic() < deadline and (max_attempts is None or attempts < max_attempts):
            attempts += 1
            future = peer.averager.load_state_from_peers(wait=False, timeout=timeout)
            try:
                loaded = await asyncio.wait_for(future, timeout=timeout)
            except Exception as e:
                logger.warning(f"state download failed: {type(e).__name__}: {e}")
                loaded = None
            if loaded is not None:
                runner = peer.runner
                first_dropped = runner.frozen.step if runner.frozen is not None else runner.accum_step
                try:
                    await peer.compute(runner.load_state, *loaded)
                except ValueError as e:
                    # hivemind's state stream can end early without an error (a short tensor list);
                    # load_state checks every tensor before touching anything, so just try again
                    logger.warning(f"downloaded state rejected, retrying: {e}")
                    await asyncio.sleep(1.0)
                    continue
                if peer.steps is not None:
                    peer.steps.skipped(first_dropped, runner.step)
                logger.info(f"stage {peer.stage}: downloaded state at step {runner.step}")
                return True
            await asyncio.sleep(1.0)
        return False

    async def leave_stage(self) -> None:
        """Refuse new work, let work in flight and any averaging round finish, then announce 'leaving'."""
        peer = self.peer
        peer.state = "leaving"
        peer.stage_done.set()
        deadline = time.monotonic() + peer.config.leave_timeout_s
        while peer.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if peer.coordinator_task is not None:
            try:  # the coordinator stops between averaging rounds, never in the middle of one
                await asyncio.wait_for(peer.coordinator_task, timeout=max(0.1, deadline - time.monotonic()))
            except (asyncio.TimeoutError, asyncio.CancelledError, Exception):
                peer.coordinator_task.cancel()
        await peer.announcer.announce()
