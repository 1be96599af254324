"""Verified replies: spot checks on a second replica, a third replica's vote, accusations and their credit.

Pure policy tests on hand-built replies; the trainer's verifier against a fake swarm (no network), with
and without the defence; and one live swarm in which a replica serving noisy activations is caught."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import pytest
import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer, get_dht_time

import swarm.client.pipeline as pipeline
from swarm import PROTOCOL_VERSION
from swarm.client.ledger import Ledger
from swarm.client.pipeline import PipelineClient
from swarm.client.verification import ReplyVerifier
from swarm.config.settings import RunConfig
from swarm.dht.identity import load_or_create_identity
from swarm.model.gpt import ModelConfig
from swarm.policy.routing import Router
from swarm.policy.snapshot import PeerInfo
from swarm.policy.verification import (
    Observation, VerificationBook, VerificationPolicy, blame_incomparable, compare, compared_keys, fingerprint,
    outvoted, params_step, request_fingerprint,
)
from swarm.dht.records import AccusationRecord, accusations_key, run_schema_validator
from swarm.server.faults import corrupt_reply
from swarm.net.rpc import RemoteError
from swarm.server.runner import StageRunner
from tests.utils.probe import online
from tests.utils.processes import wait_for_log_lines

MODEL = ModelConfig(vocab_size=16, seq_len=4, num_layers=2, hidden_size=8, num_heads=2)
BATCH, SEQ, HIDDEN = 2, 4, 8
STEP = 3
Fault = Callable[[str, Dict[str, Any]], Dict[str, Any]]


def pid(name: str) -> str:
    return PeerID(name.encode()).to_base58()


def hidden(seed: float = 0.0) -> torch.Tensor:
    return torch.sin(torch.arange(BATCH * SEQ * HIDDEN, dtype=torch.float32).reshape(BATCH, SEQ, HIDDEN) + seed)


def obs(name: str, step: Optional[int], outputs: torch.Tensor) -> Observation:
    return Observation(pid(name), step, {"outputs": outputs, "step": step})


# ---- the policy, pure ----

def test_compared_keys_and_params_step():
    assert compared_keys("forward", 0, 3) == ("outputs",) and compared_keys("forward", 2, 3) == ("loss",)
    assert compared_keys("backward", 0, 3) == ()  # stage 0's parameter gradients never leave the replica
    assert compared_keys("backward", 1, 3) == ("grad_inputs",)
    assert compared_keys("backward", 2, 3) == ("grad_inputs", "loss")
    assert compared_keys("backward", 0, 1) == ("loss",)
    assert params_step("forward", {"step": 4}) == 4 and params_step("backward", {"step": 9, "params_step": 4}) == 4
    for bad in ({}, {"step": True}, {"step": -1}, {"step": "4"}, {"step": 4.0}):
        assert params_step("forward", bad) is None, bad


def test_compare_needs_the_same_step_and_the_tolerance_separates_noise_from_rounding():
    x = hidden()
    assert compare(obs("a", STEP, x), obs("b", STEP, x.clone()), ("outputs",), 1e-4).comparison == "agree"
    rounding = x * (1 + 1e-6)
    assert compare(obs("a", STEP, x), obs("b", STEP, rounding), ("outputs",), 1e-4).comparison == "agree"
    noisy = corrupt_reply("noisy_outputs", "forward", {"outputs": x})["outputs"]
    verdict = compare(obs("a", STEP, x), obs("b", STEP, noisy), ("outputs",), 1e-4)
    assert verdict.comparison == "disagree" and "outputs" in verdict.reason
    assert compare(obs("a", STEP, x), obs("b", STEP, torch.zeros_like(x)), ("outputs",), 1e-4).comparison == "disagree"
    assert compare(obs("a", STEP, x), obs("b", STEP, x[..., :-1]), ("outputs",), 1e-4).comparison == "disagree"
    assert compare(obs("a", STEP, x), obs("b", STEP + 1, noisy), ("outputs",), 1e-4).comparison == "incomparable"
    assert compare(obs("a", None, x), obs("b", None, x), ("outputs",), 1e-4).comparison == "incomparable"
    losses = [Observation(pid(n), STEP, {"loss": loss}) for n, loss in (("a", 2.5), ("b", 2.5), ("c", 1.25))]
    assert compare(losses[0], losses[1], ("loss",), 1e-4).comparison == "agree"
    assert compare(losses[0], losses[2], ("loss",), 1e-4).comparison == "disagree"


def test_the_outvoted_reply_is_the_one_two_agreeing_replies_contradict():
    x, liar = hidden(), hidden(1.0)
    for order in ([obs("liar", STEP, liar), obs("a", STEP, x), obs("b", STEP, x)],
                  [obs("a", STEP, x), obs("liar", STEP, liar), obs("b", STEP, x)],
                  [obs("a", STEP, x), obs("b", STEP, x), obs("liar", STEP, liar)]):
        assert outvoted(order, ("outputs",), 1e-4).peer_id == pid("liar")
    assert outvoted([obs("a", STEP, x), obs("b", STEP, x), obs("c", STEP, x)], ("outputs",), 1e-4) is None
    assert outvoted([obs("a", STEP, x), obs("b", STEP, liar), obs("c", STEP, hidden(2.0))], ("outputs",), 1e-4) is None
    assert outvoted([obs("liar", STEP, liar), obs("a", STEP, x), obs("b", STEP + 1, x)], ("outputs",), 1e-4) is None
    assert outvoted([obs("liar", STEP, liar), obs("a", STEP, x)], ("outputs",), 1e-4) is None


def test_blame_for_replies_that_could_not_be_compared():
    assert blame_incomparable([None, STEP], [STEP, STEP], 1) == [0]
    assert blame_incomparable([STEP, STEP + 100], [STEP, STEP, STEP], 1) == [1]
    assert blame_incomparable([STEP, STEP + 1], [STEP, STEP + 1, STEP], 1) == []  # a step just closed
    assert blame_incomparable([None, None], [STEP], 1) == []  # nothing tells them apart
    assert blame_incomparable([STEP, STEP + 5], [], 1) == []


def test_fingerprints_tell_replies_and_requests_apart():
    x = hidden()
    assert fingerprint({"outputs": x}, ("outputs",)) == fingerprint({"outputs": x.clone()}, ("outputs",))
    assert fingerprint({"outputs": x}, ("outputs",)) != fingerprint({"outputs": hidden(1.0)}, ("outputs",))
    assert len(fingerprint({"loss": 2.5}, ("loss",))) == 16
    assert request_fingerprint({"inputs": x}) != request_fingerprint({"inputs": x, "targets": torch.ones(2)})


def test_policy_refuses_bad_settings():
    for bad in (dict(verify_fraction=1.5), dict(suspect_fraction=-0.1), dict(rtol=0.0), dict(min_checks=0),
                dict(max_step_lag=-1), dict(suspicion_s=float("inf"))):
        with pytest.raises(ValueError):
            VerificationPolicy(**bad)


def test_suspicion_raises_the_rate_of_checks_for_a_while():
    book = VerificationBook(VerificationPolicy(verify_fraction=0.02, suspect_fraction=0.5, suspicion_s=60.0))
    assert not book.should_verify("p", 0.0, 0.3) and book.should_verify("p", 0.0, 0.01)
    book.suspect("p", 0.0)
    assert book.should_verify("p", 10.0, 0.3) and not book.should_verify("q", 10.0, 0.3)
    book.expire(61.0)
    assert not book.should_verify("p", 61.0, 0.3)


def test_strikes_ban_only_a_replica_that_keeps_escaping_comparison():
    book = VerificationBook(VerificationPolicy(max_strikes=3))
    assert not book.strike("p") and not book.strike("p")
    book.agreed(["p"])  # one comparable check clears them
    assert not book.strike("p") and not book.strike("p") and book.strike("p")


def test_a_false_accusation_costs_its_author_and_a_confirmed_one_pays():
    policy = VerificationPolicy(suspicion_s=60.0, min_checks=3, max_refuted=2)
    book = VerificationBook(policy, own_id="me")
    now = 0.0
    for round_ in range(2):  # two accusations of an honest replica, each checked and found honest
        verdict = book.consider("liar", "honest", 0, ("forward", round_), now)
        assert verdict.action == "suspect" and book.is_suspected("honest", now)
        book.agreed(["honest", "other"] * 3)
        now += 61.0
        assert book.expire(now) == [("liar", "honest", True)]
    verdict = book.consider("liar", "bad", 0, ("forward", 9), now)
    assert verdict.action == "ignore" and "refuted" in verdict.reason and not book.is_suspected("bad", now)
    # an accusation checked too little is dropped, undecided: it costs nothing
    assert book.consider("careful", "quiet", 0, ("forward", 1), now).action == "suspect"
    assert book.expire(now + 61.0) == [("careful", "quiet", False)] and book.is_credible("careful")
    # a confirmed accusation earns its author a credit that one refuted accusation spends
    assert book.consider("sharp", "bad", 1, ("forward", 1), now).action == "suspect"
    assert book.caught("bad") == ["sharp"] and book._credit["sharp"] == 1


def test_accusations_a_reader_does_not_act_on():
    book = VerificationBook(VerificationPolicy(), own_id="me")
    assert book.consider("me", "p", 0, ("forward", 1), 0.0).action == "ignore"
    assert book.consider("t", "p", 0, ("forward", 1), 0.0).action == "suspect"
    assert book.consider("t", "p", 0, ("forward", 1), 1.0).reason == "already seen"
    assert "still being checked" in book.consider("t", "q", 0, ("forward", 2), 1.0).reason  # one at a time


def test_a_distrusted_replica_stays_banned_whatever_calls_still_succeed():
    router = Router(seed=0)
    peers = [PeerInfo(pid("liar"), 0), PeerInfo(pid("good"), 0)]
    router.distrust(pid("liar"), 0.0, 10.0)
    router.report_success(pid("liar"), 2, 0.1)  # a call sent before the ban came back fine
    assert router.is_banned(pid("liar"), 5.0) and not router.is_banned(pid("liar"), 11.0)
    assert {router.choose(peers, 5.0).peer_id for _ in range(20)} == {pid("good")}
    router.ban(pid("other"), 0.0)
    router.report_success(pid("other"))
    assert not router.is_banned(pid("other"), 0.5)  # an ordinary ban is lifted by a success


# ---- what the replica computes and sends ----

def test_verification_backward_accumulates_nothing_and_returns_the_same_reply():
    run = RunConfig(run_id="verify", num_stages=2, model=MODEL)
    runner = StageRunner(run, 1, "cpu")
    inputs, targets = torch.randn(BATCH, SEQ, HIDDEN), torch.randint(0, 16, (BATCH, SEQ))
    checked = runner.backward("t:1", inputs, None, targets, accumulate=False)
    assert runner.samples_pending == 0 and runner.samples_processed == 0 and not runner.pending_ids
    assert all(float(g.abs().sum()) == 0 for g in runner.grad_sum)
    counted = runner.backward("t:1", inputs, None, targets)
    assert runner.samples_pending == BATCH
    assert torch.equal(checked[0], counted[0]) and checked[1] == counted[1] and checked[2] == counted[2]


def test_reply_faults_are_finite_plausible_and_wrong():
    x = hidden()
    noisy = corrupt_reply("noisy_outputs", "forward", {"outputs": x, "step": STEP})
    assert torch.isfinite(noisy["outputs"]).all() and noisy["outputs"].shape == x.shape and noisy["step"] == STEP
    assert 0.3 < float((noisy["outputs"] - x).std() / x.std()) < 0.7
    assert float(corrupt_reply("zero_outputs", "forward", {"outputs": x})["outputs"].abs().sum()) == 0
    grads = corrupt_reply("noisy_grad_inputs", "backward", {"grad_inputs": x, "outputs": x})
    assert not torch.equal(grads["grad_inputs"], x) and torch.equal(grads["outputs"], x)
    assert corrupt_reply("wrong_loss", "backward", {"loss": 2.5, "step": 1})["loss"] == 1.25
    assert corrupt_reply("none", "forward", {"outputs": x})["outputs"] is x


def test_an_accusation_is_small_and_only_its_author_may_store_it():
    author = load_or_create_identity(None)
    record = AccusationRecord(version=PROTOCOL_VERSION, trainer_id=author.peer_id, accused="A" * 64, witness="W" * 64,
                              referee="R" * 64, stage=4095, method="backward", step=2**53, inputs_hash="i" * 32,
                              accused_hash="a" * 32, witness_hash="w" * 32)
    value = record.model_dump(mode="json")
    assert len(MSGPackSerializer.dumps(value)) <= 1024
    validator = CompositeValidator([RSASignatureValidator(author.private_key), run_schema_validator("vrun", 2)])
    key = accusations_key("vrun")

    def stored(subkey, payload) -> DHTRecord:
        return DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(subkey),
                         MSGPackSerializer.dumps(payload), get_dht_time() + 30)

    def signed(item: DHTRecord) -> DHTRecord:
        return DHTRecord(item.key, item.subkey, validator.sign_value(item), item.expiration_time)

    assert validator.validate(signed(stored(author.owner_subkey, value)))
    assert not validator.validate(signed(stored(author.owner_subkey, {**value, "method": "gossip"})))
    assert not validator.validate(signed(stored(author.owner_subkey, {**value, "accused_hash": "x" * 100})))
    assert not validator.validate(signed(stored("anyone", value)))
    plain = DHTRecord(DHTID.generate(source=key).to_bytes(), DHTProtocol.IS_REGULAR_VALUE,
                      MSGPackSerializer.dumps(value), get_dht_time() + 30)
    assert not validator.validate(signed(plain))


# ---- the trainer's verifier against a fake swarm ----

def honest_reply(method: str, message: Mapping[str, Any], num_stages: int) -> Dict[str, Any]:
    stage, inputs = message["stage"], message["inputs"]
    last = stage == num_stages - 1
    if method == "forward":
        if last:
            return {"loss": 2.5, "step": STEP}
        x = inputs.float() if inputs.ndim == 3 else inputs.float().unsqueeze(-1)
        return {"outputs": torch.sin(x.sum(-1, keepdim=True) + torch.arange(HIDDEN)), "step": STEP}
    reply: Dict[str, Any] = {"step": STEP, "params_step": STEP, "resets": 1}
    if last:
        reply["loss"] = 2.5
    if stage > 0:
        reply["grad_inputs"] = torch.cos(inputs) * 0.1
    return reply


class FakeSwarm:
    """Stands in for ``call_peer``: honest replicas answer alike; a faulty one as its fault says."""

    def __init__(self, num_stages: int, faults: Optional[Dict[str, Fault]] = None):
        self.num_stages, self.faults = num_stages, faults or {}
        self.calls: List[Tuple[str, str, Dict[str, Any]]] = []

    async def __call__(self, p2p, peer_id: PeerID, method: str, message: Mapping[str, Any], *, timeout: float,
                       **kwargs) -> Dict[str, Any]:
        peer = peer_id.to_base58()
        self.calls.append((peer, method, dict(message)))
        reply = honest_reply(method, message, self.num_stages)
        fault = self.faults.get(peer)
        return fault(method, reply) if fault is not None else reply

    def verify_calls(self) -> List[Tuple[str, str, Dict[str, Any]]]:
        return [call for call in self.calls if call[2].get("verify")]


def make_client(snapshot: List[PeerInfo], num_stages: int, defences: bool = True,
                fraction: float = 1.0) -> Tuple[PipelineClient, List[AccusationRecord]]:
    client = PipelineClient(None, num_stages, lambda: snapshot, Router(seed=0), Ledger(), model=MODEL,
                            forward_timeout_s=1.0, backward_timeout_s=1.0, max_retries=6)
    published: List[AccusationRecord] = []

    async def publish(record: AccusationRecord) -> None:
        published.append(record)

    if defences:
        client.verifier = ReplyVerifier(client, VerificationPolicy(verify_fraction=fraction), pid("me"),
                                        announced_steps=lambda stage: [STEP] * 3, publish=publish)
    return client, published


def tokens() -> Tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(BATCH * SEQ).reshape(BATCH, SEQ) % 16, torch.ones(BATCH, SEQ, dtype=torch.long)


def fault(name: str) -> Fault:
    return lambda method, reply: corrupt_reply(name, method, reply)


@pytest.fixture
def no_sleep(monkeypatch):
    async def instant(_):
        return None
    monkeypatch.setattr(asyncio, "sleep", instant)


def noisy_stage0_swarm(monkeypatch) -> Tuple[FakeSwarm, List[PeerInfo], str]:
    liar = pid("noisy")
    snapshot = [PeerInfo(liar, 0, throughput=1e3)] + [PeerInfo(pid(f"good{i}"), 0, throughput=1e3) for i in range(2)] \
        + [PeerInfo(pid("last"), 1)]
    fake = FakeSwarm(2, faults={liar: fault("noisy_outputs")})
    monkeypatch.setattr(pipeline, "call_peer", fake)
    return fake, snapshot, liar


def stage1_inputs_are_honest(client: PipelineClient) -> List[bool]:
    inputs = tokens()[0]
    honest = honest_reply("forward", {"stage": 0, "inputs": inputs}, 2)["outputs"]
    return [torch.equal(item.inputs, honest) for item in client.ledger._open.values() if item.stage == 1]


async def test_noisy_activations_are_outvoted_banned_and_accused(monkeypatch, caplog, no_sleep):
    fake, snapshot, liar = noisy_stage0_swarm(monkeypatch)
    client, published = make_client(snapshot, 2)
    with caplog.at_level(logging.WARNING):
        for n in range(8):
            assert await client.train_step(f"t:{n}", *tokens()) == 2.5
    assert any(peer == liar for peer, _, _ in fake.calls), "the liar was never called: the test proves nothing"
    assert client.router.is_banned(liar, time.monotonic())
    assert any(r.getMessage().startswith(f"banning peer {liar} of stage 0: its forward reply was outvoted")
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert all(stage1_inputs_are_honest(client))  # stage 1 never trained on the noise
    assert len(published) == 1
    accusation = published[0]
    assert (accusation.accused, accusation.stage, accusation.method, accusation.step) == (liar, 0, "forward", STEP)
    assert {accusation.witness, accusation.referee} == {pid("good0"), pid("good1")}
    assert accusation.trainer_id == pid("me") and accusation.accused_hash != accusation.witness_hash


async def test_without_the_defence_the_noise_reaches_the_next_stage_unseen(monkeypatch, caplog, no_sleep):
    fake, snapshot, liar = noisy_stage0_swarm(monkeypatch)
    client, published = make_client(snapshot, 2, defences=False)
    with caplog.at_level(logging.WARNING):
        for n in range(8):
            await client.train_step(f"t:{n}", *tokens())
    assert not client.router.is_banned(liar, time.monotonic()) and not published
    assert not any(liar in r.getMessage() for r in caplog.records)
    assert not all(stage1_inputs_are_honest(client))  # the noisy activations were trained on


@pytest.mark.parametrize("fault_name", ["wrong_loss", "noisy_grad_inputs"])
async def test_wrong_backward_replies_are_caught_by_replicas_that_accumulate_nothing(monkeypatch, caplog, no_sleep,
                                                                                    fault_name):
    liar = pid("liar")
    snapshot = [PeerInfo(pid("first"), 0)] + [PeerInfo(p, 1, throughput=1e3) for p in (liar, pid("g1"), pid("g2"))]
    fake = FakeSwarm(2, faults={liar: fault(fault_name)})
    monkeypatch.setattr(pipeline, "call_peer", fake)
    client, published = make_client(snapshot, 2)
    with caplog.at_level(logging.WARNING):
        losses = [await client.train_step(f"t:{n}", *tokens()) for n in range(8)]
    assert losses == [2.5] * 8
    assert client.router.is_banned(liar, time.monotonic())
    assert [record.accused for record in published] == [liar] and published[0].method == "backward"
    checks = fake.verify_calls()
    assert checks and all(method == "backward" and message["stage"] == 1 for _, method, message in checks)
    # every backward that was counted went to one replica; the checks went elsewhere and were not counted
    assert len(client.ledger._open) == 16


async def test_a_replica_that_keeps_claiming_odd_steps_is_banned(monkeypatch, caplog, no_sleep):
    dodger = pid("dodger")
    snapshot = [PeerInfo(dodger, 0, throughput=1e3), PeerInfo(pid("good"), 0, throughput=1e3), PeerInfo(pid("last"), 1)]
    fake = FakeSwarm(2, faults={dodger: lambda method, reply: {**fault("noisy_outputs")(method, reply),
                                                               "step": STEP + 1000}})
    monkeypatch.setattr(pipeline, "call_peer", fake)
    client, _ = make_client(snapshot, 2)
    with caplog.at_level(logging.WARNING):
        for n in range(20):
            await client.train_step(f"t:{n}", *tokens())
    assert client.router.is_banned(dodger, time.monotonic())
    assert any(r.getMessage().startswith(f"banning peer {dodger} of stage 0: 4 checks in a row could not compare")
               for r in caplog.records)
    assert not client.router.is_banned(pid("good"), time.monotonic())


async def test_a_read_accusation_makes_the_reader_check_for_itself(monkeypatch, no_sleep):
    fake, snapshot, liar = noisy_stage0_swarm(monkeypatch)
    client, published = make_client(snapshot, 2, fraction=0.0)
    accusation = AccusationRecord(version=PROTOCOL_VERSION, trainer_id=pid("other"), accused=liar, witness=pid("good0"),
                                  referee=pid("good1"), stage=0, method="forward", step=STEP, inputs_hash="0" * 16,
                                  accused_hash="1" * 16, witness_hash="2" * 16)
    for n in range(6):  # not suspected: never checked, never banned
        await client.train_step(f"t:{n}", *tokens())
    assert any(peer == liar for peer, _, _ in fake.calls) and not client.router.is_banned(liar, time.monotonic())
    client.verifier.consider({pid("other"): accusation}, time.monotonic())
    for n in range(6, 40):
        await client.train_step(f"t:{n}", *tokens())
    assert client.router.is_banned(liar, time.monotonic())
    assert [record.accused for record in published] == [liar]  # its own accusation, from its own check
    assert client.verifier.book._credit[pid("other")] == 1  # the accusation was borne out


# ---- live ----

@pytest.mark.long
async def test_live_noisy_replica_is_caught_and_a_second_trainer_follows_the_accusation(launcher, probe):
    """Stage 0: two honest replicas and one serving noisy activations; stage 1: one replica. A trainer that
    checks half of its replies bans the noisy one and trains on; a second trainer that checks nothing on
    its own reads the accusation, checks the accused itself and bans it too."""
    target = 10_000  # no global step: the replicas stay at step 0, so every check compares
    honest = [launcher.peer(0, target_batch_size=target, wait=False, name=f"s0_good{i}") for i in range(2)]
    noisy = launcher.peer(0, target_batch_size=target, extra=["--fault", "noisy_outputs"], wait=False, name="s0_noisy")
    last = launcher.peer(1, target_batch_size=target, wait=False, name="s1")
    noisy_id = noisy.wait_event("peer_ready", timeout=90)["peer_id"]
    for process in (*honest, last):
        process.wait_event("peer_ready", timeout=90)
    await probe.wait_for(lambda r: len(online(r, 0)) == 3 and len(online(r, 1)) == 1, 30, "four peers online")
    banned = f"banning peer {noisy_id} of stage 0: its forward reply was outvoted"
    await _trains_until_it_bans(launcher.trainer(target_batch_size=target, name="checker", extra=[
        "--duration_s", "300", "--batch_size", "8", "--verify_fraction", "0.5"]), banned)
    second = launcher.trainer(target_batch_size=target, name="reader",
                              extra=["--duration_s", "300", "--batch_size", "8", "--verify_fraction", "0",
                                     "--trainer_seed", "2"])
    await _trains_until_it_bans(second, banned)  # it reads the accusation, then checks the accused's replies at 50%
    assert f"suspecting peer {noisy_id} of stage 0" in second.log_path.read_text()
    await check_replies_name_their_parameters_and_verification_counts_nothing(probe)


async def _trains_until_it_bans(trainer, banned: str) -> None:
    """Wait for ``trainer`` to log ``banned``, then stop it: it meets the noisy replica at once, or once that
    replica stops standing by (a busy moment on this machine can make a replica look too slow to wait for,
    until it times itself again). The trainer trains on after the ban and stops cleanly."""
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(
        None, lambda: wait_for_log_lines(trainer, lambda line: banned in line, 150, "the ban of the noisy replica"))
    assert trainer.proc.poll() is None, "the trainer trains on"
    assert await loop.run_in_executor(None, trainer.stop) == 0


async def check_replies_name_their_parameters_and_verification_counts_nothing(probe) -> None:
    records = await probe.records()
    good = next(r for r in online(records, 0) if r.samples_processed > 0)
    last = online(records, 1)[0]
    tokens_in = torch.randint(0, 256, (2, 16))
    forward = await probe.call(good.peer_id, "forward", {"stage": 0, "inputs": tokens_in})
    assert (forward["step"], forward["digest"]) == (good.step, good.digest)
    before = (await probe.call(last.peer_id, "info", {}))["samples_pending"]
    request = {"stage": 1, "inputs": forward["outputs"], "targets": tokens_in, "verify": True}
    checked = await probe.call(last.peer_id, "backward", request)
    assert checked["params_step"] == last.step and checked["grad_inputs"].shape == (2, 16, 32) and checked["loss"] > 0
    assert (await probe.call(last.peer_id, "info", {}))["samples_pending"] == before
    with pytest.raises(RemoteError, match="verify must be true or false"):
        await probe.call(last.peer_id, "backward", {**request, "verify": "yes"})


def test_replies_from_diverged_replicas_at_one_step_are_not_compared():
    from swarm.policy.verification import Observation, compare, outvoted

    a = Observation("a", 3, {"outputs": torch.zeros(2), "digest": "d1"})
    b = Observation("b", 3, {"outputs": torch.ones(2), "digest": "d2"})
    c = Observation("c", 3, {"outputs": torch.zeros(2), "digest": "d1"})
    assert compare(a, b, ["outputs"], 1e-4).comparison == "incomparable"
    assert compare(a, Observation("b", 3, {"outputs": torch.ones(2), "digest": "d1"}), ["outputs"], 1e-4).comparison \
        == "disagree"
    assert outvoted([a, b, c], ["outputs"], 1e-4) is None
