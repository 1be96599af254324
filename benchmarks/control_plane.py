"""Control-plane benchmark: the bytes a stage peer, a trainer and the bootstrap spend on coordination, live and modelled.

Live (``--layouts``, needs root): a whole swarm at the default periods (announce 60 s, expiration 180 s,
poll 0.25 s near a step, trainer refresh 60 s), every role on its own host of ``peers/netns.py``
(198.18.0.0/15, one bridge), counted at each host's link, so libp2p's framing, Noise, yamux and TCP are
in (``benchmarks/_control_hosts.py``). Each layout ``STAGESxREPLICAS+TRAINERS`` is measured in two windows:
idle (every peer online, no trainer yet: all its link carries is control traffic) and training (the
trainers train; control bytes = the bytes of the host's connections other than direct channels, less the
all-reduce's bytes that the peer's averager counted, with TCP framing). 64 live nodes and 16 trainers do not fit this machine's memory (about 300 MB
a role); ``8x4+8`` is the largest 8-stage layout measured here.

Simulated: :mod:`swarm.simulate.dht_traffic` at the default periods (the run's records and lookups; p2pd's
own traffic, most of an idle live link, is not in it), plus progress calls (:class:`ProgressModel`: one exchange's bytes from the encoded
messages, calls only near each step), at 1,000 and 10,000 peers and 8 and 64 stages.

Emulated (``--peers``, off by default): N DHT nodes in this one process storing and polling as a peer
does, bytes per DHT operation (serialized messages, no framing), as the earlier versions measured.

Also measured: the CPU a node spends checking one lookup answer that holds a full shard, with hivemind's
validators alone and once the node remembers records it accepted (:mod:`swarm.dht.validator_cache`).

Last line: a JSON list of ``{"stages", "peers", "trainers", "phase", "bytes_per_s_per_peer_in_plus_out",
"bytes_per_s_per_peer_max", "bytes_per_s_per_trainer", "bootstrap_bytes_per_s", "source"}`` rows (``source``
"live" or "simulated"; emulated rows have their own keys).
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import math
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
from swarm.dht.directory import PROBE_PERIOD_S, Directory, probe_period_for  # noqa: E402
from swarm.dht.identity import Identity, load_or_create_identity  # noqa: E402
from swarm.policy.directory import SHARD_CAPACITY  # noqa: E402
from swarm.net.addresses import MAX_MADDR_CHARS, MAX_MADDRS  # noqa: E402
from swarm.dht.records import MAX_COUNT, MAX_EXCLUDED, MAX_ID_LENGTH, PeerRecord, run_schema_validator  # noqa: E402
from swarm.simulate.dht_traffic import (  # noqa: E402
    ProgressModel, TrafficModel, per_peer_bytes_per_s, progress_bytes_per_s,
    trainer_bytes_per_s,
)
from swarm.config.settings import PeerConfig, TrainerConfig  # noqa: E402
from swarm.model.gpt import ModelConfig  # noqa: E402
from swarm.model.stages import stage_skeleton  # noqa: E402
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
            # its own stage every poll, the others once an announce period
            succeeded = await directory.read(sorted({stage, *directory.stages_due(announce_s)}), timeout=timeout)
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


def _exchange_bytes() -> float:
    """One progress call on the wire: the encoded request and reply (each a record's progress fields, counts at
    their largest, no stage-mate banned), a direct frame's header, method name and tag each, and the TCP/IP
    headers of the two segments and an acknowledgement (52 bytes each, with timestamps)."""
    from swarm.net.direct import FRAME_HEADER, REPLY_HEADER, TAG_BYTES
    from swarm.net.wire import encode
    from swarm.server.progress import PROGRESS_METHOD, progress_of

    identity = load_or_create_identity(None)
    message = encode({"record": progress_of(_record(identity, 0).model_copy(update={"excluded": ""}))})
    request = FRAME_HEADER.size + len(PROGRESS_METHOD) + len(message) + TAG_BYTES
    reply = REPLY_HEADER.size + len(message) + TAG_BYTES
    return float(request + reply + 3 * 52)


def _largest_stage_bytes(config: ModelConfig, num_stages: int) -> int:
    """The float32 parameters of the run's largest stage: what one replica sends in an all-reduce."""
    return max(4 * sum(p.numel() for p in stage_skeleton(config, index, num_stages).parameters())
               for index in range(num_stages))


def live_layouts(args) -> List[dict]:
    """The ``--layouts`` live, each in network namespaces, counted at the links (see ``_control_hosts``)."""
    from _control_hosts import Layout, measure_layout  # needs root: imported only when asked for

    rows = []
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    for text in args.layouts.split(","):
        layout = Layout.parse(text)
        config = ModelConfig(num_layers=max(2, layout.stages), hidden_size=32, num_heads=2, seq_len=16)
        model = [f"--{name}={getattr(config, name)}" for name in ("num_layers", "hidden_size", "num_heads", "seq_len")]
        param_bytes = _largest_stage_bytes(config, layout.stages)
        for row in measure_layout(layout, model, args.window_s, log_dir, args.target_batch_size, param_bytes):
            print(f"live {layout.stages}x{layout.replicas}+{row['trainers']} {row['phase']:>8}: "
                  f"{row['bytes_per_s_per_peer_in_plus_out']:>8.0f} B/s control per peer (max "
                  f"{row['bytes_per_s_per_peer_max']:.0f}; link {row['link_bytes_per_s_per_peer']:.0f}, data plane "
                  f"{row['data_plane_bytes_per_s_per_peer']:.0f}), trainer {row['bytes_per_s_per_trainer']}, bootstrap "
                  f"{row['bootstrap_bytes_per_s']:.0f} B/s, {row['global_steps']:.0f} steps in {row['window_s']} s",
                  flush=True)
            rows.append(row)
    return rows


def _trainer_bytes_per_s(dht: TrafficModel, num_peers: int) -> float:
    """A trainer at the default settings: ``stages_per_refresh`` stages a refresh, probes as the trainer sets them."""
    period, per_refresh = TrainerConfig.refresh_period_s, TrainerConfig.stages_per_refresh
    cycle_s = period * math.ceil(dht.num_stages / per_refresh)
    return trainer_bytes_per_s(dht, num_peers, period, 400.0, per_refresh, probe_period_for(cycle_s))


def simulated_rows(args) -> List[dict]:
    """1,000 and 10,000 peers at 8 and 64 stages, from the DHT model at the live default periods and the
    progress-call model. The model is not fitted to the live rows: at the new periods most of an idle link's
    bytes are not the run's records (p2pd's own traffic), which the model does not describe."""
    identity = load_or_create_identity(None)
    record_bytes = stored_record_bytes(identity, RSASignatureValidator(identity.private_key), 0)
    period = args.announce_period_s
    rows = []
    for num_stages in (int(x) for x in args.model_stages.split(",")):
        dht = TrafficModel(record_bytes=record_bytes, num_stages=num_stages, announce_period_s=period,
                           read_period_s=period, probe_period_s=probe_period_for(period), stages_read=2)
        progress = ProgressModel(exchange_bytes=_exchange_bytes(), step_s=args.model_step_s)
        for num_peers in (int(x) for x in args.model_peers.split(",")):
            calls = progress_bytes_per_s(progress, num_peers, num_stages)
            base = per_peer_bytes_per_s(dht, num_peers)["total"]
            trainers = max(1, num_peers // 4)
            rows.append({
                "stages": num_stages, "peers": num_peers, "trainers": trainers, "phase": "training",
                "bytes_per_s_per_peer_in_plus_out": round(base + calls["peer"], 1),
                "bytes_per_s_per_peer_max": round(base + calls["clock_peer"], 1),
                "bytes_per_s_per_trainer": round(_trainer_bytes_per_s(dht, num_peers), 1),
                "bootstrap_bytes_per_s": round(base, 1),
                "dht_overhead": round(dht.overhead, 3), "source": "simulated",
            })
            print(f"model {num_stages:>2} stages {num_peers:>6} peers: {rows[-1]['bytes_per_s_per_peer_in_plus_out']:>8.0f} "
                  f"B/s per peer ({base:.0f} DHT + {calls['peer']:.0f} progress; a clock replica "
                  f"{rows[-1]['bytes_per_s_per_peer_max']:.0f}), trainer {rows[-1]['bytes_per_s_per_trainer']:.0f} B/s",
                  flush=True)
    return rows


def emulated(args) -> List[dict]:
    """The in-process emulation of ``--peers`` DHT nodes (bytes per DHT operation, without libp2p's framing)."""
    _count_rpc_bytes()
    rows = []
    for num_peers in (int(x) for x in args.peers.split(",") if x):
        row = asyncio.run(live(num_peers, args.stages, args))
        row.pop("_lookup_ms")
        row["source"] = "emulated"
        print(f"emulated {num_peers:>6} peers: {row['dht_bytes_per_s_per_peer']:>10.0f} B/s per peer ({row['bytes_per_store']} B "
              f"a store, {row['bytes_per_poll']} B a poll), lookup p50 {row['lookup_ms_p50']} ms, periods x{row['stretch']:g}",
              flush=True)
        rows.append(row)
    return rows


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="2x8+2,8x4+8",
                        help="live layouts, STAGESxREPLICAS+TRAINERS, each in network namespaces (needs root); '' = none")
    parser.add_argument("--window_s", type=float, default=120.0, help="seconds each live window is counted over")
    parser.add_argument("--target_batch_size", type=int, default=16384,
                        help="the live runs' global batch: about half a minute a step on 2 cores, and less than one "
                             "trainer holds unconfirmed (4,096 micro-batches of 8), else its steps never close")
    parser.add_argument("--log_dir", default="runs/control_plane", help="where the live roles' logs go")
    parser.add_argument("--model_peers", default="1000,10000", help="comma list of modelled swarm sizes")
    parser.add_argument("--model_stages", default="8,64", help="comma list of modelled stage counts")
    parser.add_argument("--model_step_s", type=float, default=60.0, help="seconds a modelled global step takes")
    parser.add_argument("--announce_period_s", type=float, default=PeerConfig.announce_period_s,
                        help="the announce period the model assumes (the live roles run at their defaults)")
    parser.add_argument("--peers", default="", help="comma list of in-process emulated swarm sizes ('' = none)")
    parser.add_argument("--stages", type=int, default=2, help="stages of the emulated run")
    parser.add_argument("--read_period_s", type=float, default=30.0, help="emulated: how often a peer reads its stage")
    parser.add_argument("--warmup_s", type=float, default=8.0, help="emulated: seconds before measuring")
    parser.add_argument("--measure_s", type=float, default=8.0, help="emulated: seconds measured per size")
    parser.add_argument("--nodes_per_core_s", type=float, default=8.0, help="emulated: nodes kept at the live periods")
    parser.add_argument("--pollers", type=int, default=8, help="emulated: nodes that also poll")
    parser.add_argument("--concurrent_probes", type=int, default=2, help="emulated: probes run at once")
    add_record_arguments(parser)
    args = parser.parse_args(argv)
    checking = checking_ms_per_shard(2)
    print(f"checking a lookup answer of a full shard ({SHARD_CAPACITY} records): {checking['checked']} ms of CPU with "
          f"hivemind's validators, {checking['remembered']} ms once the node remembers them", flush=True)
    rows = live_layouts(args) if args.layouts else []
    if args.model_peers:
        rows += simulated_rows(args)
    rows += emulated(args)
    raw = {f"control_per_peer[{r['stages']}x{r['peers'] // r['stages']}+{r['trainers']} {r['phase']}]":
           r.pop("_control_per_peer") for r in rows if "_control_per_peer" in r}
    keys = ("stages", "peers", "trainers", "phase", "bytes_per_s_per_peer_in_plus_out", "bytes_per_s_per_peer_max",
            "bytes_per_s_per_trainer", "bootstrap_bytes_per_s", "source")
    write_record("control_plane", args, rows, raw=raw,
                 headline=[{k: r.get(k) for k in keys} for r in rows if r.get("source") != "emulated"],
                 notes=["live rows: every role in its own network namespace at the default periods; bytes counted at "
                        "its link (framing, Noise, yamux, TCP included). A training row's control bytes are those of "
                        "its connections other than direct channels (activations), less the all-reduce bytes its "
                        "averager counted (swarm_peer_allreduce_bytes, with TCP framing).",
                        "simulated rows: swarm/simulate/dht_traffic at the default periods (the run's records and "
                        "lookups, not p2pd's own traffic), plus progress calls near each step (model_step_s per step).",
                        f"check_ms_per_shard_answer: {checking}",
                        "Raw values: the control bytes per second of every peer in each live window."])
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
