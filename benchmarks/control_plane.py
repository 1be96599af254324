"""Control-plane benchmark: DHT traffic per peer, record sizes, largest message and lookup latency, live and modelled.

Live: N real hivemind ``DHTNode``s on loopback in this one process (each node still starts its own
``p2pd``: a daemon holds a single libp2p identity), each with its own RSA key and the run's
validators (``RSASignatureValidator`` + the run schema), each acting as a stage peer does: it keeps a
:class:`swarm.dht.directory.Directory` and stores a full-size ``PeerRecord`` through it every announce
period. ``--pollers`` of them (spread over the stages) also poll it every poll period (their own
stage every poll, the other stages every announce period, probes when due): a hivemind lookup costs
its reader 0.1-0.5 s of CPU, so one process cannot poll for hundreds of nodes, and the traffic per
poll is what one poller measures. The others probe their stage whenever a live peer's poll would
(``--concurrent_probes`` at a time), so that they store at the levels a live peer of that stage
would. Every node stores once before anyone reads. On 2 cores N nodes cannot keep the live periods,
so all periods are stretched by ``max(1, N / --nodes_per_core_s)`` alike (the mix of reads, stores
and probes stays that of a live peer), and bytes are measured *per operation*: every DHT RPC's
request and reply, serialized (``P2P.call_protobuf_handler``, so libp2p's framing and encryption are
left out), is charged to the store or poll that made it. Per-peer traffic at the live periods =
2 x (bytes per store / announce period + bytes per poll / poll period): each byte leaves one node
and reaches another. Each poller's view is reported as the share of the swarm's records it holds at
the end (``view_share_min``, the smallest).

Simulated: :mod:`swarm.simulate.dht_traffic`, its per-byte overhead calibrated on the live figures,
at 1,000 and 10,000 peers; the largest message there is one shard's value.

Also measured: the CPU a node spends checking one lookup answer that holds a full shard, with hivemind's
validators alone and once the node remembers records it accepted (:mod:`swarm.dht.validator_cache`).

Last line: a JSON list of ``{"peers", "dht_bytes_per_s_per_peer", "max_record_bytes", "lookup_ms_p50",
"source"}`` rows, with the largest message, the directory level and ``check_ms_per_shard_answer`` per row.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import random
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hivemind.dht.crypto import RSASignatureValidator  # noqa: E402
from hivemind.dht.node import DHTNode  # noqa: E402
from hivemind.dht.routing import DHTID  # noqa: E402
from hivemind.dht.validation import CompositeValidator, DHTRecord  # noqa: E402
from hivemind.p2p import P2P  # noqa: E402
from hivemind.utils import MSGPackSerializer  # noqa: E402

from _records import add_record_arguments, write_record  # noqa: E402
from swarm import PROTOCOL_VERSION  # noqa: E402
from swarm.dht.directory import PROBE_PERIOD_S, Directory  # noqa: E402
from swarm.dht.identity import Identity, load_or_create_identity  # noqa: E402
from swarm.policy.directory import SHARD_CAPACITY, level_for  # noqa: E402
from swarm.net.addresses import MAX_MADDR_CHARS, MAX_MADDRS  # noqa: E402
from swarm.dht.records import MAX_COUNT, MAX_EXCLUDED, MAX_ID_LENGTH, PeerRecord, run_schema_validator  # noqa: E402
from swarm.simulate.dht_traffic import (  # noqa: E402
    MESSAGE_CAP_BYTES, TrafficModel, calibrate, per_peer_bytes_per_s, shard_value_bytes,
)
from swarm.dht.validator_cache import RememberingValidator  # noqa: E402

RUN_ID = "cp_bench"
LOOKUP_TIMEOUT_S = 5.0  # a live peer's (Directory.read's and .store's default)
_OPERATION: contextvars.ContextVar = contextvars.ContextVar("operation", default="other")
_BYTES: Dict[str, int] = {}
_LARGEST = {"message": 0}


def _count_rpc_bytes() -> None:
    """Charge the serialized bytes of every protobuf RPC this process makes to the operation that made it."""
    original = P2P.call_protobuf_handler

    async def counted(self, peer_id, name, input, output_type):
        reply = await original(self, peer_id, name, input, output_type)
        sent, received = input.ByteSize(), reply.ByteSize()
        operation = _OPERATION.get()
        _BYTES[operation] = _BYTES.get(operation, 0) + sent + received
        _LARGEST["message"] = max(_LARGEST["message"], sent, received)
        return reply

    P2P.call_protobuf_handler = counted


def _record(identity: Identity, stage: int) -> PeerRecord:
    """A record as large as a live peer's can be: every field at its bound, addresses and exclusions full."""
    maddr = f"/ip6/{'f' * 39}/tcp/65535/p2p/{identity.peer_id}"[:MAX_MADDR_CHARS]
    return PeerRecord(version=PROTOCOL_VERSION, peer_id=identity.peer_id, stage=stage, state="online",
                      throughput=123456.789, queue_length=MAX_COUNT, step=MAX_COUNT, accum_step=MAX_COUNT,
                      samples_pending=MAX_COUNT, samples_frozen=MAX_COUNT, samples_admitted=MAX_COUNT,
                      samples_applied=MAX_COUNT, digest="f" * 64, samples_processed=MAX_COUNT,
                      contributed_base=MAX_COUNT, contributed_bits=2**64 - 1, tentative_bits=2**64 - 1,
                      resets=MAX_COUNT, reset_from=MAX_COUNT, run_hash="h" * 16,
                      excluded=",".join(["x" * MAX_ID_LENGTH] * MAX_EXCLUDED), maddrs=",".join([maddr] * MAX_MADDRS))


def stored_record_bytes(identity: Identity, validator, stage: int) -> int:
    """Bytes a node stores for one record: msgpack value with its signature, plus the owner subkey."""
    record = DHTRecord(key=DHTID.generate(source=f"{RUN_ID}_stage{stage}").to_bytes(),
                       subkey=MSGPackSerializer.dumps(identity.owner_subkey),
                       value=MSGPackSerializer.dumps(_record(identity, stage).model_dump(mode="json")),
                       expiration_time=1e10)
    return len(validator.sign_value(record)) + len(identity.owner_subkey)


def checking_ms_per_shard(num_stages: int, repeats: int = 20) -> Dict[str, float]:
    """CPU milliseconds a node spends checking one lookup answer that holds a full shard (``SHARD_CAPACITY``
    full-size signed records): with hivemind's validators alone (what every answer cost before nodes remembered
    accepted records), and with :class:`RememberingValidator` once it has seen those records (an answer
    that repeats what the node read a moment ago, as most answers near a step do)."""
    owners = [load_or_create_identity(None) for _ in range(SHARD_CAPACITY)]
    answer = []
    for owner in owners:
        signer = CompositeValidator([RSASignatureValidator(owner.private_key), run_schema_validator(RUN_ID, num_stages)])
        record = DHTRecord(key=DHTID.generate(source=f"{RUN_ID}_stage0").to_bytes(),
                           subkey=MSGPackSerializer.dumps(owner.owner_subkey),
                           value=MSGPackSerializer.dumps(_record(owner, 0).model_dump(mode="json")), expiration_time=1e10)
        answer.append(DHTRecord(record.key, record.subkey, signer.sign_value(record), record.expiration_time))
    reader = load_or_create_identity(None)
    checks = {"checked": [RSASignatureValidator(reader.private_key), run_schema_validator(RUN_ID, num_stages)]}
    checks["remembered"] = [RememberingValidator(checks["checked"])]
    result = {}
    for name, validators in checks.items():
        validator = CompositeValidator(validators)
        if not all(validator.validate(record) for record in answer):  # also what makes them remembered
            raise RuntimeError("the benchmark's own records do not validate")
        started = time.process_time()
        for _ in range(repeats):
            for record in answer:
                validator.validate(record)
        result[name] = round(1000 * (time.process_time() - started) / repeats, 3)
    return result


class _NodeAsDHT:
    """The two calls a Directory makes on a ``hivemind.DHT`` (``store``, ``run_coroutine``), on a DHTNode in
    this process."""

    def __init__(self, node: DHTNode, identity: Identity):
        self.node, self.identity = node, identity

    def store(self, key, value, expiration_time, subkey, return_future):
        return asyncio.ensure_future(self.node.store(key, value, expiration_time, subkey=subkey))

    def run_coroutine(self, fn, return_future):
        return asyncio.ensure_future(fn(self, self.node))


async def _participate(directory: Directory, identity: Identity, stage: int, stretch: float, args, stop: float,
                       counts: Dict[str, int], latencies: List[float], polls: bool,
                       probe_turns: asyncio.Semaphore) -> None:
    """A stage peer's control plane, two loops as in a live peer: store every announce period, and (``polls``)
    poll every poll period. A node that does not poll still probes its stage when a probe is due, as a live
    peer's polls would: what it stores where depends on the size it estimates (those reads are charged to
    "probe", outside the figures: a poller's polls already count its probes)."""
    announce_s, poll_s = args.announce_period_s * stretch, args.read_period_s * stretch
    timeout = LOOKUP_TIMEOUT_S * stretch  # a slower machine: the live timeout, stretched as the periods are

    async def announce() -> None:
        record = _record(identity, stage)
        _OPERATION.set("store")  # this task's own context
        await asyncio.sleep(random.uniform(0, announce_s))  # peers that started at different times
        while time.monotonic() < stop:
            await directory.store(record, expiration_s=6.0 * stretch, timeout=timeout)
            counts["store"] += 1
            await asyncio.sleep(announce_s)

    async def poll() -> None:
        _OPERATION.set("poll")
        await asyncio.sleep(random.uniform(0, poll_s))
        while time.monotonic() < stop:
            started = time.perf_counter()
            succeeded = await directory.read(directory.stages_due(stage, announce_s), timeout=timeout)
            latencies.append(1000 * (time.perf_counter() - started))
            counts["poll"] += 1
            counts["failed"] += not succeeded
            await asyncio.sleep(poll_s)

    async def probe() -> None:
        _OPERATION.set("probe")
        await asyncio.sleep(random.uniform(0, poll_s))
        while time.monotonic() < stop:
            if directory.probe_is_due(stage):
                async with probe_turns:  # live peers probe on their own cores; here the nodes take turns
                    await directory.read([stage], timeout=timeout)
            await asyncio.sleep(poll_s)

    await asyncio.gather(asyncio.create_task(announce()), asyncio.create_task(poll() if polls else probe()))


def _spread_pollers(num_peers: int, num_stages: int, count: int) -> set:
    """Indices of ``count`` nodes spread evenly over the swarm and over its stages (node ``i`` serves stage
    ``i % num_stages``): the first of every ``num_peers / count`` nodes, moved onto the next stage in turn."""
    step = max(1, num_peers // max(count, 1))
    chosen = set()
    for k, start in enumerate(range(0, num_peers, step)):
        index = start + (k - start) % num_stages  # the node of stage k % num_stages at or after start
        chosen.add(min(index, num_peers - 1))
    return chosen


async def live(num_peers: int, num_stages: int, args) -> dict:
    nodes: List[DHTNode] = []
    try:
        participants = []
        for index in range(num_peers):
            identity = load_or_create_identity(None)
            validator = RememberingValidator([RSASignatureValidator(identity.private_key),
                                              run_schema_validator(RUN_ID, num_stages)])  # as start_dht sets up
            initial = await nodes[0].get_visible_maddrs() if nodes else None
            nodes.append(await DHTNode.create(initial_peers=initial, record_validator=validator,
                                              host_maddrs=["/ip4/127.0.0.1/tcp/0"], cache_locally=False))
            participants.append((identity, validator, index % num_stages))
        stretch = max(1.0, num_peers / args.nodes_per_core_s)
        directories = [Directory(_NodeAsDHT(node, identity), RUN_ID, num_stages, home=identity.peer_id,
                                 probe_period_s=PROBE_PERIOD_S * stretch)
                       for node, (identity, _, _) in zip(nodes, participants)]
        warm_counts, measured_counts = {"store": 0, "poll": 0, "failed": 0}, {"store": 0, "poll": 0, "failed": 0}
        # every record stored once before anyone reads: first probes see the stage, not an empty one
        await asyncio.gather(*(d.store(_record(i, s), expiration_s=6.0 * stretch,
                                       timeout=LOOKUP_TIMEOUT_S * stretch)
                               for d, (i, _, s) in zip(directories, participants)))
        warm_stop = time.monotonic() + args.warmup_s * stretch
        pollers = _spread_pollers(num_peers, num_stages, args.pollers)
        probe_turns = asyncio.Semaphore(args.concurrent_probes)
        await asyncio.gather(*(_participate(d, i, s, stretch, args, warm_stop, warm_counts, [], k in pollers, probe_turns)
                               for k, (d, (i, _, s)) in enumerate(zip(directories, participants))))
        _BYTES.clear()
        _LARGEST["message"] = 0
        latencies: List[float] = []
        started = time.monotonic()
        stop = started + args.measure_s * stretch
        await asyncio.gather(*(_participate(d, i, s, stretch, args, stop, measured_counts, latencies, k in pollers,
                                                probe_turns)
                               for k, (d, (i, _, s)) in enumerate(zip(directories, participants))))
        elapsed = time.monotonic() - started
        per_store = _BYTES.get("store", 0) / max(measured_counts["store"], 1)
        per_poll = _BYTES.get("poll", 0) / max(measured_counts["poll"], 1)
        nominal = 2 * (per_store / args.announce_period_s + per_poll / args.read_period_s)
        levels = [d.levels() for d in directories]
        record_bytes = max(stored_record_bytes(i, v, s) for i, v, s in participants)
        seen_by = [len(directories[k].records()) for k in pollers]  # every node of the run stored a record
        seen, view_share_min = statistics.mean(seen_by), min(seen_by) / num_peers
        return {"peers": num_peers, "dht_bytes_per_s_per_peer": round(nominal, 1), "max_record_bytes": record_bytes,
                "lookup_ms_p50": round(statistics.median(latencies), 2), "max_message_bytes": _LARGEST["message"],
                "bytes_per_store": round(per_store), "bytes_per_poll": round(per_poll),
                "levels": sorted({level for row in levels for level in row}),
                "records_seen_per_peer": round(seen, 1), "view_share_min": round(view_share_min, 3), "stretch": stretch, "failed_polls": measured_counts["failed"],
                "polls": measured_counts["poll"],
                "pollers": len(pollers), "polls_per_s_per_poller": round(measured_counts["poll"] / elapsed / len(pollers), 3),
                "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1), "source": "live",
                "_lookup_ms": [round(x, 2) for x in latencies]}  # every lookup: for the record, not the last line
    finally:
        for node in nodes:
            await node.shutdown()


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", default="16,64,256", help="comma list of live swarm sizes")
    parser.add_argument("--stages", type=int, default=2, help="stages of the run (fewer stages: larger stages)")
    parser.add_argument("--announce_period_s", type=float, default=1.0, help="live announce period")
    parser.add_argument("--read_period_s", type=float, default=0.25,
                        help="how often a peer reads its own stage: the live poll period near a global step; "
                             "far from one the live peer reads every announce period")
    parser.add_argument("--warmup_s", type=float, default=8.0, help="seconds (before stretching) before measuring")
    parser.add_argument("--measure_s", type=float, default=8.0, help="seconds (before stretching) measured per size")
    parser.add_argument("--nodes_per_core_s", type=float, default=8.0,
                        help="nodes this machine keeps at the live periods; more stretch every period alike")
    parser.add_argument("--pollers", type=int, default=8,
                        help="nodes that also poll (every node stores): a lookup costs the reader's CPU ~0.1-0.5 s "
                             "in hivemind, so one process cannot poll for hundreds of nodes")
    parser.add_argument("--concurrent_probes", type=int, default=2,
                        help="probes the nodes that do not poll run at once (a probe of every level is the heaviest "
                             "lookup; dozens at once in one process time out, and a node that cannot probe stores "
                             "its record only where readers of a large stage do not look)")
    parser.add_argument("--model_peers", default="1000,10000", help="comma list of modelled swarm sizes")
    add_record_arguments(parser)
    args = parser.parse_args(argv)
    _count_rpc_bytes()
    checking = checking_ms_per_shard(args.stages)
    print(f"checking a lookup answer of a full shard ({SHARD_CAPACITY} records): {checking['checked']} ms of CPU with "
          f"hivemind's validators, {checking['remembered']} ms once the node remembers them", flush=True)
    rows = []
    for num_peers in (int(x) for x in args.peers.split(",")):
        row = asyncio.run(live(num_peers, args.stages, args))
        print(f"live {num_peers:>6} peers: {row['dht_bytes_per_s_per_peer']:>10.0f} B/s per peer ({row['bytes_per_store']} B "
              f"a store, {row['bytes_per_poll']} B a poll), directory levels {row['levels']}, record "
              f"{row['max_record_bytes']} B, largest message {row['max_message_bytes']} B, lookup p50 "
              f"{row['lookup_ms_p50']} ms with periods x{row['stretch']:g}, {row['records_seen_per_peer']} records "
              f"seen per poller ({row['pollers']} pollers, the least {100 * row['view_share_min']:.0f}% of the swarm), {row['failed_polls']} of {row['polls']} polls failed, max RSS {row['max_rss_mib']} MiB", flush=True)
        rows.append(row)
    lookups = {f"lookup_ms[{row['peers']} peers, live]": row.pop("_lookup_ms") for row in rows}
    record_bytes = max(r["max_record_bytes"] for r in rows)
    model = calibrate(TrafficModel(record_bytes=record_bytes, num_stages=args.stages,
                                   announce_period_s=args.announce_period_s, read_period_s=args.read_period_s),
                      [(r["peers"], r["dht_bytes_per_s_per_peer"]) for r in rows])
    print(f"model calibrated: {model.overhead:.3f} wire bytes per value byte, hop {model.hop_bytes:.0f} B")
    for row in rows:
        row["model_bytes_per_s_per_peer"] = round(per_peer_bytes_per_s(model, row["peers"])["total"], 1)
    for num_peers in (int(x) for x in args.model_peers.split(",")):
        largest = shard_value_bytes(model, num_peers)
        one_key = -(-num_peers // args.stages) * record_bytes  # the same stage under a single key
        rows.append({"peers": num_peers, "dht_bytes_per_s_per_peer": round(per_peer_bytes_per_s(model, num_peers)["total"], 1),
                     "max_record_bytes": record_bytes, "lookup_ms_p50": None, "max_message_bytes": largest,
                     "message_over_cap": round(largest / MESSAGE_CAP_BYTES, 4), "single_key_stage_bytes": one_key,
                     "levels": [level_for(num_peers / args.stages)], "source": "simulated"})
        print(f"model {num_peers:>6} peers: {rows[-1]['dht_bytes_per_s_per_peer']:>10.0f} B/s per peer; largest message "
              f"{largest:.0f} B ({100 * largest / MESSAGE_CAP_BYTES:.2f}% of the 4 MiB cap; one key per stage would "
              f"be {one_key / 2**20:.1f} MiB)")
    for row in rows:
        row["check_ms_per_shard_answer"] = checking
    write_record("control_plane", args, rows, raw=lookups,
                 headline=[{k: r.get(k) for k in ("peers", "source", "dht_bytes_per_s_per_peer", "max_record_bytes",
                                                  "max_message_bytes", "lookup_ms_p50", "view_share_min", "stretch")}
                           for r in rows],
                 notes=["live rows: real DHT nodes in one process, periods stretched alike where the cores cannot "
                        "keep the live ones (stretch); simulated rows: swarm/simulate/dht_traffic calibrated on the "
                        "live ones.",
                        "Raw values: the latency of every lookup the pollers made in the measured window."])
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
