"""The test process's own view of a swarm: reads DHT records and calls peers directly."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Dict, List, Sequence

from hivemind import DHT
from hivemind.p2p import PeerID

from swarm.dht_io import fetch_records
from swarm.records import PeerRecord, peers_key
from swarm.rpc import call_peer


class Probe:
    def __init__(self, initial_peers: Sequence[str], run_id: str):
        self.run_id = run_id
        self.dht = DHT(initial_peers=list(initial_peers), host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
        self._p2p = None

    async def records(self) -> Dict[str, PeerRecord]:
        return await fetch_records(self.dht, peers_key(self.run_id), PeerRecord)

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
        summary = [(r.peer_id[-6:], r.stage, r.state, f"step={r.step}", f"accum={r.accum_step}", f"pending={r.samples_pending}",
                    f"frozen={r.samples_frozen}", f"applied={r.samples_applied}") for r in records.values()]
        raise TimeoutError(f"timed out after {timeout}s waiting for {what}; records: {summary}")

    def shutdown(self) -> None:
        if self.dht.is_alive():
            self.dht.shutdown()


def online(records: Dict[str, PeerRecord], stage: int) -> List[PeerRecord]:
    return [r for r in records.values() if r.stage == stage and r.state == "online"]
