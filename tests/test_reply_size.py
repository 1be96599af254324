"""A forward whose reply is too large for a unary call is computed once: the trainer streams it from the start."""

from __future__ import annotations

import asyncio
from typing import Any, Dict

import pytest
import torch
from hivemind.p2p import PeerID

from swarm.client.ledger import Ledger
from swarm.client.pipeline import PipelineClient, encoded_float_bytes
from swarm.config.settings import RunConfig
from swarm.model.gpt import ModelConfig
from swarm.policy.routing import Router
from swarm.policy.snapshot import PeerInfo
from swarm.net.rpc import STREAM_THRESHOLD_BYTES, RPCServicer, call_peer, fits_unary_reply, goes_as_stream
from swarm.server.runner import StageRunner
from tests.test_wire import FakeCaller, LoopbackP2P

MODEL = ModelConfig(num_layers=2, hidden_size=256, num_heads=4, seq_len=128)
BATCH = 32  # 32 x 128 x 256 float32 = 4 MiB of hidden states: more than a unary reply may carry


def _stage0() -> StageRunner:
    return StageRunner(RunConfig(num_stages=2, target_batch_size=10_000, model=MODEL), 0)


def _servicer(runner: StageRunner) -> RPCServicer:
    async def forward(message: Dict[str, Any], caller: str) -> Dict[str, Any]:
        return {"outputs": runner.forward(message["inputs"])}
    return RPCServicer({"forward": forward})


def _tokens() -> torch.Tensor:
    return torch.randint(0, MODEL.vocab_size, (BATCH, MODEL.seq_len), generator=torch.Generator().manual_seed(0))


def test_the_trainer_streams_a_large_forward_reply_up_front_and_the_stage_computes_it_once():
    runner = _stage0()
    client = PipelineClient(LoopbackP2P(_servicer(runner)), 2, lambda: [PeerInfo(PeerID(b"s0").to_base58(), 0)],
                            Router(seed=0), Ledger(), model=MODEL, forward_timeout_s=60.0, backward_timeout_s=60.0,
                            max_retries=1)
    reply, _ = asyncio.run(client.call_stage(0, "forward", {"inputs": _tokens()}, 60.0))
    assert reply["outputs"].shape == (BATCH, MODEL.seq_len, MODEL.hidden_size)
    assert runner.num_forwards == 1


def test_without_the_prediction_the_unary_attempt_wastes_a_forward():
    runner = _stage0()  # what the prediction saves: the server computes, finds the reply too large, computes again
    reply = asyncio.run(call_peer(LoopbackP2P(_servicer(runner)), FakeCaller("s0"), "forward", {"inputs": _tokens()},
                                  timeout=60.0))
    assert reply["outputs"].shape[0] == BATCH and runner.num_forwards == 2


@pytest.mark.parametrize("compression, fits", [("none", False), ("fp16", True), ("int8", True)])
def test_the_predicted_size_follows_the_compression(compression, fits):
    elements = BATCH * MODEL.seq_len * MODEL.hidden_size
    assert fits_unary_reply(encoded_float_bytes(elements, compression, 256)) == fits
    assert fits_unary_reply(encoded_float_bytes(elements // 4, "none", 256))


@pytest.mark.parametrize("compression, streamed", [("none", True), ("fp16", False), ("int8", False)])
def test_a_call_streams_when_its_request_or_its_expected_reply_is_large(compression, streamed):
    elements = 96 * 1024  # 384 KiB in float32, 192 KiB in fp16, 97 KiB in int8
    assert goes_as_stream(100, encoded_float_bytes(elements, compression, 256)) == streamed
    assert goes_as_stream(encoded_float_bytes(elements, compression, 256), 0) == streamed
    assert not goes_as_stream(STREAM_THRESHOLD_BYTES, STREAM_THRESHOLD_BYTES)
    assert goes_as_stream(STREAM_THRESHOLD_BYTES + 1, 0) and goes_as_stream(0, STREAM_THRESHOLD_BYTES + 1)
