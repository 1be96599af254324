"""Reads a run's records from the DHT every ``period_s`` and publishes the dashboard's state.

Runs as a coroutine in the dashboard process's asyncio loop; every DHT read and RPC is bounded in time. A
failed read keeps the last good records on the page and says so in ``poll.error``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Callable, Dict, Optional, Tuple

from hivemind import DHT
from hivemind.p2p import PeerID
from hivemind.utils import get_logger

from swarm.config.settings import RunConfig
from swarm.config.loading import config_from_dict
from swarm.dashboard.history import History
from swarm.dashboard.join import JoinInfo, majority_run_hash
from swarm.dashboard.server import StateBox
from swarm.dashboard.state import Sample, Snapshot, build_state, history_point
from swarm.dht.directory import Directory
from swarm.dht.store import fetch_records
from swarm.dht.manifest import ManifestError, fetch_manifest, peer_id_in_address, run_hash
from swarm.dht.records import AccusationRecord, PeerRecord, TrainerRecord, accusations_key, trainers_key
from swarm.net.rpc import call_peer

__all__ = ["DashboardPoller"]

logger = get_logger(__name__)
LOOKUP_TIMEOUT_S = 5.0  # seconds one DHT read or settings RPC may take
MANIFEST_RETRY_POLLS = 10  # polls between looks for a manifest published by one of the initial peers


class DashboardPoller:
    """Polls the DHT, keeps the history, and puts each new state into ``box``, with the latest text sampled
    from the run's model as ``sample()`` returns it (see :mod:`swarm.dashboard.sample`)."""

    def __init__(
        self,
        dht: DHT,
        join: JoinInfo,
        box: StateBox,
        history: History,
        period_s: float,
        sample: Callable[[], Optional[Sample]] = lambda: None,
    ):
        self.dht, self.join, self.box, self.history, self.period_s = dht, join, box, history, period_s
        self.sample = sample
        self.started = time.monotonic()
        self.snapshot = Snapshot(fetched_at=time.time())
        self.polls = 0
        self.directory: Optional[Directory] = None  # every stage read whole; made once the run's stages are known

    async def poll(self) -> Snapshot:
        """A fresh snapshot, or on a failed read the last one with the reason."""
        run_id, num_stages = self.join.run_id, self.join.num_stages
        try:
            if self.directory is None or self.directory.num_stages != num_stages:
                self.directory = Directory(self.dht, run_id, num_stages, home=str(self.dht.peer_id), rotate=-1)
            _, trainers, accusations = await asyncio.gather(
                self.directory.read(timeout=LOOKUP_TIMEOUT_S, strict=True),
                fetch_records(self.dht, trainers_key(run_id), TrainerRecord, timeout=LOOKUP_TIMEOUT_S, strict=True),
                fetch_records(
                    self.dht, accusations_key(run_id), AccusationRecord, timeout=LOOKUP_TIMEOUT_S, strict=True
                ),
            )
        except LookupError as e:
            return dataclasses.replace(self.snapshot, error=str(e))
        return Snapshot(self.directory.records(), trainers, accusations, fetched_at=time.time())

    async def learn_join(self, peers: Dict[str, PeerRecord]) -> None:
        """Find what the join command and the sampler need: the organiser's manifest among the initial peers
        (its address and its run settings), else the run's settings from one of its peers (those the majority
        of online peers announce)."""
        if self.join.manifest_address is not None:
            return
        if self.polls % MANIFEST_RETRY_POLLS == 0:
            found = await self._manifest_address()
            if found is not None:
                address, run = found
                self.join = dataclasses.replace(self.join, manifest_address=address, run=run or self.join.run)
                return
        if self.join.run is None:
            run = await self._majority_settings(peers)
            if run is not None:
                self.join = dataclasses.replace(self.join, run=run)

    async def _manifest_address(self) -> Optional[Tuple[str, Optional[RunConfig]]]:
        """The address of the initial peer that signs the run's manifest, with the manifest's settings (None
        when they name another number of stages than the one this dashboard reads)."""
        for address in self.join.initial_peers:
            try:
                organiser = peer_id_in_address(address)
                manifest = await fetch_manifest(self.dht, self.join.run_id, organiser, timeout=LOOKUP_TIMEOUT_S)
            except (ManifestError, asyncio.TimeoutError):
                continue
            except Exception as e:  # the DHT's own errors: try again on a later poll
                logger.debug(f"no manifest from {address}: {type(e).__name__}: {e}")
                continue
            if manifest.run.num_stages != self.join.num_stages:
                logger.warning(
                    f"the run's manifest has {manifest.run.num_stages} stages, this dashboard reads "
                    f"{self.join.num_stages}: restart it with --join {address}"
                )
                return address, None
            return address, manifest.run
        return None

    async def _majority_settings(self, peers: Dict[str, PeerRecord]) -> Optional[RunConfig]:
        expected = majority_run_hash(peers)
        candidates = [p for p in peers.values() if p.state == "online" and p.run_hash == expected]
        if expected is None or not candidates:
            return None
        p2p = await self.dht.replicate_p2p()
        for record in candidates[:3]:
            try:
                reply = await call_peer(
                    p2p, PeerID.from_base58(record.peer_id), "settings", {}, timeout=LOOKUP_TIMEOUT_S
                )
                run = config_from_dict(RunConfig, reply["run"], prefix="run.")
            except Exception as e:  # timeouts, dead peers (p2pd's own types), malformed answers (ConfigError, KeyError)
                logger.info(f"could not read the run settings of {record.peer_id}: {type(e).__name__}: {e}")
                continue
            # the settings must be those the majority announces: one peer cannot put its own in the command
            if run_hash(run) == expected and run.run_id == self.join.run_id and run.num_stages == self.join.num_stages:
                return run
            logger.info(f"ignoring the run settings of {record.peer_id}: they are not those the run's peers announce")
        return None

    def publish(self) -> None:
        uptime = time.monotonic() - self.started
        self.box.put(build_state(self.snapshot, self.history, self.join, uptime, self.sample()))

    async def step(self) -> None:
        """One poll: read the DHT, extend the history, learn how to join, publish."""
        self.snapshot = await self.poll()
        if self.snapshot.error is None:
            self.history.add(history_point(self.snapshot, self.join.num_stages, time.monotonic() - self.started))
            await self.learn_join(dict(self.snapshot.peers))
        self.polls += 1
        self.publish()

    async def run(self, stop: asyncio.Event) -> None:
        """Poll every ``period_s`` until ``stop`` is set."""
        while not stop.is_set():
            await self.step()
            try:
                await asyncio.wait_for(stop.wait(), self.period_s)
            except asyncio.TimeoutError:
                pass
