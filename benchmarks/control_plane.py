"""Control-plane benchmark: DHT traffic per peer, record sizes and lookup latency, live and modelled.

Live: N real hivemind ``DHTNode``s on loopback in this one process (each node still starts its own
``p2pd``: nodes cannot share one, a daemon holds a single libp2p identity), each with its own RSA key
and the run's validators (``RSASignatureValidator`` + the run schema), announcing a full
``PeerRecord`` under its owner subkey of its stage's key every ``--announce_period_s`` (as
``swarm/server/announcer.py``) and reading every stage's key in one traversal every
``--read_period_s`` (as ``swarm.dht_io.fetch_stage_records``). Bytes are counted at hivemind's protocol
layer: every DHT RPC's request and reply, serialized (``P2P.call_protobuf_handler``), so libp2p's
framing and encryption are not included. Per peer = 2 x (all bytes) / N / seconds: each byte leaves
one node and reaches another.

Simulated: :mod:`swarm.simulate.dht_traffic`, its per-byte overhead calibrated on the live figures,
at 1,000 and 10,000 peers; the largest message is a whole stage's value.

Last line: a JSON list of ``{"peers", "dht_bytes_per_s_per_peer", "max_record_bytes", "lookup_ms_p50",
"source"}`` rows, plus the largest stage value per row.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import List

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hivemind.dht.crypto import RSASignatureValidator  # noqa: E402
from hivemind.dht.node import DHTNode  # noqa: E402
from hivemind.dht.routing import DHTID  # noqa: E402
from hivemind.dht.validation import CompositeValidator, DHTRecord  # noqa: E402
from hivemind.p2p import P2P  # noqa: E402
from hivemind.utils import MSGPackSerializer, get_dht_time  # noqa: E402

from swarm import PROTOCOL_VERSION  # noqa: E402
from swarm.identity import load_or_create_identity  # noqa: E402
from swarm.records import MAX_COUNT, PeerRecord, run_schema_validator, stage_key  # noqa: E402
from swarm.simulate.dht_traffic import (  # noqa: E402
    MESSAGE_CAP_BYTES, TrafficModel, calibrate, per_peer_bytes_per_s, stage_value_bytes,
)

RUN_ID = "cp_bench"
_BYTES = {"total": 0, "max_message": 0}


def _count_rpc_bytes() -> None:
    """Count the serialized bytes of every protobuf RPC this process makes (requests and replies)."""
    original = P2P.call_protobuf_handler

    async def counted(self, peer_id, name, input, output_type):
        reply = await original(self, peer_id, name, input, output_type)
        sent, received = input.ByteSize(), reply.ByteSize()
        _BYTES["total"] += sent + received
        _BYTES["max_message"] = max(_BYTES["max_message"], sent, received)
        return reply

    P2P.call_protobuf_handler = counted


def _record(identity, stage: int) -> PeerRecord:
    """A record as large as a live peer's can be: every count at its bound, full digest, two addresses."""
    maddr = f"/ip4/203.0.113.77/tcp/31337/p2p/{identity.peer_id}"
    return PeerRecord(version=PROTOCOL_VERSION, peer_id=identity.peer_id, stage=stage, state="online",
                      throughput=123456.789, queue_length=MAX_COUNT, step=MAX_COUNT, accum_step=MAX_COUNT,
                      samples_pending=MAX_COUNT, samples_frozen=MAX_COUNT, samples_admitted=MAX_COUNT,
                      samples_applied=MAX_COUNT, digest="f" * 64, samples_processed=MAX_COUNT,
                      contributed_base=MAX_COUNT, contributed_bits=2**64 - 1, run_hash="h" * 16,
                      maddrs=",".join([maddr, maddr.replace("203.0.113.77", "198.51.100.9")]))


def stored_record_bytes(identity, validator, stage: int) -> int:
    """Bytes a node stores for one record: msgpack value with its signature, plus the owner subkey."""
    record = DHTRecord(key=DHTID.generate(source=stage_key(RUN_ID, stage)).to_bytes(),
                       subkey=DHTID.generate(source=identity.owner_subkey).to_bytes(),
                       value=MSGPackSerializer.dumps(_record(identity, stage).model_dump(mode="json")),
                       expiration_time=get_dht_time() + 6.0)
    return len(validator.sign_value(record)) + len(identity.owner_subkey)


async def _announce(node: DHTNode, identity, stage: int, period_s: float, stop: float) -> None:
    value = _record(identity, stage).model_dump(mode="json")
    while time.monotonic() < stop:
        await node.store(stage_key(RUN_ID, stage), value, get_dht_time() + 6.0, subkey=identity.owner_subkey)
        await asyncio.sleep(period_s)


async def _read(node: DHTNode, keys: List[str], period_s: float, stop: float, latencies: List[float]) -> None:
    while time.monotonic() < stop:
        started = time.perf_counter()
        try:
            await asyncio.wait_for(node.get_many(keys, sufficient_expiration_time=float("inf")), 10.0)
        except asyncio.TimeoutError:
            _BYTES["failed_lookups"] = _BYTES.get("failed_lookups", 0) + 1  # counted at the timeout's latency
        latencies.append(1000 * (time.perf_counter() - started))
        await asyncio.sleep(period_s)


async def live(num_peers: int, num_stages: int, args) -> dict:
    nodes, identities, validators = [], [], []
    try:
        for index in range(num_peers):
            identity = load_or_create_identity(None)
            validator = CompositeValidator([RSASignatureValidator(identity.private_key),
                                            run_schema_validator(RUN_ID, num_stages)])
            initial = await nodes[0].get_visible_maddrs() if nodes else None
            nodes.append(await DHTNode.create(initial_peers=initial, record_validator=validator,
                                              host_maddrs=["/ip4/127.0.0.1/tcp/0"], cache_locally=False))
            identities.append(identity)
            validators.append(validator)
        keys = [stage_key(RUN_ID, s) for s in range(num_stages)]
        warm = time.monotonic() + args.warmup_s
        await asyncio.gather(*(_announce(n, i, k % num_stages, args.announce_period_s, warm)
                               for k, (n, i) in enumerate(zip(nodes, identities))))
        before, latencies = _BYTES["total"], []
        started = time.monotonic()
        stop = started + args.measure_s
        await asyncio.gather(
            *(_announce(n, i, k % num_stages, args.announce_period_s, stop) for k, (n, i) in enumerate(zip(nodes, identities))),
            *(_read(n, keys, args.read_period_s, stop, latencies) for n in nodes))
        elapsed = time.monotonic() - started
        total = _BYTES["total"] - before
        record_bytes = max(stored_record_bytes(i, v, k % num_stages) for k, (i, v) in enumerate(zip(identities, validators)))
        reads_per_s = len(latencies) / elapsed / num_peers
        return {"peers": num_peers, "dht_bytes_per_s_per_peer": round(2 * total / num_peers / elapsed, 1),
                "max_record_bytes": record_bytes, "lookup_ms_p50": round(statistics.median(latencies), 2),
                "max_message_bytes": _BYTES["max_message"],
                "failed_lookups": _BYTES.get("failed_lookups", 0), "reads_per_s_per_peer": round(reads_per_s, 2),
                "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1), "source": "live"}
    finally:
        for node in nodes:
            await node.shutdown()


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", default="16,64", help="comma list of live swarm sizes")
    parser.add_argument("--stages", type=int, default=8, help="stages (one DHT key each)")
    parser.add_argument("--announce_period_s", type=float, default=1.0, help="live announce period")
    parser.add_argument("--read_period_s", type=float, default=0.25, help="live poll period: every stage read")
    parser.add_argument("--warmup_s", type=float, default=5.0, help="announcing before measuring")
    parser.add_argument("--measure_s", type=float, default=20.0, help="seconds measured per size")
    parser.add_argument("--model_peers", default="1000,10000", help="comma list of modelled swarm sizes")
    args = parser.parse_args(argv)
    _count_rpc_bytes()
    rows = []
    for num_peers in (int(x) for x in args.peers.split(",")):
        row = asyncio.run(live(num_peers, args.stages, args))
        print(f"live {num_peers:>6} peers: {row['dht_bytes_per_s_per_peer']:>12.0f} B/s per peer, record "
              f"{row['max_record_bytes']} B, lookup p50 {row['lookup_ms_p50']} ms, largest message "
              f"{row['max_message_bytes']} B, {row['reads_per_s_per_peer']} reads/s per peer (target "
              f"{1 / args.read_period_s:g}), max RSS {row['max_rss_mib']} MiB", flush=True)
        rows.append(row)
    record_bytes = max(r["max_record_bytes"] for r in rows)
    # calibrate on the read rate the live nodes achieved (2 cores may not keep up with the nominal period)
    achieved_read_period = statistics.mean(1.0 / r["reads_per_s_per_peer"] for r in rows)
    model = calibrate(TrafficModel(record_bytes=record_bytes, num_stages=args.stages,
                                   announce_period_s=args.announce_period_s, read_period_s=achieved_read_period),
                      [(r["peers"], r["dht_bytes_per_s_per_peer"]) for r in rows])
    print(f"model calibrated: {model.overhead:.3f} wire bytes per value byte, hop {model.hop_bytes:.0f} B, "
          f"read period {achieved_read_period:.3f} s as achieved live")
    nominal = dataclasses.replace(model, read_period_s=args.read_period_s)
    for row in rows:
        row["stage_value_bytes"] = stage_value_bytes(model, row["peers"])
        row["model_bytes_per_s_per_peer"] = round(per_peer_bytes_per_s(model, row["peers"])["total"], 1)
    for num_peers in (int(x) for x in args.model_peers.split(",")):
        largest = stage_value_bytes(nominal, num_peers)
        rows.append({"peers": num_peers,
                     "dht_bytes_per_s_per_peer": round(per_peer_bytes_per_s(nominal, num_peers)["total"], 1),
                     "max_record_bytes": record_bytes, "lookup_ms_p50": None, "stage_value_bytes": largest,
                     "stage_value_over_cap": round(largest / MESSAGE_CAP_BYTES, 3), "source": "simulated"})
        print(f"model {num_peers:>6} peers: {rows[-1]['dht_bytes_per_s_per_peer']:>12.0f} B/s per peer at the "
              f"live read period; one stage's value {largest:.0f} B ({100 * largest / MESSAGE_CAP_BYTES:.1f}% of "
              f"the 4 MiB message cap)")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
