"""Members of one robust round wired to each other in one process, over a transport that delays or drops
chosen messages: what honest members apply when the network reorders their exchanges."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Dict, List, Optional, Set, Tuple

import pytest
import torch
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer

from swarm.dht.identity import load_or_create_identity
from swarm.net.ternary import ternary_bytes
from swarm.policy.aggregation import AggregationConfig
from swarm.server.robust_allreduce import (IncompleteRound, RobustRound, decision_is_confirmed, inputs_digest,
                                           sign_commitment)

SIZE = 256


class _Network:
    """Delivers each message stream to the member it is for, after the delay set for (sender, receiver,
    kind); a member in ``dead`` answers nothing, and a (sender, receiver, kind) in ``dropped`` never arrives."""

    def __init__(self) -> None:
        self.rounds: Dict[str, RobustRound] = {}
        self.delays: Dict[Tuple[str, str, str], float] = {}
        self.dropped: Set[Tuple[str, str, str]] = set()
        self.dead: Set[str] = set()
        self.ghosts: Set[str] = set()  # placed in the group but never joined the round: holds streams open
        self.value_bytes: Dict[Tuple[str, str], int] = {}  # (sender, kind) -> tensor bytes it sent
        self.moved: Dict[str, int] = {}  # member -> encoded bytes of the messages and replies it sent or received

    def carried(self, sender: str, receiver: str, size: int) -> None:
        for member in (sender, receiver):
            self.moved[member] = self.moved.get(member, 0) + size


class _Link:
    """The stub one member uses to reach another over :class:`_Network`."""

    def __init__(self, network: _Network, sender: PeerID, receiver: PeerID):
        self.network, self.sender, self.receiver = network, sender, receiver

    async def rpc_aggregate_part(self, messages):
        sent = [message async for message in messages]
        kind = MSGPackSerializer.loads(sent[0].peer_id)["kind"]
        link = (str(self.sender), str(self.receiver), kind)
        sent_bytes = sum(len(message.tensor_part.buffer) for message in sent)
        key = (str(self.sender), kind)
        self.network.value_bytes[key] = self.network.value_bytes.get(key, 0) + sent_bytes
        if str(self.receiver) in self.network.dead or link in self.network.dropped:
            raise ConnectionError(f"{link} does not arrive")
        if str(self.receiver) in self.network.ghosts:
            await asyncio.sleep(3600)  # as hivemind's averager waits for a group it will never register
        await asyncio.sleep(self.network.delays.get(link, 0.0))

        async def stream():
            for message in sent:
                self.network.carried(str(self.sender), str(self.receiver), message.ByteSize())
                yield message

        async def replies():
            async for reply in self.network.rounds[str(self.receiver)].rpc_aggregate_part(
                    stream(), SimpleNamespace(remote_id=self.sender)):
                self.network.carried(str(self.receiver), str(self.sender), reply.ByteSize())
                yield reply
        return replies()


def _members(count: int) -> List[Tuple[PeerID, object]]:
    identities = [load_or_create_identity(None) for _ in range(count)]
    return [(PeerID.from_base58(identity.peer_id), identity.private_key) for identity in identities]


@pytest.fixture(scope="module")
def members():
    return _members(4)


def _gradient(seed: int) -> torch.Tensor:
    return torch.ones(SIZE) + 0.1 * torch.randn(SIZE, generator=torch.Generator().manual_seed(seed))


async def _play(members, network: _Network, timeout: float, chunk_timeout: float,
                samples: Optional[List[float]] = None, compression: str = "none",
                send_override=None, counted: Optional[Dict[str, int]] = None) -> List[Optional[torch.Tensor]]:
    """One round among the live members; what each applied (None: it sat the round out). ``samples``: what
    each member claims (16 each by default); ``send_override``: member index -> what it sends instead;
    ``counted``: member -> the bytes its round reported through ``on_bytes``."""
    peer_ids = [peer_id for peer_id, _ in members]
    samples = samples or [16.0] * len(members)
    for index, (peer_id, key) in enumerate(members):
        network.rounds[str(peer_id)] = RobustRound(
            stub_for=lambda receiver, sender=peer_id: _Link(network, sender, receiver), group_id=b"group",
            peer_ids=peer_ids, peer_id=peer_id, vector=_gradient(index), samples=samples[index], key=key,
            config=AggregationConfig(), banned=set(), timeout=timeout, chunk_timeout=chunk_timeout,
            compression=compression, send_override=(send_override or {}).get(index),
            on_bytes=None if counted is None else _adder(counted, str(peer_id)))

    async def one(peer_id: PeerID) -> Optional[torch.Tensor]:
        try:
            return (await network.rounds[str(peer_id)].run()).vector
        except IncompleteRound:
            return None
    live = [peer_id for peer_id in peer_ids if str(peer_id) not in network.dead | network.ghosts]
    return list(await asyncio.gather(*(one(peer_id) for peer_id in live)))


def _adder(counted: Dict[str, int], member: str):
    def add(size: int) -> None:
        counted[member] = counted.get(member, 0) + size
    return add


def _distinct(applied: List[Optional[torch.Tensor]]) -> int:
    results: List[torch.Tensor] = []
    for vector in applied:
        if vector is not None and not any(torch.equal(vector, seen) for seen in results):
            results.append(vector)
    return len(results)


async def test_members_that_apply_a_round_whose_echoes_came_late_apply_the_same_inputs(members):
    """Four members, the fourth dead after matchmaking. C's gradient never reaches B, and C's echo reaches A
    too late: A counts the echoes of A and B only and leaves C's gradient out, while C, counting all three,
    keeps it (B lacks it and sits out). Deciding on the echoes alone, A and C applied different results;
    with the decision exchange neither's inputs are confirmed by a majority of the group of four, so no two
    members apply different results."""
    a, b, c, d = (str(peer_id) for peer_id, _ in members)
    network = _Network()
    network.dead.add(d)
    network.dropped.add((c, b, "gradient"))
    network.delays[(c, a, "echo")] = 2.0
    applied = await _play(members, network, timeout=6.0, chunk_timeout=1.0)
    assert applied[1] is None  # B lacks C's gradient
    assert _distinct(applied) <= 1, [None if v is None else float(v.sum()) for v in applied]


async def test_a_late_decision_leaves_its_receiver_out_and_the_others_apply_alike(members):
    """All gradients and echoes arrive; only D's decision to A comes after A stops waiting. B, C and D confirm
    each other (three of four) and apply the same result; A, unconfirmed, sits the round out."""
    a, b, c, d = (str(peer_id) for peer_id, _ in members)
    network = _Network()
    network.delays[(d, a, "decision")] = 2.0
    network.delays[(b, a, "decision")] = 2.0
    applied = await _play(members, network, timeout=6.0, chunk_timeout=1.0)
    assert applied[0] is None
    assert all(vector is not None for vector in applied[1:]) and _distinct(applied) == 1


async def test_a_member_that_never_joined_the_round_does_not_hold_the_others_up(members):
    """D was placed in the group by matchmaking but never joined the round, and a send to it stays open until
    the round's deadline. A, B and C go on without waiting for those sends: each applies the same result, well
    before the deadline (waiting on them, each would reach its decision at the deadline and sit out)."""
    network = _Network()
    network.ghosts.add(str(members[3][0]))
    started = asyncio.get_running_loop().time()
    applied = await _play(members, network, timeout=8.0, chunk_timeout=1.0)
    assert all(vector is not None for vector in applied) and _distinct(applied) == 1
    assert asyncio.get_running_loop().time() - started < 8.0


async def test_a_round_without_late_messages_is_applied_by_everyone_alike(members):
    applied = await _play(members, _Network(), timeout=6.0, chunk_timeout=1.0)
    assert all(vector is not None for vector in applied) and _distinct(applied) == 1


@pytest.mark.parametrize("compression", ["none", "int8", "ternary"])
async def test_a_round_counts_every_byte_it_sends_and_receives(members, compression):
    """What each member reports through ``on_bytes`` is what the transport carried to and from it (messages and
    replies); each member sends its whole gradient to every other member, so that is at least 2 x (n - 1)
    encoded gradients."""
    network, counted = _Network(), {}
    applied = await _play(members, network, timeout=6.0, chunk_timeout=1.0, compression=compression,
                          counted=counted)
    assert all(vector is not None for vector in applied)
    await asyncio.sleep(0.1)  # the last replies of sends still in flight when the rounds returned
    assert counted == network.moved
    gradient = {"none": 4 * SIZE, "int8": SIZE, "ternary": ternary_bytes(SIZE)}[compression]
    assert all(size >= 2 * (len(members) - 1) * gradient for size in counted.values())


def test_a_decision_counts_once_a_strict_majority_of_the_group_made_it(members):
    mine, other = "a" * 64, "b" * 64
    assert decision_is_confirmed(mine, {}, 1)  # alone in its group
    assert not decision_is_confirmed(mine, {}, 2)
    assert decision_is_confirmed(mine, {"x": mine}, 2)
    assert not decision_is_confirmed(mine, {"x": mine, "y": other, "z": other}, 4)  # two of four: no majority
    assert decision_is_confirmed(mine, {"x": mine, "y": mine, "z": other}, 4)
    assert not decision_is_confirmed(mine, {"x": mine}, 4)  # the silent members count against it


def test_the_inputs_digest_covers_senders_hashes_and_claimed_samples(members):
    (p, key), (q, other_key) = members[0], members[1]
    one = sign_commitment(key, b"g", str(p), 16.0, SIZE, "0" * 64)
    two = sign_commitment(other_key, b"g", str(q), 16.0, SIZE, "1" * 64)
    digest = inputs_digest({str(p): one, str(q): two})
    assert digest == inputs_digest({str(q): two, str(p): one})  # whatever the order
    assert digest != inputs_digest({str(p): one})
    assert digest != inputs_digest({str(p): one, str(q): sign_commitment(other_key, b"g", str(q), 16.0, SIZE, "2" * 64)})
    assert digest != inputs_digest({str(p): one, str(q): sign_commitment(other_key, b"g", str(q), 15.0, SIZE, "1" * 64)})


@pytest.mark.parametrize("compression", ["none", "int8", "ternary"])
async def test_a_member_with_no_samples_sends_no_values_and_applies_what_the_others_apply(members, compression):
    """D had no samples this step (weight 0): it uploads no gradient values, yet every member, D included,
    applies the very result that A, B and C reach in a round of their own."""
    d = str(members[3][0])
    network = _Network()
    applied = await _play(members, network, timeout=6.0, chunk_timeout=1.0, samples=[16.0, 16.0, 16.0, 0.0],
                          compression=compression)
    assert network.value_bytes[(d, "gradient")] == 0
    assert network.value_bytes[(str(members[0][0]), "gradient")] > 0
    assert all(vector is not None for vector in applied) and _distinct(applied) == 1
    alone = await _play(members[:3], _Network(), timeout=6.0, chunk_timeout=1.0, compression=compression)
    assert torch.equal(applied[0], alone[0])


async def test_a_member_that_claims_no_samples_but_sends_values_is_refused(members):
    """Values under a claim of no samples are refused by every receiver; the others apply their round alike,
    and the member that sent them, whose gradient nobody holds, sits it out."""
    d = str(members[3][0])
    network = _Network()
    applied = await _play(members, network, timeout=6.0, chunk_timeout=1.0, samples=[16.0, 16.0, 16.0, 0.0],
                          send_override={3: lambda index, vector: vector + 1.0})
    assert applied[3] is None
    assert all(vector is not None for vector in applied[:3]) and _distinct(applied) == 1
    assert "sent values" in network.rounds[str(members[0][0])].refused[d]
