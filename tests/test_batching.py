"""Concurrent forward and backward requests are merged into fewer module calls, with the same results as alone."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Tuple

import pytest
import torch

from swarm.config.settings import RunConfig
from swarm.model.gpt import ModelConfig
from swarm.model.stages import build_stage
from swarm.policy.poisoning import PoisoningConfig
from swarm.server.batching import ForwardBatcher
from swarm.server.runner import StageRunner
from tests.utils.waiting import await_until

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_heads=2, seq_len=16)


async def _all_queued(batcher, count: int) -> None:
    """Every request is in the batcher's queue while the gate holds the compute thread: they can merge."""
    await await_until(lambda: len(batcher) == count, 10, f"{count} requests to queue in the batcher")


async def test_concurrent_forwards_are_merged_and_exact():
    stage = build_stage(MODEL, 0, 2, seed=0)
    executor = ThreadPoolExecutor(max_workers=1)
    gate = threading.Event()
    executor.submit(gate.wait)  # the compute thread is busy while requests arrive
    batcher = ForwardBatcher(lambda x: stage(x).detach(), executor, max_samples=64)
    requests = [torch.randint(0, 256, (b, 16)) for b in (1, 4, 3, 8)] + [torch.randint(0, 256, (2, 8))]
    tasks = [asyncio.ensure_future(batcher.forward(x)) for x in requests]
    await _all_queued(batcher, len(tasks))
    gate.set()
    outputs = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
    with torch.no_grad():
        for x, out in zip(requests, outputs):
            torch.testing.assert_close(out, stage(x), atol=1e-5, rtol=1e-5)
    assert batcher.num_requests == 5
    assert batcher.num_calls == 2, "four requests of length 16 in one call, the length-8 one alone"
    executor.shutdown()


async def test_max_samples_splits_batches_and_errors_reach_their_requests():
    executor = ThreadPoolExecutor(max_workers=1)
    calls = []

    def forward(x):
        calls.append(x.shape[0])
        if x.shape[0] == 7:
            raise ValueError("boom")
        return x * 2

    gate = threading.Event()
    executor.submit(gate.wait)
    batcher = ForwardBatcher(forward, executor, max_samples=10)
    tasks = [asyncio.ensure_future(batcher.forward(torch.ones(n, 3))) for n in (6, 4, 7)]
    await _all_queued(batcher, len(tasks))
    gate.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert calls == [10, 7]
    assert torch.equal(results[0], torch.full((6, 3), 2.0)) and torch.equal(results[1], torch.full((4, 3), 2.0))
    assert isinstance(results[2], ValueError)
    executor.shutdown()


RUN = RunConfig(num_stages=2, model=MODEL)


def _gated_executor() -> Tuple[ThreadPoolExecutor, threading.Event]:
    """A compute thread kept busy until the gate opens, so that requests queue up and merge."""
    executor = ThreadPoolExecutor(max_workers=1)
    gate = threading.Event()
    executor.submit(gate.wait)
    return executor, gate


def _last_stage_requests(sizes, generator):
    return [(torch.randn(b, 16, 32, generator=generator), torch.randint(0, 256, (b, 16), generator=generator))
            for b in sizes]


async def test_last_stage_forwards_are_merged_and_each_gets_its_own_loss():
    # the merged call sums its tokens' losses in another order and runs larger matmuls: float32 rounding only
    runner = StageRunner(RUN, 1)
    requests = _last_stage_requests((1, 4, 3, 8), torch.Generator().manual_seed(0))
    alone = [float(runner.forward(x, t)) for x, t in requests]
    executor, gate = _gated_executor()
    batcher = ForwardBatcher(runner.forward_per_sample, executor, max_samples=64)
    forwards_before = runner.num_forwards
    tasks = [asyncio.ensure_future(batcher.forward(x, t)) for x, t in requests]
    await _all_queued(batcher, len(tasks))
    gate.set()
    per_token = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
    for (x, _), losses, expected in zip(requests, per_token, alone):
        assert losses.shape == x.shape[:2]
        assert float(losses.mean()) == pytest.approx(expected, rel=1e-6)
    assert batcher.num_calls == 1 and runner.num_forwards - forwards_before == 1, "four requests, one module call"
    executor.shutdown()


async def test_a_malformed_request_fails_alone_in_a_merged_forward():
    runner = StageRunner(RUN, 1)
    requests = _last_stage_requests((2, 2, 2), torch.Generator().manual_seed(1))
    requests[1] = (requests[1][0], torch.full((2, 16), 300))  # token ids beyond the vocabulary
    executor, gate = _gated_executor()
    batcher = ForwardBatcher(runner.forward_per_sample, executor, max_samples=64)
    tasks = [asyncio.ensure_future(batcher.forward(x, t)) for x, t in requests]
    await _all_queued(batcher, len(tasks))
    gate.set()
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=30)
    assert isinstance(results[1], ValueError) and "token ids" in str(results[1])
    for i in (0, 2):
        assert float(results[i].mean()) == pytest.approx(float(runner.forward(*requests[i])), rel=1e-6)
    assert batcher.num_calls == 4, "the merged call failed, then each request ran once alone"
    executor.shutdown()


def _backward_requests(stage: int, count: int, generator: torch.Generator):
    requests = []
    for i in range(count):
        x = torch.randint(0, 256, (4, 16), generator=generator) if stage == 0 else torch.randn(4, 16, 32, generator=generator)
        targets = torch.randint(0, 256, (4, 16), generator=generator) if stage == 1 else None
        grad_outputs = torch.randn(4, 16, 32, generator=generator) if stage == 0 else None
        requests.append((f"trainer{i % 3}:m{i}", x, grad_outputs, targets))
    return requests


@pytest.mark.parametrize("stage", [0, 1], ids=["first_stage", "last_stage"])
@pytest.mark.parametrize("clip", [None, 1e-3], ids=["warm_up", "every_micro_batch_clipped"])
def test_merged_backward_matches_one_by_one(stage, clip):
    # vmap runs the same per-request computation as batched matmuls: equal up to float32 rounding (1e-6)
    poisoning = PoisoningConfig(max_grad_norm=clip)
    alone, merged = (StageRunner(RUN, stage, poisoning=poisoning) for _ in range(2))
    requests = _backward_requests(stage, 5, torch.Generator().manual_seed(2))
    expected = [alone.backward(*request) for request in requests]
    results = merged.backward_batch(requests)
    for (grad_inputs, loss, step), result in zip(expected, results):
        assert not isinstance(result, Exception), result
        if stage == 0:
            assert grad_inputs is None and result[0] is None
        else:
            torch.testing.assert_close(result[0], grad_inputs, atol=1e-6, rtol=1e-5)
            assert result[1] == pytest.approx(loss, rel=1e-6)
        assert result[2] == step
    assert merged.num_forwards == 1 and merged.num_recomputed == 5, "five requests, one forward, none twice"
    if clip is not None:
        assert merged.guard.clipped == alone.guard.clipped == 5, "each micro-batch meets the bound on its own"
    a, b = alone.freeze(), merged.freeze()
    assert a.samples == b.samples == 20 and a.micro_batch_ids == b.micro_batch_ids
    for x, y in zip(a.mean_grads, b.mean_grads):
        torch.testing.assert_close(y, x, atol=1e-7, rtol=1e-5)


def test_merged_backward_runs_cached_duplicate_and_malformed_requests_alone():
    runner = StageRunner(RUN, 0, forward_cache_bytes=2**24)
    requests = _backward_requests(0, 4, torch.Generator().manual_seed(3))
    runner.forward_train(requests[0][0], requests[0][1])  # its graph is kept: the backward must reuse it
    requests.append(requests[1])  # the same micro-batch again: accounted once
    requests.append((requests[2][0].replace("m", "bad"), requests[2][1], torch.zeros(4, 16, 31), None))
    results = runner.backward_batch(requests)
    assert isinstance(results[5], ValueError) and "grad_outputs" in str(results[5])
    assert all(not isinstance(r, Exception) for r in results[:5])
    assert runner.forward_cache.stats()["hits"] == 1
    # the training forward, one merged forward (requests 1-3 and the malformed one, refused by its grad_outputs'
    # shape after that forward), one recomputation for the duplicate
    assert runner.num_forwards == 3
    assert runner.freeze().samples == 16, "four distinct micro-batches of 4 samples"


def test_a_request_with_bad_grad_outputs_fails_alone_in_a_merged_backward():
    runner = StageRunner(RUN, 0)
    requests = _backward_requests(0, 3, torch.Generator().manual_seed(4))
    requests[1] = (requests[1][0], requests[1][1], torch.full((4, 16, 32), float("nan")), None)
    results = runner.backward_batch(requests)
    assert isinstance(results[1], ValueError) and "NaN" in str(results[1])
    assert not isinstance(results[0], Exception) and not isinstance(results[2], Exception)
    assert runner.num_forwards == 1 and runner.freeze().samples == 8
