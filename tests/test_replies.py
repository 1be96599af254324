"""Every reply is checked before use: a replica that sends a bad one is banned, the call goes elsewhere,
and neither a bad reply nor an error reply can end a trainer. No network: call_peer is a fake swarm."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import pytest
import torch
from hivemind.p2p import PeerID

import swarm.client.pipeline as pipeline
from swarm.client.ledger import Ledger
from swarm.client.pipeline import (
    BadReply, PipelineClient, StageUnavailable, Unauthorized, check_reply, judge_failure,
)
from swarm.client.trainer import Trainer
from swarm.config.settings import RunConfig, TrainerConfig
from swarm.model.gpt import ModelConfig
from swarm.policy.routing import Router
from swarm.policy.snapshot import PeerInfo
from swarm.net.rpc import RemoteError

MODEL = ModelConfig(vocab_size=16, seq_len=4, num_layers=2, hidden_size=8, num_heads=2)
BATCH, SEQ, HIDDEN = 2, 4, 8
Fault = Callable[[str, Dict[str, Any]], Dict[str, Any]]


def pid(name: str) -> str:
    """A base58 peer id for a readable name."""
    return PeerID(name.encode()).to_base58()


def honest_reply(method: str, message: Mapping[str, Any], num_stages: int) -> Dict[str, Any]:
    stage, inputs = message["stage"], message["inputs"]
    last = stage == num_stages - 1
    if method == "forward":
        return {"loss": 2.5} if last else {"outputs": torch.ones(inputs.shape[0], inputs.shape[1], HIDDEN)}
    reply: Dict[str, Any] = {"step": 3, "resets": 1}
    if last:
        reply["loss"] = 2.5
    if stage > 0:
        reply["grad_inputs"] = torch.full_like(inputs, 0.1)
    return reply


class FakeSwarm:
    """Stands in for ``call_peer``: every replica answers honestly unless it has a fault (or an error)."""

    def __init__(self, num_stages: int, faults: Optional[Dict[str, Fault]] = None,
                 errors: Optional[Dict[str, RemoteError]] = None):
        self.num_stages, self.faults, self.errors = num_stages, faults or {}, errors or {}
        self.calls: List[Tuple[str, str, int]] = []  # (peer id, method, stage)

    async def __call__(self, p2p, peer_id: PeerID, method: str, message: Mapping[str, Any], *, timeout: float,
                       **kwargs) -> Dict[str, Any]:
        peer = peer_id.to_base58()
        self.calls.append((peer, method, message["stage"]))
        if peer in self.errors:
            raise self.errors[peer]
        reply = honest_reply(method, message, self.num_stages)
        fault = self.faults.get(peer)
        return fault(method, reply) if fault is not None else reply

    def served(self, peer: str, method: str = "backward") -> int:
        return sum(1 for p, m, _ in self.calls if p == peer and m == method)


def make_client(snapshot: List[PeerInfo], num_stages: int, max_retries: int = 6, seed: int = 0) -> PipelineClient:
    return PipelineClient(None, num_stages, lambda: snapshot, Router(seed=seed), Ledger(), model=MODEL,
                          forward_timeout_s=1.0, backward_timeout_s=1.0, max_retries=max_retries)


def tokens() -> Tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(BATCH, SEQ, dtype=torch.long), torch.ones(BATCH, SEQ, dtype=torch.long)


@pytest.fixture
def no_sleep(monkeypatch):
    async def instant(_):
        return None
    monkeypatch.setattr(asyncio, "sleep", instant)


def _set(key: str, value: Any) -> Fault:
    return lambda method, reply: {**reply, key: value} if key in reply else reply


def _drop(key: str) -> Fault:
    return lambda method, reply: {k: v for k, v in reply.items() if k != key}


def _narrow(key: str) -> Fault:
    return lambda method, reply: {**reply, key: reply[key][..., :-1].contiguous()} if key in reply else reply


LAST_STAGE_FAULTS = {
    "non-numeric loss": (_set("loss", "not a number"), "'loss' is a str"),
    "NaN loss": (_set("loss", float("nan")), "'loss' is nan"),
    "boolean loss": (_set("loss", True), "'loss' is a bool"),
    "wrong-shaped grad_inputs": (_narrow("grad_inputs"), "'grad_inputs' has shape (2, 4, 7)"),
    "NaN grad_inputs": (_set("grad_inputs", torch.full((BATCH, SEQ, HIDDEN), math.nan)), "'grad_inputs' contains NaN"),
    "missing step": (_drop("step"), "'step' is missing"),
    "negative step": (_set("step", -1), "'step' is -1"),
}


@pytest.mark.parametrize("fault_name", sorted(LAST_STAGE_FAULTS))
async def test_a_bad_last_stage_reply_bans_its_sender_and_the_step_succeeds_elsewhere(
        monkeypatch, caplog, no_sleep, fault_name):
    fault, reason = LAST_STAGE_FAULTS[fault_name]
    bad, good = pid("bad"), [pid("good1"), pid("good2")]
    snapshot = [PeerInfo(pid("first"), 0)] + [PeerInfo(p, 1, throughput=1.0) for p in good] + [
        PeerInfo(bad, 1, throughput=1e12)]  # the liar also claims to be fast: it is tried first in practice
    fake = FakeSwarm(2, faults={bad: fault})
    monkeypatch.setattr(pipeline, "call_peer", fake)
    client = make_client(snapshot, 2)
    with caplog.at_level(logging.WARNING, logger=pipeline.__name__):
        for n in range(8):
            assert await client.train_step(f"t:{n}", *tokens()) == 2.5
    assert fake.served(bad) >= 1, "the faulty replica was never tried: the test proves nothing"
    assert client.router.is_banned(bad, time.monotonic())
    banned = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"banning peer {bad} of stage 1")]
    assert banned and reason in banned[0], [r.getMessage() for r in caplog.records]
    assert all(item.peer_id != bad for item in client.ledger._open.values())  # nothing is accounted to it


async def test_a_wrong_shaped_stage0_output_bans_the_stage0_replica_not_stage1(monkeypatch, caplog, no_sleep):
    bad, good0, next1 = pid("bad0"), pid("good0"), pid("next1")
    snapshot = [PeerInfo(bad, 0, throughput=1e12), PeerInfo(good0, 0, throughput=1.0), PeerInfo(next1, 1)]
    fake = FakeSwarm(2, faults={bad: _narrow("outputs")})
    monkeypatch.setattr(pipeline, "call_peer", fake)
    client = make_client(snapshot, 2)
    with caplog.at_level(logging.WARNING, logger=pipeline.__name__):
        for n in range(6):
            await client.train_step(f"t:{n}", *tokens())
    assert fake.served(bad, "forward") >= 1
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"banning peer {bad} of stage 0: 'outputs' has shape (2, 4, 7)") for m in messages), messages
    assert not any(next1 in m for m in messages), messages
    assert client.router.measured_throughput(next1) > 0 and not client.router.is_banned(next1, 0.0)
    # what stage 1 received (and what the ledger keeps to re-send) is the good replica's output
    assert all(tuple(item.inputs.shape) == (BATCH, SEQ, HIDDEN)
               for item in client.ledger._open.values() if item.stage == 1)


async def test_every_replica_bad_fails_the_call_with_the_first_real_error(monkeypatch, no_sleep):
    replicas = [pid("only1"), pid("only2")]
    snapshot = [PeerInfo(pid("first"), 0)] + [PeerInfo(p, 1) for p in replicas]
    fake = FakeSwarm(2, faults={p: _set("loss", float("inf")) for p in replicas})
    monkeypatch.setattr(pipeline, "call_peer", fake)
    client = make_client(snapshot, 2, max_retries=5)
    with pytest.raises(StageUnavailable) as info:
        await client.call_stage(1, "backward", {"micro_batch_id": "t:1", "inputs": torch.ones(BATCH, SEQ, HIDDEN),
                                                "targets": tokens()[1]}, 1.0)
    message = str(info.value)
    assert "first error: " in message and ": bad reply: 'loss' is inf" in message, message
    assert "no peer available" not in message, message  # what remains once both are banned is not the cause


async def test_remote_error_kinds(monkeypatch, no_sleep):
    busy, broken, good = pid("busy"), pid("broken"), pid("good")
    snapshot = [PeerInfo(busy, 0, throughput=1e3), PeerInfo(broken, 0, throughput=1e3), PeerInfo(good, 0)]
    fake = FakeSwarm(1, errors={busy: RemoteError("too many requests", "busy"),
                                broken: RemoteError("undecodable", "bad_reply")})
    monkeypatch.setattr(pipeline, "call_peer", fake)
    client = make_client(snapshot, 1)
    for n in range(6):
        assert await client.train_step(f"t:{n}", *tokens()) == 2.5
    assert fake.served(good) == 6
    assert client.router._num_failures.get(busy) is None  # set aside, not counted as a failure
    assert client.router._num_failures.get(broken, 0) >= 1


async def test_bad_request_is_retried_elsewhere_within_the_bound(monkeypatch, no_sleep):
    mangled, good = pid("mangled"), pid("good")
    snapshot = [PeerInfo(mangled, 0, throughput=1e3), PeerInfo(good, 0)]
    fake = FakeSwarm(1, errors={mangled: RemoteError("hidden states contain NaN values", "bad_request")})
    monkeypatch.setattr(pipeline, "call_peer", fake)
    client = make_client(snapshot, 1)
    for n in range(4):
        assert await client.train_step(f"t:{n}", *tokens()) == 2.5
    assert fake.served(mangled) >= 1
    everyone = FakeSwarm(1, errors={p.peer_id: RemoteError("malformed", "bad_request") for p in snapshot})
    monkeypatch.setattr(pipeline, "call_peer", everyone)
    with pytest.raises(StageUnavailable, match="bad_request: malformed"):
        await make_client(snapshot, 1, max_retries=3).train_step("t:9", *tokens())
    assert len(everyone.calls) == 2  # one call per replica, then the ban leaves none within the bound


async def test_unauthorized_fails_the_call_at_once_with_a_clear_message(monkeypatch, no_sleep):
    snapshot = [PeerInfo(pid("gate"), 0)]
    fake = FakeSwarm(1, errors={pid("gate"): RemoteError("caller not in the allowlist", "unauthorized")})
    monkeypatch.setattr(pipeline, "call_peer", fake)
    with pytest.raises(Unauthorized, match="not allowed in the run"):
        await make_client(snapshot, 1).train_step("t:1", *tokens())
    assert len(fake.calls) == 1


def test_check_reply_accepts_honest_replies_and_names_the_problem():
    inputs = torch.ones(BATCH, SEQ, HIDDEN)
    ok = dict(stage=1, num_stages=3, inputs=inputs, wire_width=HIDDEN)
    assert check_reply({"outputs": torch.ones(BATCH, SEQ, HIDDEN)}, method="forward", **ok) is None
    assert check_reply({"step": 0, "resets": 0, "grad_inputs": torch.zeros_like(inputs)}, method="backward", **ok) is None
    assert check_reply({"step": 2, "resets": 3}, method="backward", stage=0, num_stages=3, inputs=tokens()[0],
                       wire_width=HIDDEN) is None
    assert "'resets' is missing" in check_reply({"step": 2}, method="backward", stage=0, num_stages=3,
                                                inputs=tokens()[0], wire_width=HIDDEN)
    assert "'resets' is -1" in check_reply({"step": 2, "resets": -1}, method="backward", stage=0, num_stages=3,
                                           inputs=tokens()[0], wire_width=HIDDEN)
    assert check_reply({"loss": 3}, method="forward", stage=2, num_stages=3, inputs=inputs, wire_width=HIDDEN) is None
    assert "dtype torch.float64" in check_reply({"outputs": torch.ones(BATCH, SEQ, HIDDEN, dtype=torch.float64)},
                                                method="forward", **ok)
    assert "not a tensor" in check_reply({"outputs": [1.0]}, method="forward", **ok)
    assert "not a map" in check_reply([1], method="forward", **ok)
    assert "'step' is True" in check_reply({"step": True, "resets": 0, "grad_inputs": torch.zeros_like(inputs)},
                                           method="backward", **ok)
    assert "'grad_inputs' is missing" in check_reply({"step": 1, "resets": 0}, method="backward", **ok)
    assert "'loss' is -1.0" in check_reply({"loss": -1.0}, method="forward", stage=2, num_stages=3, inputs=inputs,
                                           wire_width=HIDDEN)



def test_a_logits_reply_is_checked_like_any_tensor():
    """A generation forward asks the last stage for the logits of the last position: (batch, vocab) float32."""
    inputs, vocab = torch.ones(BATCH, SEQ, HIDDEN), 11
    last = dict(method="forward", stage=2, num_stages=3, inputs=inputs, wire_width=HIDDEN, logits_of=vocab)
    assert check_reply({"logits": torch.zeros(BATCH, vocab)}, **last) is None
    assert "'logits' is missing" in check_reply({"loss": 1.0}, **last)
    assert f"expected {(BATCH, vocab)}" in check_reply({"logits": torch.zeros(BATCH, vocab + 1)}, **last)
    assert "NaN or inf" in check_reply({"logits": torch.full((BATCH, vocab), float("nan"))}, **last)

def test_judge_failure():
    assert judge_failure(BadReply("p", 1, "NaN")).action == "ban"
    assert judge_failure(RemoteError("x", "busy")).action == "pause"
    assert judge_failure(RemoteError("x", "unauthorized")).action == "refuse"
    assert judge_failure(RemoteError("x", "bad_reply")).action == "ban"
    assert judge_failure(RemoteError("x", "bad_request")).action == "ban"
    assert judge_failure(RemoteError("x", "wrong_stage")).stale_snapshot
    assert judge_failure(asyncio.TimeoutError()).reason == "timed out"
    assert judge_failure(ConnectionError("reset")).action == "ban"
    # the fixed words that label bans in the metrics
    assert [judge_failure(e).kind for e in (BadReply("p", 1, "NaN"), RemoteError("x", "busy"), asyncio.TimeoutError(),
                                            ConnectionError("reset"))] == ["bad_reply", "busy", "timeout", "failed_call"]


# ---- the trainer's worker ----

class _FailingThenGoodClient:
    """A PipelineClient stand-in whose first micro-batches raise whatever a broken reply could cause."""

    def __init__(self, failures: List[BaseException]):
        self.failures, self.ids = list(failures), []

    async def train_step(self, micro_batch_id: str, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        self.ids.append(micro_batch_id)
        if self.failures:
            raise self.failures.pop(0)
        return 1.25


class _Sampler:
    def sample(self) -> Tuple[torch.Tensor, torch.Tensor]:
        return tokens()


class _FakeDHT:
    peer_id = pid("trainer")


def _trainer(max_samples: int) -> Trainer:
    config = TrainerConfig(batch_size=BATCH, max_samples=max_samples, max_in_flight=1,
                           run=RunConfig(run_id="replies", model=MODEL))
    trainer = Trainer(config, dht=_FakeDHT(), corpus=object())
    trainer.sampler = _Sampler()
    trainer._reserved = 0
    return trainer


async def test_the_worker_survives_any_exception_of_a_micro_batch(no_sleep, caplog):
    trainer = _trainer(max_samples=2 * BATCH)
    trainer.client = _FailingThenGoodClient([KeyError("loss"), TypeError("float() argument must be a number"),
                                             StageUnavailable("stage 1: backward failed")])
    with caplog.at_level(logging.WARNING):
        await asyncio.wait_for(trainer._worker(deadline=math.inf), timeout=5.0)
    assert trainer.metrics.micro_batches_failed == 3 and trainer.metrics.samples_sent == 2 * BATCH
    failed = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert any("KeyError" in m for m in failed) and any("TypeError: float() argument" in m for m in failed)
    numbers = [int(i.rsplit(":", 1)[1]) for i in trainer.client.ids]
    assert numbers == list(range(numbers[0], numbers[0] + 5))
    assert all(i.startswith(f"{pid('trainer')}:") for i in trainer.client.ids)


async def test_the_worker_stops_on_cancellation():
    trainer = _trainer(max_samples=10**6)

    class Hanging:
        async def train_step(self, *args):
            await asyncio.sleep(3600)

    trainer.client = Hanging()
    task = asyncio.create_task(trainer._worker(deadline=math.inf))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_worker_whose_call_swallowed_its_cancellation_draws_nothing_more_once_the_trainer_drains():
    trainer = _trainer(max_samples=10**6)

    class Swallowing:
        """Returns instead of raising when cancelled: asyncio.wait_for does so on Python 3.11 when the call it
        waits for completed as it was cancelled."""

        calls = 0

        async def train_step(self, *args):
            self.calls += 1
            try:
                await asyncio.sleep(0.005)
            except asyncio.CancelledError:
                pass
            return 1.0

    trainer.client = Swallowing()
    trainer.refresh = _no_refresh
    task = asyncio.create_task(trainer._worker(deadline=math.inf))
    await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.sleep(0.05)
    calls = trainer.client.calls
    await asyncio.sleep(0.05)
    assert not task.done() and trainer.client.calls > calls, "the cancelled worker goes on (else this shows nothing)"
    await trainer.drain(timeout_s=0.2)
    await asyncio.wait_for(task, timeout=1.0)
    calls = trainer.client.calls
    await asyncio.sleep(0.05)
    assert trainer.client.calls == calls


async def _no_refresh(stages=None) -> None:
    return None


def test_micro_batch_ids_start_at_a_random_offset_per_trainer():
    firsts = {next(_trainer(max_samples=8)._ids) for _ in range(4)}
    assert len(firsts) == 4 and all(0 <= n < 2**64 for n in firsts)


async def test_a_stage_backward_goes_back_to_the_replica_that_ran_its_forward(monkeypatch, no_sleep):
    first = [pid("first1"), pid("first2"), pid("first3")]
    snapshot = [PeerInfo(p, 0, throughput=1.0) for p in first] + [PeerInfo(pid("last"), 1)]
    fake = FakeSwarm(2, errors={})
    monkeypatch.setattr(pipeline, "call_peer", fake)
    client = make_client(snapshot, 2)
    used = set()
    for n in range(12):
        fake.calls.clear()
        await client.train_step(f"t:{n}", *tokens())
        stage0 = [(peer, method) for peer, method, stage in fake.calls if stage == 0]
        assert [m for _, m in stage0] == ["forward", "backward"] and stage0[0][0] == stage0[1][0], fake.calls
        used.add(stage0[0][0])
    assert len(used) > 1, "forwards are still spread over the replicas by throughput"

    # the replica that ran the forward dies before the backward: it goes to another replica
    dead = {}

    async def dies_after_forward(p2p, peer_id, method, message, *, timeout, **kwargs):
        if method == "forward" and message["stage"] == 0 and not dead:
            dead[peer_id.to_base58()] = True
        elif peer_id.to_base58() in dead:
            raise ConnectionError("peer is gone")
        return await fake(p2p, peer_id, method, message, timeout=timeout, **kwargs)

    monkeypatch.setattr(pipeline, "call_peer", dies_after_forward)
    fake.calls.clear()
    await client.train_step("t:dead", *tokens())
    (gone,) = dead
    backward0 = [peer for peer, method, stage in fake.calls if stage == 0 and method == "backward"]
    assert backward0 and gone not in backward0
