"""The test process's own view of a swarm: reads DHT records and calls peers directly."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from hivemind.p2p import PeerID

from swarm.dht.auth import authorizer_for
from swarm.config.settings import NetworkConfig
from swarm.dht.node import start_dht
from swarm.dht.directory import Directory
from swarm.dht.identity import Identity
from swarm.dht.records import PeerRecord
from swarm.net.rpc import call_peer


class Probe:
    """A DHT node of the run (with the run's record validators and its own identity) that reads
    records and calls peers; it can also announce records of its own, as a lying peer would."""

    def __init__(self, initial_peers: Sequence[str], run_id: str, num_stages: int = 2,
                 identity: Optional[Identity] = None, allowlist: Sequence[str] = (),
                 host_maddrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",)):
        self.run_id, self.num_stages = run_id, num_stages
        network = NetworkConfig(initial_peers=list(initial_peers), host_maddrs=list(host_maddrs))
        authorizer = None if identity is None else authorizer_for(allowlist, identity)
        self.dht = start_dht(network, run_id=run_id, num_stages=num_stages, identity=identity, authorizer=authorizer)
        self._p2p = None
        self._directory = Directory(self.dht, run_id, num_stages, home=self.peer_id, rotate=-1)

    @property
    def peer_id(self) -> str:
        return str(self.dht.peer_id)

    async def records(self) -> Dict[str, PeerRecord]:
        await self._directory.read()
        return self._directory.records()

    async def call(self, peer_id: str, method: str, message: Dict[str, Any], timeout: float = 30.0,
                   stream: bool = False) -> Dict[str, Any]:
        if self._p2p is None:
            self._p2p = await self.dht.replicate_p2p()
        return await call_peer(self._p2p, PeerID.from_base58(peer_id), method, message, timeout=timeout, stream=stream)

    async def wait_for(self, predicate: Callable[[Dict[str, PeerRecord]], bool], timeout: float,
                       what: str = "condition") -> Dict[str, PeerRecord]:
        deadline = time.monotonic() + timeout
        records: Dict[str, PeerRecord] = {}
        while time.monotonic() < deadline:
            records = await self.records()
            if predicate(records):
                return records
            await asyncio.sleep(0.3)
        summary = [(r.peer_id[-6:], r.stage, r.state, f"step={r.step}", f"accum={r.accum_step}",
                    f"pending={r.samples_pending}", f"frozen={r.samples_frozen}", f"applied={r.samples_applied}")
                   for r in records.values()]
        raise TimeoutError(f"timed out after {timeout}s waiting for {what}; records: {summary}")

    def shutdown(self) -> None:
        if self.dht.is_alive():
            self.dht.shutdown()


def online(records: Dict[str, PeerRecord], stage: int) -> List[PeerRecord]:
    return [r for r in records.values() if r.stage == stage and r.state == "online"]
