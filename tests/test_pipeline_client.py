"""PipelineClient without a network: a lower stage's backward is retried, not dropped."""

import asyncio

import pytest
import torch

from swarm.client.ledger import Contribution, Ledger
from swarm.client.pipeline import PipelineClient, StageUnavailable, Unauthorized
from swarm.model.gpt import ModelConfig
from swarm.policy.routing import Router


def _client() -> PipelineClient:
    return PipelineClient(None, 2, lambda: [], Router(seed=0), Ledger(), model=ModelConfig(hidden_size=8, num_heads=2),
                          forward_timeout_s=1.0, backward_timeout_s=1.0, max_retries=1)


def _item() -> Contribution:
    return Contribution("t:1", 0, "", 0, 2, torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, 8), None)


@pytest.fixture
def no_sleep(monkeypatch):
    async def instant(_):
        return None
    monkeypatch.setattr(asyncio, "sleep", instant)


async def test_lower_stage_backward_is_retried(no_sleep):
    client, failures = _client(), [StageUnavailable("stage 0 empty"), StageUnavailable("stage 0 moving")]
    hints = []

    async def flaky(item, resend=False, prefer=None, clock_step=None):
        hints.append(clock_step)
        if failures:
            raise failures.pop(0)
        return {"step": 3}

    client.backward = flaky
    assert await client._backward_persistently(_item(), clock_step=7) == {"step": 3}
    assert failures == []
    assert hints == [7, 7, 7], "every retry tells the replica where the clock stage put the micro-batch"


async def test_lower_stage_backward_gives_up_after_its_rounds(no_sleep):
    client, calls = _client(), []

    async def dead(item, resend=False, prefer=None, clock_step=None):
        calls.append(item.stage)
        raise StageUnavailable("stage 0 has no replicas")

    client.backward = dead
    with pytest.raises(StageUnavailable):
        await client._backward_persistently(_item(), rounds=3)
    assert calls == [0, 0, 0]


async def test_lower_stage_backward_is_not_retried_when_refused(no_sleep):
    client, calls = _client(), []

    async def refused(item, resend=False, prefer=None, clock_step=None):
        calls.append(item.stage)
        raise Unauthorized("not in the allowlist")

    client.backward = refused
    with pytest.raises(Unauthorized):
        await client._backward_persistently(_item(), rounds=3)
    assert calls == [0]
