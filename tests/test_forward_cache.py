"""A backward served from a cached training forward computes exactly what a recomputing one does, and the
cache drops what it may no longer use: graphs built on old parameters or from other inputs, and the oldest
entries beyond its byte bound."""

from __future__ import annotations

from typing import List, Optional, Tuple

import pytest
import torch

from swarm.config.settings import PeerConfig, RunConfig
from swarm.model.gpt import ModelConfig
from swarm.server.forward_cache import ForwardCache
from swarm.server.runner import StageRunner

MODEL = ModelConfig(num_layers=3, hidden_size=32, num_heads=2, seq_len=16)
RUN = RunConfig(num_stages=3, target_batch_size=10_000, model=MODEL)
CACHE_BYTES = 64 * 2**20


def _runner(stage: int, cache_bytes: int = CACHE_BYTES) -> StageRunner:
    return StageRunner(RUN, stage, forward_cache_bytes=cache_bytes)


def _inputs(stage: int, seed: int = 0, batch: int = 4) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if stage == 0:
        return torch.randint(0, MODEL.vocab_size, (batch, MODEL.seq_len), generator=generator)
    return torch.randn(batch, MODEL.seq_len, MODEL.hidden_size, generator=generator)


def _grad_outputs(seed: int = 1, batch: int = 4) -> torch.Tensor:
    return torch.randn(batch, MODEL.seq_len, MODEL.hidden_size, generator=torch.Generator().manual_seed(seed))


def _gradients(runner: StageRunner) -> List[torch.Tensor]:
    return runner.export(with_gradients=True)["gradients"]


def _backward(runner: StageRunner, key: str, inputs: torch.Tensor, accumulate: bool = True
              ) -> Tuple[Optional[torch.Tensor], List[torch.Tensor]]:
    grad_inputs, _, _ = runner.backward(key, inputs, _grad_outputs(), accumulate=accumulate)
    return grad_inputs, _gradients(runner)


@pytest.mark.parametrize("stage", [0, 1])
def test_a_cache_hit_computes_what_a_recomputation_computes(stage):
    cached, recomputed = _runner(stage), _runner(stage, cache_bytes=0)
    x = _inputs(stage)
    outputs = cached.forward_train("t:1", x)
    assert torch.equal(outputs, recomputed.forward_train("t:1", x)), "a training forward returns the plain forward"
    assert "t:1" in cached.forward_cache and len(recomputed.forward_cache) == 0

    hit_inputs, hit_grads = _backward(cached, "t:1", x)
    miss_inputs, miss_grads = _backward(recomputed, "t:1", x)
    assert cached.forward_cache.hits == 1 and cached.num_recomputed == 0 and cached.num_forwards == 1
    assert recomputed.num_recomputed == 1 and recomputed.num_forwards == 2
    assert len(cached.forward_cache) == 0 and cached.forward_cache.nbytes == 0, "an entry is freed on use"
    if stage == 0:
        assert hit_inputs is None and miss_inputs is None
    else:
        assert torch.equal(hit_inputs, miss_inputs)
    assert len(hit_grads) == len(miss_grads) and all(torch.equal(a, b) for a, b in zip(hit_grads, miss_grads))
    assert cached.samples_pending == recomputed.samples_pending == 4


def test_a_step_between_forward_and_backward_makes_the_backward_recompute_on_the_new_parameters():
    runner, reference = _runner(1), _runner(1)
    x = _inputs(1)
    runner.forward_train("t:1", x)
    for r in (runner, reference):  # the same step on both: a gradient of another micro-batch
        r.backward("t:0", _inputs(1, seed=5), _grad_outputs(seed=6))
        frozen = r.freeze()
        r.apply(frozen.mean_grads, frozen.samples)
    assert len(runner.forward_cache) == 0 and runner.forward_cache.invalidated == 1, "a step frees every entry"
    assert torch.equal(runner.forward(x), reference.forward(x))
    grad_inputs, grads = _backward(runner, "t:1", x)
    expected_inputs, expected = _backward(reference, "t:1", x)
    assert runner.forward_cache.hits == 0 and runner.num_recomputed == 2
    assert torch.equal(grad_inputs, expected_inputs) and all(torch.equal(a, b) for a, b in zip(grads, expected))


def test_a_loaded_state_invalidates_cached_forwards():
    runner, source = _runner(1), _runner(1)
    with torch.no_grad():
        for p in source.params:
            p.add_(0.5)
    runner.forward_train("t:1", _inputs(1))
    runner.load_state(source.state_metadata(), source.state_tensors())
    assert len(runner.forward_cache) == 0
    runner.backward("t:1", _inputs(1), _grad_outputs())
    assert runner.forward_cache.hits == 0 and runner.num_recomputed == 1


def test_other_inputs_under_the_same_id_are_recomputed_from_what_the_request_carries():
    runner, reference = _runner(1), _runner(1, cache_bytes=0)
    runner.forward_train("t:1", _inputs(1, seed=0))
    other = _inputs(1, seed=3)
    grad_inputs, grads = _backward(runner, "t:1", other)
    expected_inputs, expected = _backward(reference, "t:1", other)
    assert runner.forward_cache.mismatched == 1 and runner.forward_cache.hits == 0 and runner.num_recomputed == 1
    assert torch.equal(grad_inputs, expected_inputs) and all(torch.equal(a, b) for a, b in zip(grads, expected))


def test_a_verification_backward_recomputes_and_leaves_the_entry_for_the_real_one():
    runner = _runner(1)
    x = _inputs(1)
    runner.forward_train("t:1", x)
    runner.backward("t:1", x, _grad_outputs(), accumulate=False)
    assert "t:1" in runner.forward_cache and runner.num_recomputed == 1 and runner.samples_pending == 0
    runner.backward("t:1", x, _grad_outputs())
    assert runner.forward_cache.hits == 1 and runner.samples_pending == 4


def test_the_byte_bound_evicts_the_oldest_entries():
    probe = _runner(1)
    probe.forward_train("t:size", _inputs(1))
    entry_bytes = probe.forward_cache.nbytes
    activations = MODEL.seq_len * MODEL.hidden_size * 4 * 4  # one hidden-state tensor of the batch
    assert entry_bytes > 2 * activations, "an entry counts the activations autograd keeps, not just its output"

    runner = _runner(1, cache_bytes=int(2.5 * entry_bytes))
    for i in range(4):
        runner.forward_train(f"t:{i}", _inputs(1, seed=i))
        assert runner.forward_cache.nbytes <= runner.forward_cache.max_bytes
    assert [f"t:{i}" in runner.forward_cache for i in range(4)] == [False, False, True, True]
    assert runner.forward_cache.evicted == 2
    runner.backward("t:0", _inputs(1, seed=0), _grad_outputs())  # evicted: recomputed, still counted
    assert runner.num_recomputed == 1 and runner.samples_pending == 4

    tiny = _runner(1, cache_bytes=entry_bytes // 2)  # an entry that cannot fit at all is not kept
    tiny.forward_train("t:0", _inputs(1))
    assert len(tiny.forward_cache) == 0 and tiny.forward_cache.nbytes == 0


def test_leaving_and_disabling_keep_nothing():
    runner = _runner(1)
    runner.forward_train("t:1", _inputs(1))
    runner.drop_cached_forwards()
    assert len(runner.forward_cache) == 0 and runner.forward_cache.nbytes == 0
    off = _runner(1, cache_bytes=0)
    off.forward_train("t:1", _inputs(1))
    assert not off.forward_cache.enabled and len(off.forward_cache) == 0
    assert not _runner(2).forward_cache.enabled, "the last stage's forward and backward are one call"


def test_cache_and_config_validation():
    with pytest.raises(ValueError):
        ForwardCache(-1)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="forward_cache_mb"):
            PeerConfig(forward_cache_mb=bad)
    assert PeerConfig().forward_cache_mb > 0
