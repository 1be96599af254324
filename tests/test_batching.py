"""Concurrent forward requests are merged into fewer module calls, with the same outputs as alone."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from swarm.model import ModelConfig, build_stage
from swarm.server.batching import ForwardBatcher

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_heads=2, seq_len=16)


async def test_concurrent_forwards_are_merged_and_exact():
    stage = build_stage(MODEL, 0, 2, seed=0)
    executor = ThreadPoolExecutor(max_workers=1)
    gate = threading.Event()
    executor.submit(gate.wait)  # the compute thread is busy while requests arrive
    batcher = ForwardBatcher(lambda x: stage(x).detach(), executor, max_samples=64)
    requests = [torch.randint(0, 256, (b, 16)) for b in (1, 4, 3, 8)] + [torch.randint(0, 256, (2, 8))]
    tasks = [asyncio.ensure_future(batcher.forward(x)) for x in requests]
    await asyncio.sleep(0.05)
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
    await asyncio.sleep(0.05)
    gate.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert calls == [10, 7]
    assert torch.equal(results[0], torch.full((6, 3), 2.0)) and torch.equal(results[1], torch.full((4, 3), 2.0))
    assert isinstance(results[2], ValueError)
    executor.shutdown()
