"""Robust averaging rounds of real StageAveragers on 127.0.0.1: a lying member is dropped and banned,
and the honest members end with identical, finite results; without the defence the same lie gets in."""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Dict, List, Optional

import pytest
import torch

from swarm.config.settings import NetworkConfig
from swarm.dht.node import start_dht
from swarm.policy.aggregation import AggregationConfig, robust_aggregate
from swarm.server.averaging import RoundResult, StageAverager
from swarm.server.faults import FaultyAverager, GradientFault

SHAPES = [torch.zeros(64, 8), torch.zeros(32)]
SAMPLES = 16


class Group:
    """Four DHT nodes with an averager each; ``close()`` shuts every process down."""

    def __init__(self, faults: List[str], robust: bool, prefix: str, compression: str = "none",
                 matchmaking_time: float = 2.0):
        self.dhts, self.averagers = [], []
        try:
            for fault in faults:
                network = NetworkConfig(initial_peers=self._initial_peers())
                dht = start_dht(network)
                self.dhts.append(dht)
                averager = StageAverager if fault == "none" else functools.partial(FaultyAverager, fault=fault)
                self.averagers.append(averager(
                    SHAPES, lambda: ({}, []), dht=dht, start=True, prefix=prefix, min_group_size=2,
                    min_matchmaking_time=matchmaking_time, request_timeout=1.0, allreduce_timeout=30.0,
                    next_chunk_timeout=6.0,
                    initial_group_bits="0" * 16, aggregation=AggregationConfig() if robust else None,
                    signing_key=dht.identity.private_key, compression=compression))
        except BaseException:
            self.close()
            raise

    def _initial_peers(self) -> List[str]:
        return [str(a) for a in self.dhts[0].get_visible_maddrs()] if self.dhts else []

    async def round(self, grads: List[List[torch.Tensor]], samples: Optional[List[int]] = None, *,
                    full: Optional[int] = None, matchmaking_timeout: float = 8.0) -> List[Optional[RoundResult]]:
        samples = samples or [SAMPLES] * len(grads)
        return list(await asyncio.gather(*(
            averager.average(0, g, n, {"step": 0, "samples": n}, matchmaking_timeout=matchmaking_timeout, timeout=30.0,
                             full_group_size=full)
            for averager, g, n in zip(self.averagers, grads, samples))))

    def close(self) -> None:
        for averager in self.averagers:
            if averager.is_alive():
                averager.shutdown()
        for dht in self.dhts:
            if dht.is_alive():
                dht.shutdown()


def honest_grads(seed: int) -> List[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    base = [torch.randn(s.shape, generator=torch.Generator().manual_seed(0)) for s in SHAPES]
    return [b + 0.3 * torch.randn(b.shape, generator=generator) for b in base]


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])


@pytest.fixture
def group_factory():
    groups: List[Group] = []

    def make(faults: List[str], robust: bool = True, compression: str = "none", matchmaking_time: float = 2.0) -> Group:
        groups.append(Group(faults, robust, prefix=f"robust{len(groups)}", compression=compression,
                            matchmaking_time=matchmaking_time))
        return groups[-1]

    try:
        yield make
    finally:
        for group in groups:
            group.close()


def test_a_weight_liar_that_computed_nothing_attacks_with_its_last_gradient():
    """A step with no samples leaves a replica's gradient at zero; the emulated x1000 attackers send their last
    gradient instead (x1000 of zero would be no attack at all), and still claim the whole step's weight."""
    gradient, nothing = [torch.ones(3), torch.full((2,), 2.0)], [torch.zeros(3), torch.zeros(2)]
    flipper = GradientFault("sign_flip_gradients")
    assert all(torch.equal(a, -1000.0 * g) for a, g in zip(flipper.corrupt(gradient), gradient))
    assert all(torch.equal(a, -1000.0 * g) for a, g in zip(flipper.corrupt(nothing), gradient))
    assert flipper.claimed_samples(0, 256) == 256.0
    randomiser = GradientFault("random_gradients")
    randomiser.corrupt(gradient)
    norm = float(torch.sqrt(sum(a.pow(2).sum() for a in randomiser.corrupt(nothing))))
    assert norm == pytest.approx(1000.0 * float(torch.sqrt(sum(g.pow(2).sum() for g in gradient))), rel=1e-5)
    assert all(not a.any() for a in GradientFault("none").corrupt(nothing))  # an honest replica sends its zeros
    assert all(not a.any() for a in GradientFault("sign_flip_gradients").corrupt(nothing))  # nothing to repeat yet


async def test_a_full_group_averages_at_once_instead_of_waiting_out_the_matchmaking_time(group_factory):
    """Every replica expected is in the group: nothing is gained by waiting for more, so the round starts
    at once. Without ``full_group_size`` the leader holds the group open for the whole matchmaking time
    (12 s here)."""
    group = group_factory(["none", "none", "none"], matchmaking_time=12.0)
    grads = [honest_grads(i) for i in range(3)]
    started = time.monotonic()
    results = await group.round(grads, full=3, matchmaking_timeout=30.0)
    elapsed = time.monotonic() - started
    assert all(r is not None and len(r.included) == 3 for r in results)
    assert all(torch.equal(flat(results[0].tensors), flat(r.tensors)) for r in results[1:])
    # held open, the group would start after the whole 12 s; everything below that is margin for a loaded machine
    assert elapsed < 10.0, f"the full group waited {elapsed:.1f}s, as if for more members"


def test_a_full_group_is_no_smaller_than_the_smallest_allowed():
    """What ``StageAverager.average`` checks before anything is sent."""
    from swarm.server.averaging import check_group_sizes
    with pytest.raises(ValueError, match="below min_group_size"):
        check_group_sizes(3, 2)
    with pytest.raises(ValueError, match="at least 2 members"):
        check_group_sizes(1, None)
    check_group_sizes(2, None)
    check_group_sizes(3, 3)


async def test_a_nan_replica_is_dropped_and_banned_and_the_others_agree(group_factory):
    group = group_factory(["none", "none", "none", "nan_gradients"], robust=True)
    attacker = str(group.dhts[3].peer_id)
    results = await group.round([honest_grads(i) for i in range(4)])
    honest = results[:3]
    for result in honest:
        assert result is not None and bool(torch.isfinite(flat(result.tensors)).all())
        assert attacker in result.banned and "non-finite" in result.banned[attacker]
        assert attacker not in result.included and len(result.included) == 3
    assert all(torch.equal(flat(honest[0].tensors), flat(r.tensors)) for r in honest[1:])
    # each member sent its float32 gradient to the 3 others and received theirs: the averager counted it all
    gradient_bytes = 4 * flat(honest[0].tensors).numel()
    assert all(r.wire_bytes >= 2 * 3 * gradient_bytes for r in honest), [r.wire_bytes for r in honest]
    # banned: in the next round the honest averagers refuse the attacker's join requests and parts
    again = await group.round([honest_grads(10 + i) for i in range(4)])
    for result, before in zip(again[:3], honest):
        assert result is not None and attacker not in result.included
        assert result.wire_bytes >= before.wire_bytes + 2 * 2 * gradient_bytes  # a running total over rounds


async def test_without_the_defence_nan_and_sign_flip_get_in(group_factory):
    """The plain weighted mean (defences off): the same attackers ruin every replica's result."""
    grads = [honest_grads(i) for i in range(4)]
    honest_mean = sum(flat(g) for g in grads[:3]) / 3
    spread = float(torch.linalg.vector_norm(flat(grads[0]) - honest_mean))
    group = group_factory(["none", "none", "none", "nan_gradients"], robust=False)
    results = await group.round(grads)
    assert all(r is not None and not bool(torch.isfinite(flat(r.tensors)).all()) for r in results[:3])
    group.averagers[3]._gradient_fault.fault = "sign_flip_gradients"  # applied in this process, before the round
    results = await group.round(grads)
    assert all(float(torch.linalg.vector_norm(flat(r.tensors) - honest_mean)) > 100 * spread for r in results[:3])


async def test_a_member_sending_different_gradients_to_different_members_is_caught(group_factory):
    """The way to corrupt a group that has no reducers: tell each member something else. The signed
    commitments that members echo to each other prove it, and every honest member drops the liar."""
    group = group_factory(["none", "none", "none", "equivocate_gradients"], robust=True)
    attacker = str(group.dhts[3].peer_id)
    results = await group.round([honest_grads(i) for i in range(4)])
    for result in results[:3]:
        assert result is not None
        assert attacker in result.banned and "two different gradients" in result.banned[attacker], result.banned
        assert attacker not in result.included
    assert all(torch.equal(flat(results[0].tensors), flat(r.tensors)) for r in results[1:3])


async def test_int8_rounds_leave_honest_members_identical_and_still_catch_an_equivocator(group_factory):
    """Gradients travel in int8: each member aggregates the decoded gradients, its own included, so the
    honest members still agree bit for bit; the commitments hash the compressed bytes, so two different
    compressed gradients of one sender are caught as before."""
    grads = [honest_grads(i) for i in range(4)]
    group = group_factory(["none", "none", "none", "equivocate_gradients"], robust=True, compression="int8")
    attacker = str(group.dhts[3].peer_id)
    results = await group.round(grads)
    for result in results[:3]:
        assert result is not None and attacker in result.banned and len(result.included) == 3, result.banned
    assert all(torch.equal(flat(results[0].tensors), flat(r.tensors)) for r in results[1:3])
    honest_mean = sum(flat(g) for g in grads[:3]) / 3
    norm = torch.linalg.vector_norm
    error = float(norm(flat(results[0].tensors) - honest_mean) / norm(honest_mean))
    assert 0 < error < 0.02, error  # lossy, within int8's error


async def test_a_member_with_no_samples_ends_with_what_the_others_average(group_factory):
    """A replica that had no samples this step takes part with weight 0: it sends no values (see
    ``test_robust_round``), and every member, itself included, ends with the robust mean of the others."""
    grads = [honest_grads(i) for i in range(3)] + [[torch.zeros_like(s) for s in SHAPES]]
    group = group_factory(["none"] * 4, robust=True)
    results = await group.round(grads, samples=[SAMPLES, SAMPLES, SAMPLES, 0])
    assert all(result is not None and len(result.included) == 4 for result in results), results
    assert all(torch.equal(flat(results[0].tensors), flat(r.tensors)) for r in results[1:])
    ids = [str(dht.peer_id) for dht in group.dhts[:3]]
    expected = robust_aggregate({p: flat(g).to(torch.float32) for p, g in zip(ids, grads)}, dict.fromkeys(ids, SAMPLES),
                                AggregationConfig())
    assert torch.allclose(flat(results[3].tensors), expected.vector, rtol=1e-5, atol=1e-6)


def noisy_grads(seed: int, noise: float = 1.5) -> List[torch.Tensor]:
    """A replica's gradient of one step: the shared direction plus its own samples' noise (two such gradients'
    cosine is about 1 / (1 + noise^2): 0.3 here, the range of small batches)."""
    generator = torch.Generator().manual_seed(seed)
    base = [torch.randn(s.shape, generator=torch.Generator().manual_seed(0)) for s in SHAPES]
    return [b + noise * torch.randn(b.shape, generator=generator) for b in base]


async def test_a_replica_flipping_its_gradient_at_an_honest_norm_is_banned_after_a_few_rounds(group_factory):
    """One of three negates its gradient at its own norm: no distance shows it, but round after round its
    gradient points against both others'. Both honest members ban it once the record proves it (never before
    the check's minimum of rounds), never ban each other, and average without it afterwards."""
    group = group_factory(["none", "none", "same_norm_sign_flip"], robust=True)
    honest, attacker = [str(d.peer_id) for d in group.dhts[:2]], str(group.dhts[2].peer_id)
    min_rounds = AggregationConfig().alignment.min_rounds
    banned_at: Dict[int, int] = {}  # honest member -> the round it banned the attacker in
    for index in range(min_rounds + 4):
        results = await group.round([noisy_grads(10 * index + i) for i in range(3)], full=3)
        for member, result in enumerate(results[:2]):
            if result is None:  # sat out (a late gradient on a loaded machine): its record lacks this round
                continue
            assert not set(honest) & set(result.banned), result.banned
            if attacker in result.banned:
                assert "pointed against those of 2 of 2 stage-mates" in result.banned[attacker]
                banned_at.setdefault(member, index + 1)
            elif member not in banned_at:
                assert attacker in result.included
        if len(banned_at) == 2:
            break
    # no earlier than the check's minimum of rounds, and at it where a member took part in every round
    assert len(banned_at) == 2 and min(banned_at.values()) >= min_rounds, banned_at
    after = await group.round([noisy_grads(1000 + i) for i in range(3)], full=3)
    assert all(r is not None and attacker not in r.included and sorted(r.included) == sorted(honest) for r in after[:2])


@pytest.mark.long
@pytest.mark.parametrize("fault,replicas,samples", [("sign_flip_gradients", 4, 640), ("same_norm_sign_flip", 3, 1280)])
async def test_a_sign_flipping_replica_leaves_the_loss_within_5_percent_of_clean(launcher, probe, fault, replicas,
                                                                                 samples):
    """Live: one replica of stage 0 sends its gradients x -1000 (of four replicas), or negated at its own norm
    (of three: no distance shows it, only the cosines of many rounds). The honest replicas ban it, and the
    model they train ends as good as single-process training on the same samples."""
    from swarm.training.data import load_corpus, validation_batches
    from swarm.training.single_process import evaluate, train_single_process
    from swarm.model.gpt import ModelConfig
    from swarm.model.stages import FullModel
    from swarm.training.optimizer import OptimizerConfig
    from tests.utils.probe import online

    model_config = ModelConfig(num_layers=2, hidden_size=32, num_heads=2, seq_len=16)
    target, lr = 64, 0.003
    honest = [launcher.peer(0, target_batch_size=target, extra=["--lr", str(lr)], name=f"s0_{i}", wait=False)
              for i in range(replicas - 1)]
    attacker = launcher.peer(0, target_batch_size=target, extra=["--lr", str(lr), "--fault", fault],
                             name="s0_attacker", wait=False)
    clock = launcher.peer(1, target_batch_size=target, extra=["--lr", str(lr)], name="s1", wait=False)
    attacker_id = launcher.wait_ready([*honest, attacker, clock])[replicas - 1]["peer_id"]
    await probe.wait_for(lambda r: len(online(r, 0)) == replicas and len(online(r, 1)) == 1, 40,
                         f"{replicas} + 1 replicas online")
    trainer = launcher.trainer(target_batch_size=target, extra=["--lr", str(lr), "--max_samples", str(samples),
                                                                "--max_in_flight", "2"])
    assert trainer.wait_event("trainer_done", timeout=240)["samples_sent"] == samples
    honest_ids = [p.wait_event("peer_ready", timeout=1)["peer_id"] for p in honest]

    def settled(r) -> bool:
        good = [r[p] for p in honest_ids if p in r]
        return (len(good) == replicas - 1 and len({x.step for x in good} | {x.step for x in online(r, 1)}) == 1
                and not any(x.samples_frozen for x in good) and sum(x.samples_pending for x in online(r, 1)) < target)

    records = await probe.wait_for(settled, 90, "the honest replicas to finish their last global step")
    exported = [await probe.call(p, "parameters", {}) for p in honest_ids]
    for other in exported[1:]:
        assert all(torch.equal(a, b) for a, b in zip(exported[0]["parameters"], other["parameters"]))
    model = FullModel(model_config, num_stages=2, seed=0)
    last = await probe.call(online(records, 1)[0].peer_id, "parameters", {})
    with torch.no_grad():
        for stage, values in ((0, exported[0]["parameters"]), (1, last["parameters"])):
            for param, value in zip(model.stages[stage].parameters(), values):
                param.copy_(value)
    corpus = load_corpus(None, max_bytes=2 * 2**20)
    batches = validation_batches(corpus.validation, model_config.seq_len, batch_size=32, num_batches=8)
    steps = records[honest_ids[0]].step
    applied = records[honest_ids[0]].samples_applied
    local, _ = train_single_process(model_config, 2, 0, OptimizerConfig(lr=lr), batch_size=round(applied / steps),
                                    num_steps=steps, sampler_seed=7, corpus=corpus)
    swarm_loss, local_loss = evaluate(model, batches), evaluate(local, batches)
    initial = evaluate(FullModel(model_config, num_stages=2, seed=0), batches)
    print(f"validation loss: initial {initial:.4f}, swarm with a {fault} replica {swarm_loss:.4f}, "
          f"single process {local_loss:.4f}; {steps} steps, {applied} samples")
    assert initial - local_loss > 0.5
    assert abs(swarm_loss - local_loss) <= 0.05 * local_loss
    assert any(f"excluding {attacker_id} from averaging" in p.log_tail(2000) for p in honest)


async def test_ternary_rounds_agree_send_17x_fewer_gradient_bytes_and_carry_nothing_over(group_factory):
    """Gradients travel as 0 or ±the scale of their block of 64: the honest members still end bit for bit alike,
    each moves 2 x 2 ternary gradients a round instead of float32 ones, the result points where the mean of the
    gradients does, and what a round's encoding missed is not carried into the next: a second round of the same
    gradients gives the same result bit for bit."""
    from swarm.net.ternary import ternary_bytes
    grads = [honest_grads(i) for i in range(3)]
    group = group_factory(["none"] * 3, robust=True, compression="ternary")
    first = await group.round(grads)
    assert all(r is not None and len(r.included) == 3 for r in first), first
    assert all(torch.equal(flat(first[0].tensors), flat(r.tensors)) for r in first[1:])
    # the same round in float32: the difference is the gradients' bytes (the signed headers are alike)
    exact = await group_factory(["none"] * 3, robust=True).round(grads)
    size = flat(grads[0]).numel()
    saved = 2 * 2 * (4 * size - ternary_bytes(size))  # each member sends 2 gradients and receives 2
    for coded, dense in zip(first, exact):
        assert dense is not None and dense.wire_bytes - coded.wire_bytes == pytest.approx(saved, rel=0.05)
    once, dense_mean = flat(first[0].tensors), flat(exact[0].tensors)
    assert float(torch.nn.functional.cosine_similarity(once, dense_mean, dim=0)) > 0.8
    second = await group.round(grads)
    assert all(r is not None and len(r.included) == 3 for r in second), second
    assert torch.equal(once, flat(second[0].tensors))
