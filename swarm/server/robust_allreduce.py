"""One averaging round of a stage group in which every member aggregates everything itself.

hivemind's butterfly all-reduce makes each member reduce one part of the vector for everyone, so a
lying member could return any values for its part, and CenteredClip needs the distance between whole
gradients anyway. Here the round has two exchanges over hivemind's ``rpc_aggregate_part`` stream:

1. **gradients**: every member streams its whole gradient to every other member, headed by a
   *commitment* it signs with its peer identity: group id, sender, sample count, size and the SHA-256
   of the bytes it sends. A receiver refuses a gradient whose bytes do not match the commitment,
   whose signature does not verify, or whose signer is not the peer on the other end of the stream.
2. **echo**: every member forwards the signed commitments it received to every other member. Two valid
   commitments of one sender with different hashes prove that it sent different gradients to different
   members (the way to corrupt a group without reducers); every honest member that sees the proof
   drops that sender and bans it.

A gradient goes in only if most members that echoed hold it (see :func:`agreed_contributions`), so a
gradient that some members missed (it came late, or its sender skipped them) is dropped by all alike.
But members decide on the echoes that reached them in time, and under load one member's view can lack an
echo that another's holds, so they can decide on different inputs. Hence

3. **decision**: every member sends every other member the digest of the inputs it decided on (senders,
   gradient hashes, claimed samples; :func:`inputs_digest`), and applies the result only once a strict
   majority of the group, itself included, sent that same digest (:func:`decision_is_confirmed`); it sits
   the round out otherwise. Two confirming majorities of one group share a member, and an honest member
   sends everyone the same digest, so honest members that apply a round applied the same inputs.

Each member then runs :func:`swarm.policy.aggregation.robust_aggregate` on those inputs in the same
order, so honest members end with bit-identical results. A member that sat out is behind its stage and
downloads the state that most of its stage holds (see :mod:`swarm.policy.steps`). Only liars on both
sides of the shared member (a decision to one member, another to the next) can still make two honest
members apply different inputs; their parameter digests then differ after the step, and the minority
downloads the majority's state.

With the run's ``compression`` (fp16 or int8), a member compresses its gradient once and sends those
bytes to everyone (float32 chunks otherwise); the commitment hashes the compressed bytes. Every member,
the sender included, aggregates the *decoded* gradients, its own too: all hold the same inputs, so the
results stay bit-identical, and what a member aggregates of its own is what the others received.

Costs: each member sends its gradient to n-1 peers (a butterfly sends about 2x(n-1)/n of it), which
is the price of letting every member check every contribution; stage groups are small. A member that had
no samples this step (a replica standing by, or one that just joined) has weight 0, so it sends its
signed commitment with no values, and everyone aggregates zeros in their place: it receives the others'
gradients and ends with the same result, at no upload cost.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MSGPackSerializer, get_logger
from hivemind.utils.asyncio import aiter_with_timeout, anext
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from swarm.net.compression import (
    DEFAULT_BLOCK_SIZE,
    Compressed,
    CompressionError,
    check_block_size,
    compress,
    decompress,
    num_blocks,
)
from swarm.dht.identity import peer_id_of
from swarm.net.ternary import check_gradient_codec, decode_ternary, encode_ternary, ternary_bytes
from swarm.policy.aggregation import Aggregate, AggregationConfig, adds_nothing, equivocators, robust_aggregate

__all__ = [
    "RobustRound",
    "Commitment",
    "IncompleteRound",
    "Packed",
    "agreed_contributions",
    "inputs_digest",
    "decision_is_confirmed",
    "sign_commitment",
    "check_commitment",
    "pack",
    "unpack",
    "empty_contribution",
    "CHUNK_ELEMENTS",
    "CHUNK_BYTES",
]

logger = get_logger(__name__)
CHUNK_ELEMENTS = 2**17  # float32 values per streamed chunk (512 KiB)
CHUNK_BYTES = 4 * CHUNK_ELEMENTS  # bytes of a compressed gradient per streamed chunk
MAX_ECHOED = 64  # commitments one echo may carry


@dataclass(frozen=True)
class Commitment:
    """A member's signed statement of what it contributes to one group's round."""

    group_id: bytes
    sender: str
    samples: float
    size: int
    sha256: str
    public_key: bytes
    signature: bytes

    def payload(self) -> bytes:
        return _payload(self.group_id, self.sender, self.samples, self.size, self.sha256)

    def to_dict(self) -> Dict[str, Any]:
        return {
            "group_id": self.group_id,
            "sender": self.sender,
            "samples": self.samples,
            "size": self.size,
            "sha256": self.sha256,
            "public_key": self.public_key,
            "signature": self.signature,
        }

    @classmethod
    def from_dict(cls, data: Any) -> "Commitment":
        if not isinstance(data, dict):
            raise ValueError("a commitment must be a dict")
        try:
            commitment = cls(
                bytes(data["group_id"]),
                str(data["sender"]),
                float(data["samples"]),
                int(data["size"]),
                str(data["sha256"]),
                bytes(data["public_key"]),
                bytes(data["signature"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed commitment: {type(e).__name__}: {e}") from None
        return commitment


def _payload(group_id: bytes, sender: str, samples: float, size: int, sha256: str) -> bytes:
    return MSGPackSerializer.dumps([b"swarm-gradient-commitment", group_id, sender, float(samples), int(size), sha256])


def vector_hash(vector: torch.Tensor) -> str:
    return hashlib.sha256(vector.contiguous().numpy().tobytes()).hexdigest()


def compressed_hash(codec: str, block_size: int, data: bytes) -> str:
    """The hash of a compressed gradient's bytes (data, then scales), bound to how they are to be read."""
    return hashlib.sha256(f"{codec}/{block_size}/".encode() + data).hexdigest()


def sign_commitment(
    key: RSAPrivateKey, group_id: bytes, sender: str, samples: float, size: int, sha256: str
) -> Commitment:
    signature = key.sign(_payload(group_id, sender, samples, size, sha256))
    return Commitment(group_id, sender, float(samples), size, sha256, key.get_public_key().to_bytes(), signature)


def check_commitment(commitment: Commitment, group_id: bytes, size: int, sender: Optional[str] = None) -> None:
    """Raise ValueError unless the commitment is for this round, signed by the peer it names."""
    if commitment.group_id != group_id:
        raise ValueError("commitment for another group")
    if commitment.size != size:
        raise ValueError(f"commitment for {commitment.size} values, the round has {size}")
    if sender is not None and commitment.sender != sender:
        raise ValueError(f"commitment names {commitment.sender}, but {sender} sent it")
    if peer_id_of(commitment.public_key) != commitment.sender:
        raise ValueError(f"commitment of {commitment.sender} carries another peer's key")
    if not RSAPublicKey.from_bytes(commitment.public_key).verify(commitment.payload(), commitment.signature):
        raise ValueError(f"commitment of {commitment.sender} has a bad signature")


@dataclass(frozen=True)
class Packed:
    """A gradient as one member sends it: the stream's chunks, their hash, and the values receivers decode
    from them (which the sender aggregates as its own contribution)."""

    chunks: List[runtime_pb2.Tensor]
    sha256: str
    vector: torch.Tensor


def _chunks(flat: torch.Tensor, chunk: int) -> List[runtime_pb2.Tensor]:
    return [serialize_torch_tensor(flat[i : i + chunk]) for i in range(0, flat.numel(), chunk)]


def pack(vector: torch.Tensor, codec: str = "none", block_size: int = DEFAULT_BLOCK_SIZE) -> Packed:
    """``vector`` (float32) ready to send: float32 chunks, or with ``codec`` the compressed bytes as uint8
    chunks. Raises :class:`~swarm.net.compression.CompressionError` for values that cannot be compressed."""
    if codec == "none":
        return Packed(_chunks(vector, CHUNK_ELEMENTS), vector_hash(vector), vector)
    if codec == "ternary":
        data = encode_ternary(vector)
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        decoded = decode_ternary(data, vector.numel())
        return Packed(_chunks(raw, CHUNK_BYTES), compressed_hash(codec, block_size, data), decoded)
    compressed = compress(vector, codec, block_size)
    data = compressed.data + compressed.scales
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return Packed(_chunks(raw, CHUNK_BYTES), compressed_hash(codec, block_size, data), decompress(compressed))


def empty_contribution(size: int, codec: str = "none", block_size: int = DEFAULT_BLOCK_SIZE) -> Packed:
    """What a member with no samples sends: no values at all, hashed as an empty payload of the round's codec.
    Its weight is 0 (:func:`~swarm.policy.aggregation.adds_nothing`), so its values would never count; every
    member, the sender included, aggregates zeros in their place."""
    sha256 = vector_hash(torch.empty(0)) if codec == "none" else compressed_hash(codec, block_size, b"")
    return Packed([], sha256, torch.zeros(size))


def _wire_length(size: int, codec: str, block_size: int) -> int:
    """Elements a gradient of ``size`` values takes on the stream: float32 values, or compressed bytes."""
    if codec == "none":
        return size
    if codec == "ternary":
        return ternary_bytes(size)
    if codec == "fp16":
        return 2 * size
    return size + 4 * num_blocks(size, block_size)


def unpack(
    parts: Sequence[torch.Tensor],
    size: int,
    sha256: str,
    codec: str = "none",
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> torch.Tensor:
    """The float32 values of a received gradient, from the chunks :func:`pack` made, once their bytes match
    the signed ``sha256``; ``ValueError`` (:class:`~swarm.net.compression.CompressionError` included) otherwise."""
    if codec == "none":
        vector = torch.cat(list(parts)) if parts else torch.empty(0)
        if vector_hash(vector) != sha256:
            raise ValueError("gradient does not match its signed hash")
        return vector
    data = b"".join(part.numpy().tobytes() for part in parts)
    if compressed_hash(codec, block_size, data) != sha256:
        raise ValueError("gradient does not match its signed hash")
    if codec == "ternary":
        return decode_ternary(data, size)
    values = size * (2 if codec == "fp16" else 1)
    return decompress(Compressed(codec, (size,), block_size, data[:values], data[values:]))


class RobustRound:
    """The state of one round at one member: what it sent, received, and decided.

    ``compression`` (one of :data:`swarm.net.ternary.GRADIENT_CODECS`, the same for the whole group) and
    ``block_size`` (of int8) say how gradients travel. ``send_override`` lets an emulated attacker send another
    vector to some members (tests and benchmarks). ``on_bytes`` is told the encoded size of every message the
    member sends or receives, replies included, also after :meth:`run` returned (sends still in flight): what
    the round puts on the wire before libp2p's framing."""

    def __init__(
        self,
        *,
        stub_for: Callable[[PeerID], Any],
        group_id: bytes,
        peer_ids: Sequence[PeerID],
        peer_id: PeerID,
        vector: torch.Tensor,
        samples: float,
        key: RSAPrivateKey,
        config: AggregationConfig,
        banned: Set[str],
        timeout: float,
        chunk_timeout: float,
        max_samples: Optional[float] = None,
        send_override: Optional[Callable[[int, torch.Tensor], torch.Tensor]] = None,
        compression: str = "none",
        block_size: int = DEFAULT_BLOCK_SIZE,
        on_bytes: Optional[Callable[[int], None]] = None,
    ):
        self.stub_for, self.group_id, self.peer_id = stub_for, group_id, peer_id
        self.on_bytes = on_bytes  # told the size of every message this member sends or receives in the round
        self.others = [p for p in peer_ids if p != peer_id]
        self.vector = vector.detach().to(torch.float32).contiguous()
        self.compression, self.block_size = check_gradient_codec(compression), check_block_size(block_size)
        self.contribution: Optional[torch.Tensor] = None  # what this member aggregates of its own: what it sent
        self.samples, self.key, self.config, self.banned = samples, key, config, banned
        self.timeout, self.chunk_timeout = timeout, chunk_timeout
        self.max_samples, self.send_override = max_samples, send_override
        self.size = self.vector.numel()
        self.received: Dict[str, torch.Tensor] = {}
        self.commitments: Dict[str, Commitment] = {}  # sender -> the commitment that came with its gradient
        self.seen: Dict[str, Set[str]] = {}  # sender -> hashes it signed for this round (direct and echoed)
        self.signed: Dict[str, Commitment] = {}  # sender -> the first valid commitment of it seen (direct or echoed)
        self._gradients_in = asyncio.Event()
        self._arrival = asyncio.Event()  # set whenever a groupmate starts sending, finishes, or is refused
        self._started: Set[str] = set()  # senders whose gradient stream has begun
        self._echoes_from: Set[str] = set()
        self.held_by: Dict[str, Set[str]] = {}  # echoing member -> senders whose gradients it says it holds
        self._echoes_in = asyncio.Event()
        self.decisions: Dict[str, str] = {}  # member -> the digest of the inputs it decided on
        self._decision_in = asyncio.Event()  # set at each decision that arrives
        self.refused: Dict[str, str] = {}  # sender -> why its gradient was refused
        self._deadline = time.monotonic() + timeout
        self._sends: List[asyncio.Future] = []  # this member's sends, each ended by the round's deadline
        self._check_done()

    # ---- receiving ----

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        sender = str(context.remote_id)
        try:
            if context.remote_id not in self.others:
                raise ValueError("not a member of this group")
            stream = self._counted(aiter_with_timeout(stream, self.chunk_timeout))
            first = await anext(stream)
            header = MSGPackSerializer.loads(first.peer_id) if first.peer_id else None
            if first.group_id != self.group_id or not isinstance(header, dict):
                raise ValueError("bad first message")
            if header.get("kind") == "gradient":
                await self._receive_gradient(sender, header, first, stream)
            elif header.get("kind") == "echo":
                self._receive_echo(sender, header)
            elif header.get("kind") == "decision":
                self._receive_decision(sender, header)
            else:
                raise ValueError(f"unknown message kind {header.get('kind')!r}")
            yield self._count(averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART))
        except Exception as e:
            self.refused.setdefault(sender, f"{type(e).__name__}: {e}")
            self._arrival.set()
            logger.debug(f"refused a message of {sender}: {e}")
            yield self._count(averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION))

    def _count(self, message: averaging_pb2.AveragingData) -> averaging_pb2.AveragingData:
        if self.on_bytes is not None:
            self.on_bytes(message.ByteSize())
        return message

    async def _counted(
        self, stream: AsyncIterator[averaging_pb2.AveragingData]
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in stream:
            yield self._count(message)

    async def _receive_gradient(
        self,
        sender: str,
        header: Dict[str, Any],
        first: averaging_pb2.AveragingData,
        stream: AsyncIterator[averaging_pb2.AveragingData],
    ) -> None:
        commitment = Commitment.from_dict(header.get("commitment"))
        check_commitment(commitment, self.group_id, self.size, sender)
        self._note(commitment)
        self._started.add(sender)
        self._arrival.set()
        if adds_nothing(commitment.samples):
            self._receive_empty(sender, commitment, first)
            return
        dtype = torch.float32 if self.compression == "none" else torch.uint8
        length = _wire_length(self.size, self.compression, self.block_size)
        parts, count, message = [], 0, first
        while True:
            part = deserialize_torch_tensor(message.tensor_part)
            if part.dtype != dtype or part.ndim != 1:
                raise ValueError(f"gradient chunk of {part.dtype} with {part.ndim} dims, expected {dtype} with 1")
            parts.append(part)
            count += part.numel()
            if count >= length:
                break
            message = await anext(stream)
        if count != length:
            raise ValueError(f"sent {count} elements, a gradient of the round takes {length}")
        vector = unpack(parts, self.size, commitment.sha256, self.compression, self.block_size)
        self.received[sender], self.commitments[sender] = vector, commitment
        self._check_done()

    def _receive_empty(self, sender: str, commitment: Commitment, first: averaging_pb2.AveragingData) -> None:
        """A groupmate that claims no samples: it must send no values, and sign the hash of none."""
        if first.tensor_part.buffer:
            raise ValueError(f"claimed {commitment.samples:g} samples but sent values")
        expected = empty_contribution(0, self.compression, self.block_size).sha256
        if commitment.sha256 != expected:
            raise ValueError(f"claimed {commitment.samples:g} samples but signed the hash of values")
        self.received[sender], self.commitments[sender] = torch.zeros(self.size), commitment
        self._check_done()

    def _receive_echo(self, sender: str, header: Dict[str, Any]) -> None:
        echoed = header.get("commitments")
        if not isinstance(echoed, list) or len(echoed) > MAX_ECHOED:
            raise ValueError("an echo must be a short list of commitments")
        held = set()
        for data in echoed:
            try:
                commitment = Commitment.from_dict(data)
                check_commitment(commitment, self.group_id, self.size)
            except ValueError as e:
                logger.debug(f"{sender} echoed an invalid commitment: {e}")
                continue
            self._note(commitment)
            held.add(commitment.sender)
        self.held_by[sender] = held
        self._echoes_from.add(sender)
        if self._echoes_from >= {str(p) for p in self.others}:
            self._echoes_in.set()

    def _receive_decision(self, sender: str, header: Dict[str, Any]) -> None:
        digest = header.get("inputs")
        if not isinstance(digest, str) or len(digest) != 64:
            raise ValueError("a decision must be the 64-character digest of the inputs")
        if sender in self.decisions:
            raise ValueError("a second decision for the round")
        self.decisions[sender] = digest
        self._decision_in.set()

    def _note(self, commitment: Commitment) -> None:
        self.seen.setdefault(commitment.sender, set()).add(commitment.sha256)
        self.signed.setdefault(commitment.sender, commitment)

    def _check_done(self) -> None:
        self._arrival.set()
        if set(self.received) >= {str(p) for p in self.others}:
            self._gradients_in.set()

    # ---- sending ----

    async def _send(
        self, peer: PeerID, header: Dict[str, Any], chunks: Sequence[runtime_pb2.Tensor], until: Optional[float] = None
    ) -> None:
        async def messages():
            yield self._count(
                averaging_pb2.AveragingData(
                    code=averaging_pb2.PART_FOR_AVERAGING,
                    group_id=self.group_id,
                    peer_id=MSGPackSerializer.dumps(header),
                    tensor_part=chunks[0] if chunks else runtime_pb2.Tensor(),
                )
            )
            for chunk in chunks[1:]:
                yield self._count(averaging_pb2.AveragingData(tensor_part=chunk))

        async def exchange():
            replies = await self.stub_for(peer).rpc_aggregate_part(messages())
            reply = self._count(await anext(replies))
            if reply.code != averaging_pb2.AVERAGED_PART:
                raise ValueError(f"{peer} answered {averaging_pb2.MessageCode.Name(reply.code)}")

        try:
            await asyncio.wait_for(
                exchange(), max(0.0, min(self._deadline, until or self._deadline) - time.monotonic())
            )
        except Exception as e:
            logger.debug(f"sending to {peer} failed: {type(e).__name__}: {e}")

    async def _pack(self, vector: torch.Tensor, empty: bool = False) -> Tuple[Commitment, Packed]:
        """``vector`` serialized (and compressed) once, off the event loop, with its signed commitment;
        ``empty``: no values (see :func:`empty_contribution`)."""
        loop = asyncio.get_running_loop()
        try:
            packed = (
                empty_contribution(self.size, self.compression, self.block_size)
                if empty
                else await loop.run_in_executor(None, pack, vector, self.compression, self.block_size)
            )
        except CompressionError as e:
            raise IncompleteRound(f"this member's gradient cannot be sent in {self.compression}: {e}") from None
        commitment = sign_commitment(self.key, self.group_id, str(self.peer_id), self.samples, self.size, packed.sha256)
        return commitment, packed

    def _send_in_background(self, sends: Sequence[Awaitable[None]]) -> None:
        """Start sends without waiting for them: a groupmate that hivemind's matchmaking placed in the group
        but that never joined the round (its own search timed out as the leader assembled the group) holds
        a send to it open until the deadline, and the round must go on without it meanwhile."""
        sending = asyncio.ensure_future(asyncio.gather(*sends))
        sending.add_done_callback(lambda done: None if done.cancelled() else done.exception())  # seen, not raised
        self._sends.append(sending)

    async def _send_gradients(self) -> None:
        own, packed = await self._pack(self.vector, adds_nothing(self.samples))  # the same bytes for every groupmate
        self._note(own)
        self.commitments[str(self.peer_id)] = own
        self.contribution = packed.vector
        sends = []
        for index, peer in enumerate(self.others):
            commitment, chunks = own, packed.chunks
            if self.send_override is not None:  # an emulated equivocator: another vector for some groupmates
                vector = self.send_override(index, self.vector).to(torch.float32).contiguous()
                commitment, other = await self._pack(vector)
                chunks = other.chunks
            sends.append(self._send(peer, {"kind": "gradient", "commitment": commitment.to_dict()}, chunks))
        self._send_in_background(sends)

    async def _send_echoes(self) -> None:
        echoed = [c.to_dict() for c in list(self.commitments.values())[:MAX_ECHOED]]
        self._send_in_background(
            [self._send(peer, {"kind": "echo", "commitments": echoed}, ()) for peer in self.others]
        )

    async def _decide(self, digest: str) -> bool:
        """Send this member's decision to the others, and wait (at most a chunk's timeout) until a strict
        majority of the group confirms it, or every other member has decided. Whether it was confirmed."""
        until = min(self._deadline, time.monotonic() + self.chunk_timeout)
        sending = asyncio.ensure_future(
            asyncio.gather(
                *(self._send(peer, {"kind": "decision", "inputs": digest}, (), until) for peer in self.others)
            )
        )
        try:
            # a banned member's word confirms nothing; the group's size stays what it is for everyone
            while not decision_is_confirmed(
                digest, {m: d for m, d in self.decisions.items() if m not in self.banned}, len(self.others) + 1
            ):
                if set(self.decisions) >= {str(p) for p in self.others} or time.monotonic() >= until:
                    return False
                self._decision_in.clear()
                await _wait(self._decision_in, until)
            return True
        finally:
            await sending  # each send ends by `until`

    # ---- the round ----

    async def _wait_for_gradients(self, started: float) -> None:
        """Until every groupmate's gradient is in, or the deadline; a groupmate that has not begun sending
        by half the round's time is not waited for once the others are done (it is likely gone)."""
        patient_until = started + max(self.chunk_timeout, self.timeout / 2)
        while not self._gradients_in.is_set() and time.monotonic() < self._deadline:
            past_patience = time.monotonic() > patient_until
            if past_patience and set(self.received) | set(self.refused) >= self._started:
                return
            self._arrival.clear()
            await _wait(self._arrival, self._deadline if past_patience else min(self._deadline, patient_until))

    async def run(self) -> Aggregate:
        started = time.monotonic()
        self._deadline = started + self.timeout
        await self._send_gradients()
        await self._wait_for_gradients(started)
        await self._send_echoes()
        await _wait(self._echoes_in, min(self._deadline, time.monotonic() + self.chunk_timeout))
        me = str(self.peer_id)
        held_by = {**{m: h for m, h in self.held_by.items() if m not in self.banned}, me: set(self.received) | {me}}
        agreed = agreed_contributions(held_by)
        banned, equivocated = set(self.banned), equivocators(self.seen)
        # the commitment a gradient came with where this member holds it (its claim is what gets aggregated),
        # the one it saw echoed otherwise
        digest = inputs_digest(
            {sender: self.commitments.get(sender) or self.signed[sender] for sender in agreed - banned - equivocated}
        )
        confirmed = await self._decide(digest)  # this member's decision counts for the others even if it sits out
        if me not in agreed:
            raise IncompleteRound("most of the group did not receive this member's gradient")
        missing = agreed - set(self.received) - {me}
        if missing:
            raise IncompleteRound(f"most of the group holds gradients this member did not receive: {sorted(missing)}")
        if not confirmed:
            others = sum(d == digest for m, d in self.decisions.items() if m not in self.banned)
            raise IncompleteRound(
                f"{others} of {len(self.others)} groupmates confirmed this member's inputs "
                f"({len(self.decisions)} decided, banned ones not counted), not a majority of the group"
            )
        contributions = {sender: vector for sender, vector in self.received.items() if sender in agreed}
        if self.contribution is None:
            raise RuntimeError("this member's own gradient is unknown: the round sends it first")
        contributions[me] = self.contribution
        claims = {sender: c.samples for sender, c in self.commitments.items()}
        aggregate = await asyncio.get_running_loop().run_in_executor(
            None, _aggregate_single_threaded, contributions, claims, self.config, banned, equivocated, self.max_samples
        )
        for peer in self.others:
            if str(peer) not in contributions and str(peer) not in aggregate.excluded:
                why = (
                    "a groupmate did not receive its gradient"
                    if str(peer) in self.received
                    else "sent no gradient in time"
                )
                aggregate.excluded[str(peer)] = self.refused.get(str(peer), why)
        return aggregate


class IncompleteRound(Exception):
    """This member lacks a gradient that most of its group holds: it cannot compute the group's result."""


def agreed_contributions(held_by: Dict[str, Set[str]]) -> Set[str]:
    """The senders whose gradients a strict majority of the members that echoed (this one included) hold.

    Every member decides on the same echoes, so all drop alike a gradient that some of them missed (a late
    sender, or one that skipped some members), and one lying echo cannot veto an honest gradient. A member
    that lacks an agreed gradient sits the round out (see :class:`IncompleteRound`)."""
    voters = len(held_by)
    senders = set().union(*held_by.values()) if held_by else set()
    return {s for s in senders if 2 * sum(1 for held in held_by.values() if s in held) > voters}


def inputs_digest(inputs: Dict[str, Commitment]) -> str:
    """What a member decided to aggregate, as one hash: each input's sender, gradient hash and claimed
    samples (the aggregate is a function of exactly these, given the run's config)."""
    listed = sorted((sender, c.sha256, float(c.samples)) for sender, c in inputs.items())
    return hashlib.sha256(MSGPackSerializer.dumps([b"swarm-round-inputs", listed])).hexdigest()


def decision_is_confirmed(digest: str, decisions: Dict[str, str], group_size: int) -> bool:
    """Whether a strict majority of the group (``group_size`` members, this one included with ``digest``)
    decided on ``digest``. Any two such majorities share a member, so two honest members that each see their
    decision confirmed decided alike, unless a liar sent each of them another decision."""
    return 2 * (1 + sum(1 for other in decisions.values() if other == digest)) > group_size


async def _wait(event: asyncio.Event, deadline: float) -> None:
    try:
        await asyncio.wait_for(event.wait(), max(0.0, deadline - time.monotonic()))
    except asyncio.TimeoutError:
        pass


def _aggregate_single_threaded(*args) -> Aggregate:
    """The aggregation with one intra-op thread: reductions then split the same way on every replica."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return robust_aggregate(*args)
    finally:
        torch.set_num_threads(threads)
