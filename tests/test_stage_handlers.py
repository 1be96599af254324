"""StageHandlers against a fake peer: what a backward leaves behind when its caller gives up, and the ledger fields
its reply carries."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch

from swarm.dht.ledger_fields import LEDGER_FIELDS
from swarm.dht.records import PeerRecord
from swarm.server.compute import ComputeThread
from swarm.server.lifecycle import PeerState
from swarm.server.handlers import StageHandlers

CALLER = "QmCaller"


class BlockedSteps:
    """A stage whose step is full: every backward waits for room until the test lets it in."""

    def __init__(self):
        self.room = asyncio.Event()
        self.admitted, self.released = 0, []  # type: int, List[int]

    async def wait_for_room(self, samples: int) -> None:
        await self.room.wait()
        self.admitted += samples

    def release(self, samples: int) -> None:
        self.released.append(samples)
        self.admitted -= samples


RECORD = PeerRecord(version=1, peer_id="QmReplica", stage=0, state="online", throughput=1.0, queue_length=0, step=4,
                    accum_step=5, samples_frozen=8, samples_pending=16, samples_applied=0, contributed_base=3,
                    contributed_bits=0b101)


def fake_peer(steps: BlockedSteps) -> SimpleNamespace:
    runner = SimpleNamespace(version=(0, "d0"), resets=0, backward=lambda *args: (torch.zeros(2, 3), None, 0))
    return SimpleNamespace(state=PeerState.ONLINE, stage=0, config=SimpleNamespace(max_batch_samples=64),
                           steps=steps, runner=runner, backward_batcher=None, compute=ComputeThread(),
                           notify_progress=lambda: None, announcer=SimpleNamespace(record=lambda: RECORD))


def request(n: int) -> dict:
    return {"stage": 0, "micro_batch_id": f"{CALLER}:{n}", "inputs": torch.zeros(2, 3),
            "grad_outputs": torch.zeros(2, 3)}


async def test_a_backward_cancelled_while_it_waits_for_room_leaves_nothing_in_flight():
    """A leaving peer waits until nothing is in flight: a cancelled wait still counted would hold every leave
    that follows a trainer's departure for the whole leave timeout."""
    steps = BlockedSteps()
    peer = fake_peer(steps)
    handlers = StageHandlers(peer)
    waiting = asyncio.create_task(handlers.backward(request(1), CALLER))
    await asyncio.sleep(0.05)
    assert peer.compute.in_flight == 1, "the waiting backward is in flight"
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert peer.compute.in_flight == 0
    assert steps.admitted == 0 and steps.released == [], "nothing was admitted, so nothing is released"
    # a backward let in does its work and releases what it was admitted for
    steps.room.set()
    reply = await handlers.backward(request(2), CALLER)
    assert reply["grad_inputs"].shape == (2, 3)
    assert peer.compute.in_flight == 0 and steps.admitted == 0 and steps.released == [2]


async def test_a_backward_reply_carries_the_replicas_ledger_fields_as_its_record_has_them():
    steps = BlockedSteps()
    steps.room.set()
    peer = fake_peer(steps)
    reply = await StageHandlers(peer).backward(request(1), CALLER)
    assert set(reply["ledger_fields"]) == set(LEDGER_FIELDS)
    assert reply["ledger_fields"]["step"] == 4 and reply["ledger_fields"]["contributed_bits"] == 0b101


    def backward_then_stop(*args):
        peer.state = PeerState.STOPPED  # stopped while the backward ran: no record, so no ledger fields
        return torch.zeros(2, 3), None, 0

    peer.runner.backward = backward_then_stop
    assert "ledger_fields" not in await StageHandlers(peer).backward(request(2), CALLER)


async def test_a_backward_passes_the_trainers_clock_hint_to_the_step_coordinator():
    steps = BlockedSteps()
    steps.room.set()
    hints = []
    steps.hear_clock_hint = hints.append
    peer = fake_peer(steps)
    await StageHandlers(peer).backward({**request(1), "clock_step": 6}, CALLER)
    await StageHandlers(peer).backward(request(2), CALLER)
    assert hints == [6], "a backward without a hint tells the coordinator nothing"
