"""Narrow stage boundaries (``model.boundary_dim``): the learned projections at the ends of a stage, what travels
between stages, the checks on it, and the checkpoints of such a model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from swarm.client.pipeline import check_reply
from swarm.config.settings import RunConfig
from swarm.dht.manifest import run_hash
from swarm.model.footprint import activation_bytes
from swarm.model.gpt import ModelConfig
from swarm.model.hf_checkpoint import CheckpointError, export_checkpoint, load_stage_from_checkpoint
from swarm.model.stages import FullModel, build_stage
from swarm.net.compression import compress

GPT = ModelConfig(num_layers=3, hidden_size=32, num_heads=2, seq_len=16, boundary_dim=8)
LLAMA = dataclasses.replace(GPT, architecture="llama", num_kv_heads=1)


def _tokens(config: ModelConfig, batch: int = 3) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (batch, config.seq_len), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("config", [GPT, LLAMA], ids=["gpt", "llama"])
def test_stages_send_boundary_dim_values_a_token_and_the_halves_start_as_a_pair(config):
    stages = [build_stage(config, index, 3, seed=4) for index in range(3)]
    tokens = _tokens(config)
    sent = stages[0](tokens)
    assert sent.shape == (3, config.seq_len, 8)
    assert stages[1](sent).shape == (3, config.seq_len, 8)
    assert stages[2](stages[1](sent), tokens).ndim == 0
    assert not hasattr(stages[0], "boundary_in") and not hasattr(stages[2], "boundary_out")
    for sender, receiver in zip(stages, stages[1:]):
        assert torch.equal(sender.boundary_out.weight, receiver.boundary_in.weight.T)
    # replicas of a stage start identical; another seed draws another subspace
    assert torch.equal(build_stage(config, 1, 3, seed=4).boundary_in.weight, stages[1].boundary_in.weight)
    assert not torch.equal(build_stage(config, 1, 3, seed=5).boundary_in.weight, stages[1].boundary_in.weight)
    # the pair starts close to a projection: what is sent keeps a share of about boundary_dim / hidden_size
    hidden = torch.randn(4096, config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        kept = float(stages[1].boundary_in(stages[0].boundary_out(hidden)).norm() ** 2 / hidden.norm() ** 2)
    assert 0.5 * 8 / 32 < kept < 2.0 * 8 / 32


@pytest.mark.parametrize("config", [GPT, LLAMA], ids=["gpt", "llama"])
def test_the_narrow_model_learns_through_its_boundaries(config):
    model = FullModel(config, 3, seed=0)
    tokens = _tokens(config, batch=8)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = float(model(tokens, tokens))
    before = [s.boundary_out.weight.clone() for s in model.stages[:2]]
    for _ in range(30):
        optimizer.zero_grad()
        model(tokens, tokens).backward()
        optimizer.step()
    assert float(model(tokens, tokens)) < first - 1.0
    assert all(not torch.equal(b, s.boundary_out.weight) for b, s in zip(before, model.stages[:2]))


def test_a_stage_refuses_hidden_states_of_the_wrong_width():
    stage = build_stage(GPT, 1, 3, seed=0)
    stage.check_inputs(torch.zeros(2, 16, 8), None)
    with pytest.raises(ValueError, match=r"hidden states must be \[batch, seq, 8\], got shape \(2, 16, 32\)"):
        stage.check_inputs(torch.zeros(2, 16, 32), None)


def test_a_trainer_checks_replies_at_the_wire_width():
    inputs = torch.zeros(2, 16, dtype=torch.long)
    ok = dict(method="forward", stage=0, num_stages=3, inputs=inputs, wire_width=8)
    assert check_reply({"outputs": torch.zeros(2, 16, 8)}, **ok) is None
    assert "shape" in check_reply({"outputs": torch.zeros(2, 16, 32)}, **ok)


@pytest.mark.parametrize(("changes", "message"), [
    ({"boundary_dim": 32}, "must be less than hidden_size"),
    ({"boundary_dim": -1}, "boundary_dim must be a non-negative int"),
    ({"boundary_dim": 2.5}, "boundary_dim must be a non-negative int"),
])
def test_bad_boundary_dims_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(GPT, **changes)


def test_a_run_hashes_as_before_without_a_boundary_and_differently_with_one():
    plain = RunConfig(num_stages=3, model=dataclasses.replace(GPT, boundary_dim=0))
    narrow = RunConfig(num_stages=3, model=GPT)
    assert run_hash(plain) != run_hash(narrow)
    assert run_hash(plain) == run_hash(RunConfig(num_stages=3, model=dataclasses.replace(GPT, boundary_dim=0)))
    with pytest.raises(ValueError, match="a 1-stage run has none"):
        RunConfig(num_stages=1, model=GPT)


def test_wire_bytes_and_memory_follow_the_width():
    wide = torch.randn(1, 64, 1024)
    narrow = torch.randn(1, 64, 256)
    assert len(compress(narrow, "int8").data) * 4 == len(compress(wide, "int8").data)
    plain = dataclasses.replace(GPT, boundary_dim=0)
    assert activation_bytes(GPT, 3, 1, batch_size=2) > activation_bytes(plain, 3, 1, batch_size=2)


def test_a_narrow_gpt_exports_and_loads_only_with_its_cut(tmp_path):
    model = FullModel(GPT, 3, seed=3)
    export_checkpoint(GPT, [stage.state_dict() for stage in model.stages], tmp_path)
    stages = [load_stage_from_checkpoint(tmp_path, GPT, index, 3) for index in range(3)]
    tokens = _tokens(GPT)
    with torch.no_grad():
        assert torch.equal(stages[2].logits(stages[1](stages[0](tokens))), model.logits(tokens))
    recut = dataclasses.replace(GPT, stage_layers=[2, 1])
    with pytest.raises(CheckpointError, match=r"before layers \[1, 2\], this run's cut .* before layers \[2\]"):
        load_stage_from_checkpoint(tmp_path, recut, 0, 2)
    with pytest.raises(CheckpointError, match=r"before layers \[1, 2\], this run's cut .* before layers \[\]"):
        load_stage_from_checkpoint(tmp_path, GPT, 0, 1)
    with pytest.raises(CheckpointError, match="the checkpoint has boundary_dim 8, the run's model 0"):
        load_stage_from_checkpoint(tmp_path, dataclasses.replace(GPT, boundary_dim=0), 0, 3)


def test_a_narrow_llama_is_not_exported_as_a_hugging_face_llama(tmp_path):
    model = FullModel(LLAMA, 3, seed=3)
    with pytest.raises(CheckpointError, match="LlamaForCausalLM has no place for"):
        export_checkpoint(LLAMA, [stage.state_dict() for stage in model.stages], tmp_path / "out")
