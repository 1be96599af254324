"""Random and mutated input for a live stage peer, shared by tests/test_fuzz.py and benchmarks/fuzz.py.

:class:`FuzzInputs` draws one :class:`FuzzCase` at a time (seeded): raw bytes, messages with
wrong types, tensors whose headers lie, NaN and inf, wrong stages, unknown methods, truncated
and oversized streams, plus well-formed control requests. Each case says what a correct peer
must answer. :func:`fuzz` sends cases at a fixed pace through the caller's own P2P and
classifies every answer; :func:`store_junk` writes junk values under a run's DHT keys.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import msgpack
import torch
from hivemind import DHT
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time

from swarm.net.rpc import KINDS, NAMESPACE, RPCServicer, _call_stream
from swarm.net.wire import WireError, decode, encode

__all__ = ["FuzzCase", "FuzzInputs", "FuzzStats", "fuzz", "store_junk", "random_bytes", "mutate", "tensor_lies",
           "rss_mb"]

CHUNK = 2 * 2**20  # the piece an oversized stream case is built of
MAX_REPLY_BYTES = 64 * 2**20  # a longer reply counts as a reset
MAX_FAILURE_NOTES = 50


def random_bytes(rng: random.Random, max_len: int) -> bytes:
    """Bytes of random length, often starting with a msgpack map header so that parsing gets somewhere."""
    body = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, max_len)))
    return (bytes([0x80 | rng.randint(0, 15)]) + body) if rng.random() < 0.5 else body


def mutate(rng: random.Random, payload: bytes) -> bytes:
    """``payload`` with a few bytes flipped, inserted, deleted or duplicated, or cut short."""
    data = bytearray(payload)
    for _ in range(rng.randint(1, 4)):
        op, at = rng.randrange(5), rng.randrange(max(1, len(data)))
        if op == 0 and data:
            data[at] ^= 1 << rng.randrange(8)
        elif op == 1:
            data[at:at] = bytes([rng.choice((0x00, 0xFF, 0xC1, 0xDD, 0xCF, 0x7F, rng.getrandbits(8)))])
        elif op == 2 and data:
            del data[at : at + rng.randint(1, 8)]
        elif op == 3:
            data[at:at] = data[at : at + rng.randint(1, 16)]
        else:
            del data[at:]
    return bytes(data)


def tensor_lies(rng: random.Random) -> List[Tuple[str, Dict[str, Any]]]:
    """Tensor headers that do not match their data, or name absurd shapes and unknown dtypes."""
    def lie(shape: Any, dtype: Any = "float32", data: Any = b"\x00" * 8) -> Dict[str, Any]:
        return {"__tensor__": True, "dtype": dtype, "shape": shape, "data": data}

    return [
        ("overflowing shape", lie([2**32, 2**32], data=b"")), ("huge shape", lie([2**62, 2**62])),
        ("huge dim", lie([2**40, 2**40])), ("uint64 dim", lie([2**64 - 1])), ("negative dim", lie([2, -1])),
        ("bool dim", lie([True, 2])), ("float dim", lie([2.0, 1.0])), ("nine dims", lie([1] * 9)),
        ("string shape", lie("2x2")), ("zero times huge", lie([0, 2**62], data=b"")),
        ("short data", lie([2, 4], data=b"\x00" * rng.randint(0, 31))),
        ("long data", lie([2], data=b"\x00" * rng.randint(9, 64))), ("data not bytes", lie([2], data="abcdefgh")),
        ("unknown dtype", lie([2], dtype=rng.choice(["float64", "complex64", "bool", "", "FLOAT32"]))),
        ("dtype not a string", lie([2], dtype=rng.choice([None, 7, ["float32"]]))),
        ("tag not true", {"__tensor__": 1, "dtype": "float32", "shape": [2], "data": b"\x00" * 8}),
    ]


@dataclass
class FuzzCase:
    """One request: ``chunks`` go as one unary call (a single chunk) or as a stream.

    ``expect`` is what a correct peer answers: 'error' (an error reply of a known kind),
    'ok' (a reply without error), 'any' (either), or 'error_or_reset' (an error reply, or a
    stream the peer stops reading: an abuser's stream over the peer's limit).
    """

    family: str
    stage: int  # the stage of the peer it goes to
    method: str
    chunks: List[bytes]
    stream: bool = False
    expect: str = "error"


@dataclass
class FuzzStats:
    """What :func:`fuzz` sent and what came back."""

    requests: int = 0
    outcomes: Counter = field(default_factory=Counter)  # error, ok, reset, timeout, garbled
    kinds: Counter = field(default_factory=Counter)  # error kinds of the error replies
    families: Counter = field(default_factory=Counter)
    unexpected: int = 0
    elapsed_s: float = 0.0  # from the first request sent to the last answer
    notes: List[str] = field(default_factory=list)  # the first unexpected outcomes, described

    @property
    def answered_with_error(self) -> int:
        return self.outcomes["error"]

    def summary(self) -> Dict[str, Any]:
        return {"requests": self.requests, "elapsed_s": round(self.elapsed_s, 1), "outcomes": dict(self.outcomes),
                "kinds": dict(self.kinds), "families": dict(self.families), "unexpected": self.unexpected}


class FuzzInputs:
    """Draws fuzz cases for a run of the tiny test model (token ids, hidden states of ``hidden_size``)."""

    def __init__(self, seed: int, *, num_stages: int = 2, hidden_size: int = 32, seq_len: int = 16,
                 vocab_size: int = 256, max_message_bytes: int = 2**20):
        self.rng = random.Random(seed)
        self.num_stages, self.hidden_size, self.seq_len = num_stages, hidden_size, seq_len
        self.vocab_size, self.max_message_bytes = vocab_size, max_message_bytes
        self._torch = torch.Generator().manual_seed(seed)
        self.families: List[Tuple[str, float, Callable[[], FuzzCase]]] = [
            ("random_bytes", 3, self._random_bytes), ("mutated", 3, self._mutated),
            ("wrong_types", 3, self._wrong_types), ("tensor_lies", 3, self._tensor_lies),
            ("non_finite", 2, self._non_finite), ("wrong_stage", 1, self._wrong_stage),
            ("unknown_method", 1, self._unknown_method), ("zero_dim", 1, self._zero_dim),
            ("nesting", 1, self._nesting), ("truncated_stream", 1, self._truncated_stream),
            ("oversized_stream", 0.1, self._oversized_stream), ("control", 2, self._control),
        ]

    def next_case(self) -> FuzzCase:
        _, weights, makers = zip(*self.families)
        return self.rng.choices(makers, weights=weights)[0]()

    # ---- well-formed pieces ----

    def tokens(self, batch: int = 2) -> torch.Tensor:
        return torch.randint(0, self.vocab_size, (batch, self.seq_len), generator=self._torch)

    def hidden(self, batch: int = 2) -> torch.Tensor:
        return torch.randn(batch, self.seq_len, self.hidden_size, generator=self._torch)

    def valid_forward(self, stage: int) -> Dict[str, Any]:
        if stage == self.num_stages - 1:
            inputs = self.tokens() if stage == 0 else self.hidden()
            return {"stage": stage, "inputs": inputs, "targets": self.tokens()}
        return {"stage": stage, "inputs": self.tokens() if stage == 0 else self.hidden()}

    def _stage(self) -> int:
        return self.rng.randrange(self.num_stages)

    def _case(self, family: str, stage: int, method: str, message: Any, expect: str = "error") -> FuzzCase:
        payload = message if isinstance(message, bytes) else msgpack.packb(message, use_bin_type=True)
        return FuzzCase(family, stage, method, [payload], expect=expect)

    # ---- families ----

    def _random_bytes(self) -> FuzzCase:
        # any message a correct peer accepts names a valid stage and tensors; random bytes never do
        return self._case("random_bytes", self._stage(), self.rng.choice(["forward", "backward"]),
                          random_bytes(self.rng, 400))

    def _mutated(self) -> FuzzCase:
        stage = self._stage()
        return self._case("mutated", stage, "forward", mutate(self.rng, encode(self.valid_forward(stage))), "any")

    def _wrong_types(self) -> FuzzCase:
        stage = self._stage()
        good = self.valid_forward(stage)
        tokens = encode({"t": good["inputs"]})  # a valid tensor's wire form, reused inside wrong messages
        wire = msgpack.unpackb(tokens, raw=False)["t"]
        choices = [
            {"stage": str(stage), "inputs": wire}, {"stage": None, "inputs": wire}, {"stage": [stage], "inputs": wire},
            {"stage": 2**64 - 1, "inputs": wire}, {"stage": -2**63, "inputs": wire}, {"stage": stage},
            {"stage": stage, "inputs": "abc"}, {"stage": stage, "inputs": [[1, 2], [3, 4]]},
            {"stage": stage, "inputs": None}, {"stage": stage, "inputs": {"a": 1}}, {"stage": stage, "inputs": 2**63},
            {"stage": stage, "inputs": b"\x00" * 64},
            # the last stage refuses targets of the wrong type; earlier stages refuse a float for inputs
            {"stage": stage, "inputs": wire, "targets": "abc"} if stage == self.num_stages - 1
            else {"stage": stage, "inputs": 1.5},
            {"stage": stage, "micro_batch_id": 7, "inputs": wire},
        ]
        message = self.rng.choice(choices)
        method = "backward" if "micro_batch_id" in message else self.rng.choice(["forward", "backward"])
        return self._case("wrong_types", stage, method, message)

    def _tensor_lies(self) -> FuzzCase:
        stage = self._stage()
        name, lie = self.rng.choice(tensor_lies(self.rng))
        key = self.rng.choice(["inputs", "targets", "grad_outputs"])
        message = {**msgpack.unpackb(encode(self.valid_forward(stage)), raw=False), key: lie}
        method = "forward"
        if key == "grad_outputs":
            message["micro_batch_id"], method = f"fuzz-{self.rng.getrandbits(32)}", "backward"
        return self._case("tensor_lies", stage, method, message)

    def _non_finite(self) -> FuzzCase:
        value = self.rng.choice([float("nan"), float("inf"), float("-inf")])
        if self.num_stages > 1 and self.rng.random() < 0.5:  # hidden states into a later stage
            stage = self.num_stages - 1
            inputs = self.hidden()
            inputs.view(-1)[self.rng.randrange(inputs.numel())] = value
            message = {"stage": stage, "inputs": inputs}
            if stage == self.num_stages - 1:
                message["targets"] = self.tokens()
            return self._case("non_finite", stage, "forward", encode(message))
        stage = 0  # a gradient into the first stage's backward
        grad = self.hidden()
        grad.view(-1)[self.rng.randrange(grad.numel())] = value
        message = {"stage": 0, "micro_batch_id": f"fuzz-{self.rng.getrandbits(32)}", "inputs": self.tokens(),
                   "grad_outputs": grad}
        return self._case("non_finite", stage, "backward", encode(message))

    def _wrong_stage(self) -> FuzzCase:
        stage = self._stage()
        wrong = self.rng.choice([s for s in range(-1, self.num_stages + 2) if s != stage])
        message = {**self.valid_forward(stage), "stage": wrong}
        return self._case("wrong_stage", stage, self.rng.choice(["forward", "backward"]), encode(message))

    def _unknown_method(self) -> FuzzCase:
        method = self.rng.choice(["", "format_disk", "forward ", "FORWARD", "x" * 5000, "\u00e9\u4e2d\U0001f600",
                                  "rpc_forward", "parameters\x00"])
        return self._case("unknown_method", self._stage(), method, encode({"stage": 0}))

    def _zero_dim(self) -> FuzzCase:
        stage = self._stage()
        scalar = torch.tensor(self.rng.randrange(self.vocab_size)) if self.rng.random() < 0.5 else torch.tensor(0.5)
        if self.rng.random() < 0.5:
            return self._case("zero_dim", stage, "forward", encode({"stage": stage, "inputs": scalar}))
        message = {"stage": stage, "micro_batch_id": f"fuzz-{self.rng.getrandbits(32)}", "inputs": scalar,
                   "grad_outputs": torch.tensor(1.0)}
        if stage == self.num_stages - 1:
            message["targets"] = torch.tensor(1)
        return self._case("zero_dim", stage, "backward", encode(message))

    def _nesting(self) -> FuzzCase:
        depth = self.rng.choice([40, 500, 5000])
        payload = b"\x82\xa5stage\x00\xa6inputs" + b"\x91" * depth + b"\xc0"
        return self._case("nesting", 0, "forward", payload)

    def _truncated_stream(self) -> FuzzCase:
        stage = self._stage()
        payload = encode(self.valid_forward(stage))
        prefix = payload[: self.rng.randrange(1, len(payload))]  # a strict prefix of a map never parses
        cuts = sorted(self.rng.sample(range(1, len(prefix) + 1), min(2, len(prefix))))
        chunks = [prefix[a:b] for a, b in zip([0, *cuts], [*cuts, len(prefix)]) if b > a]
        return FuzzCase("truncated_stream", stage, "forward", chunks, stream=True)

    def _oversized_stream(self) -> FuzzCase:
        total = 10 * self.max_message_bytes
        block = b"\x00" * CHUNK
        chunks = [block[: min(CHUNK, total - start)] for start in range(0, total, CHUNK)]
        chunks[0] = encode({"stage": 0, "inputs": b""})[:8] + chunks[0][8:]
        return FuzzCase("oversized_stream", self._stage(), "forward", chunks, stream=True, expect="error_or_reset")

    def _control(self) -> FuzzCase:
        stage = self._stage()
        if self.rng.random() < 0.3:
            return self._case("control", stage, "info", encode({}), "ok")
        return self._case("control", stage, "forward", encode(self.valid_forward(stage)), "ok")


# ---- sending ----

async def _send(p2p: P2P, peer: PeerID, case: FuzzCase, timeout_s: float) -> Tuple[str, Optional[str]]:
    """Send one case; return (outcome, error kind) with outcome in error, ok, reset, timeout, garbled."""
    stub = RPCServicer.get_stub(p2p, peer, namespace=NAMESPACE)

    async def exchange() -> bytes:
        if not case.stream:
            response = await stub.rpc_unary(runtime_pb2.ExpertRequest(uid=case.method, metadata=case.chunks[0]))
            return response.metadata
        # framed as every caller frames a stream request; the peer may answer from the header, before reading it all
        return await _call_stream(p2p, peer, case.method, b"".join(case.chunks), MAX_REPLY_BYTES)

    try:
        raw = await asyncio.wait_for(exchange(), timeout=timeout_s)
    except asyncio.TimeoutError:
        return "timeout", None
    except Exception as e:  # p2pd errors, reset or closed streams
        return "reset", type(e).__name__
    if not raw:
        return "reset", "empty reply"
    try:
        reply = decode(raw)
    except WireError:
        return "garbled", None
    if "error" not in reply:
        return "ok", None
    kind = reply.get("kind")
    return ("error", kind) if kind in KINDS and isinstance(reply["error"], str) else ("garbled", str(kind))


def _expected(case: FuzzCase, outcome: str) -> bool:
    allowed = {"error": {"error"}, "ok": {"ok"}, "any": {"error", "ok"}, "error_or_reset": {"error", "reset"}}
    return outcome in allowed[case.expect]


async def _run_case(p2p: P2P, peers: Dict[int, PeerID], case: FuzzCase, stats: FuzzStats, timeout_s: float) -> None:
    outcome, kind = await _send(p2p, peers[case.stage], case, timeout_s)
    if outcome == "reset" and case.expect != "error_or_reset":
        # p2pd sometimes ends a stream or a call with no data and no error: one retry tells that from a dropped request
        outcome, kind = await _send(p2p, peers[case.stage], case, timeout_s)
    stats.requests += 1
    stats.families[case.family] += 1
    stats.outcomes[outcome] += 1
    if outcome == "error":
        stats.kinds[kind] += 1
    if not _expected(case, outcome):
        stats.unexpected += 1
        if len(stats.notes) < MAX_FAILURE_NOTES:
            head = case.chunks[0][:120] if case.chunks else b""
            stats.notes.append(f"{case.family} {case.method[:40]!r} to stage {case.stage} expected {case.expect}, "
                               f"got {outcome} ({kind}); first bytes {head!r}")


async def fuzz(p2p: P2P, peers: Dict[int, str], inputs: FuzzInputs, *, duration_s: float, rate_per_s: float,
               max_concurrent: int = 8, timeout_s: float = 20.0, stats: Optional[FuzzStats] = None) -> FuzzStats:
    """Send cases to ``peers`` (stage -> peer id) for ``duration_s`` seconds at about ``rate_per_s`` requests/s.

    At most ``max_concurrent`` requests are outstanding, so a slow peer slows the fuzzer down
    instead of piling requests up; every request has its own ``timeout_s``.
    """
    stats = stats or FuzzStats()
    ids = {stage: PeerID.from_base58(peer_id) for stage, peer_id in peers.items()}
    slots = asyncio.Semaphore(max_concurrent)
    tasks: List[asyncio.Task] = []
    started = next_at = time.monotonic()
    deadline = started + duration_s

    async def one(case: FuzzCase) -> None:
        try:
            await _run_case(p2p, ids, case, stats, timeout_s)
        finally:
            slots.release()

    while time.monotonic() < deadline:
        await slots.acquire()
        tasks.append(asyncio.create_task(one(inputs.next_case())))
        next_at += 1.0 / rate_per_s
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        tasks = [task for task in tasks if not task.done()]
    if tasks:
        _, late = await asyncio.wait(tasks, timeout=timeout_s * 2 + 5)
        for task in late:  # cannot happen while every request has its timeout; never leave tasks behind
            task.cancel()
    stats.elapsed_s += time.monotonic() - started
    return stats


# ---- DHT junk and process memory ----

LARGE_VALUE_BYTES = 2**20


def junk_values(rng: random.Random) -> List[Tuple[str, Any]]:
    """Values that no record parser should accept, plain non-dict values among them (the ~1 MB one is apart)."""
    return [
        ("string", "not even a dict"), ("int", rng.randint(-2**63, 2**63 - 1)), ("list", [1, "two", 3.0, None]),
        ("bytes", bytes(rng.getrandbits(8) for _ in range(64))), ("float nan", float("nan")),
        ("record-like", {"version": 1, "peer_id": "12D3KooWfake", "stage": "zero", "state": "online",
                         "throughput": float("inf")}),
        ("negative", {"version": 1, "peer_id": "x", "stage": -5, "state": "online", "throughput": -1.0,
                      "samples_sent": -3}),
        ("nested", {"a": [{"b": [{"c": list(range(50))}]}]}),
    ]


async def _store_large(dht: DHT, node: DHTNode, *, key: str, subkey: Any, expiration_time: float) -> bool:
    """Runs inside the DHT process: a ~1 MB value is built there, because hivemind's DHT loses
    (BlockingIOError in its pipe) a call whose arguments are that large."""
    return await node.store(key, {"pad": "x" * LARGE_VALUE_BYTES}, expiration_time, subkey=subkey)


async def _attempt(future, timeout_s: float) -> str:
    try:
        return "stored" if await asyncio.wait_for(asyncio.wrap_future(future), timeout=timeout_s) else "refused"
    except Exception as e:  # the DHT may refuse to serialize or send a value: that is its right
        return f"failed: {type(e).__name__}"


async def store_junk(dht: DHT, run_id: str, rng: random.Random, expiration_s: float = 3.0,
                     timeout_s: float = 5.0) -> Counter:
    """Store junk under the run's keys (with and without subkeys); returns counts of stored / refused / failed.

    Expirations are short: a plain value with a later expiration than a subkeyed entry replaces
    the whole entry in hivemind's DHT, so a long one would hide every peer for its lifetime.
    """
    keys = [f"{run_id}_peers", *(f"{run_id}_stage{stage}" for stage in range(2)), f"{run_id}_trainers"]
    counts: Counter = Counter()
    for key in keys:
        for name, value in junk_values(rng):
            subkey = rng.choice([None, f"junk-{name}", "12D3KooWjunk", 7])
            future = dht.store(key, value, get_dht_time() + expiration_s, subkey=subkey, return_future=True)
            counts[await _attempt(future, timeout_s)] += 1
        large = partial(_store_large, key=key, subkey=rng.choice([None, "junk-large"]),
                        expiration_time=get_dht_time() + expiration_s)
        counts[await _attempt(dht.run_coroutine(large, return_future=True), timeout_s)] += 1
    return counts


def rss_mb(pid: int) -> float:
    """Resident memory of a process in MiB (VmRSS from /proc), 0.0 if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def log_tracebacks(paths: Sequence[Path]) -> int:
    """Occurrences of 'Traceback' in the given log files."""
    return sum(Path(path).read_text(errors="replace").count("Traceback") for path in paths if Path(path).exists())
