"""A micro-batch through remote stages computes exactly what the local model computes, whether stage 0's
backward reuses the graph of its training forward (a cache hit) or recomputes it."""

from __future__ import annotations

import pytest
import torch

from swarm.model.gpt import ModelConfig
from swarm.model.stages import FullModel
from tests.utils.probe import online

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_heads=2, seq_len=16)


@pytest.mark.parametrize("cached", [True, False], ids=["cache_hit", "recomputed"])
async def test_remote_pipeline_matches_local_model(launcher, probe, cached):
    # no global step during the test
    launcher.wait_ready([launcher.peer(stage, target_batch_size=10_000, wait=False) for stage in (0, 1)])
    records = await probe.wait_for(lambda r: all(online(r, s) for s in (0, 1)), 30, "both stages online")
    first, last = online(records, 0)[0].peer_id, online(records, 1)[0].peer_id

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (4, 16), generator=generator)
    targets = torch.randint(0, 256, (4, 16), generator=generator)
    local = FullModel(MODEL, num_stages=2, seed=0)
    hidden = local.stages[0](tokens)
    hidden.retain_grad()
    loss = local.stages[1](hidden, targets)
    loss.backward()

    forward = {"stage": 0, "inputs": tokens, **({"micro_batch_id": f"{probe.peer_id}:m0"} if cached else {})}
    remote_hidden = (await probe.call(first, "forward", forward))["outputs"]
    torch.testing.assert_close(remote_hidden, hidden.detach(), atol=1e-5, rtol=0)
    reply = await probe.call(last, "backward", {"stage": 1, "micro_batch_id": f"{probe.peer_id}:m0", "inputs": remote_hidden,
                                                  "targets": targets})
    assert abs(reply["loss"] - loss.item()) < 1e-5
    torch.testing.assert_close(reply["grad_inputs"], hidden.grad, atol=1e-5, rtol=0)
    await probe.call(first, "backward", {"stage": 0, "micro_batch_id": f"{probe.peer_id}:m0", "inputs": tokens,
                                          "grad_outputs": reply["grad_inputs"]})

    for stage, peer_id in ((0, first), (1, last)):
        exported = await probe.call(peer_id, "parameters", {"gradients": True})
        assert exported["samples_pending"] == 4
        local_grads = [p.grad for p in local.stages[stage].parameters()]
        assert len(exported["gradients"]) == len(local_grads)
        for remote_grad, local_grad in zip(exported["gradients"], local_grads):
            torch.testing.assert_close(remote_grad, local_grad, atol=1e-5, rtol=0)
    compute = (await probe.call(first, "info", {}))["compute"]
    assert compute["forward_cache"]["hits"] == int(cached)
    assert compute["recomputed"] == 1 - int(cached) and compute["forwards"] == 2 - int(cached)
