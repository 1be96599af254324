"""The Llama architecture: its config, its layers (RMSNorm, RoPE, SwiGLU, grouped-query attention), its stages
chained and cut, and a stage served by the same runner and merged backward as the GPT's."""

import dataclasses
import math

import pytest
import torch

from swarm.config.settings import RunConfig
from swarm.model.footprint import model_parameter_count, stage_parameter_counts
from swarm.model.gpt import ModelConfig
from swarm.model.llama import GroupedQueryAttention, LlamaStage, apply_rotary, hf_parameters, rotary_tables
from swarm.model.stages import FullModel, build_stage, stage_skeleton
from swarm.server.merged_backward import merged_backward
from swarm.server.runner import StageRunner

CONFIG = ModelConfig(architecture="llama", vocab_size=64, seq_len=16, num_layers=4, hidden_size=32, num_heads=4,
                     num_kv_heads=2, intermediate_size=48)


def _tokens(batch: int = 3, seed: int = 0, config: ModelConfig = CONFIG) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (batch, config.seq_len), generator=torch.Generator().manual_seed(seed))


# ---- config ----

@pytest.mark.parametrize("kwargs, message", [
    ({"architecture": "mamba"}, "architecture"),
    ({"architecture": "llama", "num_heads": 4, "num_kv_heads": 3}, "divisible by num_kv_heads"),
    ({"architecture": "llama", "num_kv_heads": -1}, "num_kv_heads"),
    ({"architecture": "llama", "hidden_size": 36, "num_heads": 4}, "must be even"),  # head_dim 9
    ({"architecture": "llama", "intermediate_size": -5}, "intermediate_size"),
    ({"architecture": "llama", "rope_theta": 0.0}, "rope_theta"),
    ({"architecture": "llama", "rope_theta": float("nan")}, "rope_theta"),
    ({"architecture": "llama", "rms_norm_eps": -1e-5}, "rms_norm_eps"),
    ({"architecture": "llama", "tie_embeddings": "yes"}, "tie_embeddings"),
    ({"num_kv_heads": 2}, "grouped-query attention is an architecture llama setting"),
    ({"tie_embeddings": True}, "tie_embeddings is an architecture llama setting"),
])
def test_config_validation_names_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**kwargs)


def test_config_defaults_resolve_per_architecture():
    gpt = ModelConfig(hidden_size=128, num_heads=4)
    assert (gpt.architecture, gpt.kv_heads, gpt.ffn_size, gpt.tie_embeddings) == ("gpt", 4, 512, False)
    assert ModelConfig(num_kv_heads=4, num_heads=4).kv_heads == 4  # explicit multi-head attention is fine for gpt
    llama7b = ModelConfig(architecture="llama", hidden_size=4096, num_heads=32, num_layers=32, vocab_size=32000)
    assert (llama7b.kv_heads, llama7b.ffn_size, llama7b.head_dim) == (32, 11008, 128)  # Llama-7B's widths
    assert ModelConfig(architecture="llama", hidden_size=32, num_heads=4).ffn_size == 256  # rounded up to 256
    assert CONFIG.ffn_size == 48 and CONFIG.kv_heads == 2


# ---- layers ----

def test_grouped_query_attention_equals_multi_head_with_shared_key_value_heads():
    """Each key/value head serves num_heads / kv_heads consecutive query heads: the same as multi-head
    attention whose key and value projections repeat each head's rows that many times."""
    gqa = GroupedQueryAttention(CONFIG)
    mha = GroupedQueryAttention(dataclasses.replace(CONFIG, num_kv_heads=0))
    assert gqa.k_proj.weight.shape == (2 * CONFIG.head_dim, CONFIG.hidden_size)
    assert mha.k_proj.weight.shape == (4 * CONFIG.head_dim, CONFIG.hidden_size)
    with torch.no_grad():
        for name in ("q_proj", "o_proj"):
            getattr(mha, name).weight.copy_(getattr(gqa, name).weight)
        for name in ("k_proj", "v_proj"):
            heads = getattr(gqa, name).weight.view(2, CONFIG.head_dim, CONFIG.hidden_size)
            getattr(mha, name).weight.copy_(heads.repeat_interleave(2, dim=0).reshape(-1, CONFIG.hidden_size))
    x = torch.randn(2, 10, CONFIG.hidden_size)
    cos, sin = rotary_tables(10, CONFIG.head_dim, CONFIG.rope_theta, x.device, x.dtype)
    torch.testing.assert_close(gqa(x, cos, sin), mha(x, cos, sin), rtol=0, atol=1e-6)


def test_rotary_scores_depend_only_on_relative_position():
    head_dim, length = 8, 12
    cos, sin = rotary_tables(length, head_dim, 10000.0, torch.device("cpu"), torch.float64)
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(head_dim, dtype=torch.float64, generator=generator) for _ in range(2))
    rotated_q = apply_rotary(q.expand(1, 1, length, head_dim), cos, sin)[0, 0]
    rotated_k = apply_rotary(k.expand(1, 1, length, head_dim), cos, sin)[0, 0]
    scores = rotated_q @ rotated_k.T  # [query position, key position]
    torch.testing.assert_close(rotated_q[0], q)  # position 0 is not rotated
    torch.testing.assert_close(rotated_q.norm(dim=-1), q.norm().expand(length), rtol=0, atol=1e-6)  # lengths kept
    for offset in (0, 3, 7):
        diagonal = torch.diagonal(scores, offset=-offset)
        torch.testing.assert_close(diagonal, diagonal[0].expand_as(diagonal), rtol=0, atol=1e-5)  # float32 angles
    assert not torch.allclose(scores[5, 5], scores[5, 2])


# ---- stages ----

def test_stage_roles_shapes_and_global_names():
    stages = [build_stage(CONFIG, i, 3, seed=1) for i in range(3)]
    assert all(isinstance(s, LlamaStage) for s in stages)
    assert [(s.is_first, s.is_last) for s in stages] == [(True, False), (False, False), (False, True)]
    assert [sorted(s.model.layers.keys()) for s in stages] == [["0", "1"], ["2"], ["3"]]
    names = hf_parameters(stages[1])
    h, d = CONFIG.hidden_size, CONFIG.head_dim
    assert {n: tuple(p.shape) for n, p in names.items()} == {
        "model.layers.2.self_attn.q_proj.weight": (4 * d, h), "model.layers.2.self_attn.k_proj.weight": (2 * d, h),
        "model.layers.2.self_attn.v_proj.weight": (2 * d, h), "model.layers.2.self_attn.o_proj.weight": (h, 4 * d),
        "model.layers.2.mlp.gate_proj.weight": (48, h), "model.layers.2.mlp.up_proj.weight": (48, h),
        "model.layers.2.mlp.down_proj.weight": (h, 48), "model.layers.2.input_layernorm.weight": (h,),
        "model.layers.2.post_attention_layernorm.weight": (h,)}
    assert "model.embed_tokens.weight" in hf_parameters(stages[0])
    assert {"model.norm.weight", "lm_head.weight"} <= hf_parameters(stages[2]).keys()
    hidden = stages[0](_tokens())
    assert hidden.shape == (3, CONFIG.seq_len, CONFIG.hidden_size) and hidden.dtype == torch.float32
    assert stages[2].logits(stages[1](hidden)).shape == (3, CONFIG.seq_len, CONFIG.vocab_size)
    with pytest.raises(ValueError, match="only the last stage"):
        stages[1].logits(hidden)


def test_replicas_identical_and_global_rng_untouched():
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    a, b = build_stage(CONFIG, 1, 2, seed=7), build_stage(CONFIG, 1, 2, seed=7)
    FullModel(CONFIG, 2, seed=5)
    assert torch.equal(torch.rand(4), expected)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    other = build_stage(CONFIG, 1, 2, seed=8)
    assert not torch.equal(a.model.layers["2"].self_attn.q_proj.weight, other.model.layers["2"].self_attn.q_proj.weight)


def test_chained_stages_equal_full_model_with_gradients_across_the_boundary():
    tokens, targets = _tokens(seed=1), _tokens(seed=2)
    full = FullModel(CONFIG, 2, seed=3)
    stages = [build_stage(CONFIG, i, 2, seed=3) for i in range(2)]
    full_loss = full(tokens, targets)
    remote_hidden = stages[0](tokens)
    received = remote_hidden.detach().requires_grad_(True)
    loss = stages[1](received, targets)
    assert loss.ndim == 0 and torch.equal(loss, full_loss)
    per_token = stages[1](received, targets, reduction="none")
    assert per_token.shape == targets.shape and torch.allclose(per_token.mean(), loss)
    full_loss.backward()
    loss.backward()
    remote_hidden.backward(received.grad)
    for stage, full_stage in zip(stages, full.stages):
        for (name, p), q in zip(stage.named_parameters(), full_stage.parameters()):
            assert p.grad is not None and torch.count_nonzero(p.grad) > 0, name
            assert torch.equal(p.grad, q.grad), name


def test_same_seed_same_network_however_it_is_cut():
    tokens = _tokens()
    uneven = dataclasses.replace(CONFIG, stage_layers=[1, 3])
    reference = FullModel(CONFIG, 1, seed=4).logits(tokens)
    for model in (FullModel(CONFIG, 2, seed=4), FullModel(CONFIG, 4, seed=4), FullModel(uneven, 2, seed=4)):
        torch.testing.assert_close(model.logits(tokens), reference, rtol=0, atol=1e-5)
    loss = FullModel(CONFIG, 2, seed=4)(tokens, tokens)
    assert math.isclose(loss.item(), math.log(CONFIG.vocab_size), rel_tol=0.1)  # near-uniform at init


def test_shorter_sequences_are_causal():
    stage = build_stage(CONFIG, 0, 2, seed=0)
    tokens = _tokens()
    torch.testing.assert_close(stage(tokens)[:, :5], stage(tokens[:, :5]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("stage_index, inputs, targets, message", [
    (0, torch.full((2, 16), 64), None, r"\[0, 64\)"),
    (0, torch.zeros(2, 17, dtype=torch.long), None, "sequence length"),
    (1, torch.zeros(2, 16, 33), None, r"\[batch, seq, 32\]"),
    (1, torch.zeros(2, 16, 32).index_fill_(1, torch.tensor([3]), float("nan")), None, "NaN"),
    (1, torch.zeros(2, 16, 32, dtype=torch.float64), None, "float32"),
    (2, torch.zeros(2, 16, 32), None, "targets are required"),
    (2, torch.zeros(2, 16, 32), torch.zeros(2, 15, dtype=torch.long), "targets shape"),
])
def test_check_inputs_rejects_bad_requests(stage_index, inputs, targets, message):
    stage = build_stage(CONFIG, stage_index, 3, seed=0)
    with pytest.raises(ValueError, match=message):
        stage.check_inputs(inputs, targets)


def test_tied_embeddings_single_stage_only():
    tied = dataclasses.replace(CONFIG, tie_embeddings=True)
    with pytest.raises(ValueError, match="tie_embeddings needs the token embedding and the LM head on one peer"):
        build_stage(tied, 0, 2, seed=0)
    model = FullModel(tied, 1, seed=0)
    stage = model.stages[0]
    assert stage.lm_head.weight is stage.model.embed_tokens.weight
    names = hf_parameters(stage)
    assert names["lm_head.weight"] is names["model.embed_tokens.weight"]
    untied_count = sum(p.numel() for p in FullModel(CONFIG, 1, seed=0).parameters())
    assert sum(p.numel() for p in model.parameters()) == untied_count - CONFIG.vocab_size * CONFIG.hidden_size
    tokens = _tokens()
    model(tokens, tokens).backward()
    assert torch.count_nonzero(stage.model.embed_tokens.weight.grad) > 0
    skeleton = stage_skeleton(tied, 0, 1)  # tied and unallocated
    assert skeleton.lm_head.weight.is_meta and skeleton.lm_head.weight is skeleton.model.embed_tokens.weight


def test_footprint_counts_llama_stages():
    counts = stage_parameter_counts(CONFIG, 2)
    assert counts == [sum(p.numel() for p in build_stage(CONFIG, s, 2, seed=0).parameters()) for s in range(2)]
    tied = dataclasses.replace(CONFIG, tie_embeddings=True)
    assert model_parameter_count(tied) == sum(counts) - CONFIG.vocab_size * CONFIG.hidden_size
    h, f, kv = CONFIG.hidden_size, CONFIG.ffn_size, CONFIG.kv_heads * CONFIG.head_dim
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    assert sum(counts) == 2 * CONFIG.vocab_size * h + CONFIG.num_layers * per_layer + h


# ---- served like the GPT ----

@pytest.mark.parametrize("stage_index, num_stages", [(1, 2), (0, 2), (0, 1)])
def test_merged_backward_gives_each_request_its_own_gradients(stage_index, num_stages):
    config = dataclasses.replace(CONFIG, tie_embeddings=num_stages == 1)
    stage = build_stage(config, stage_index, num_stages, seed=2)
    requests = 3
    inputs = torch.stack([_tokens(2, seed=s) for s in range(requests)]) if stage.is_first \
        else torch.randn(requests, 2, CONFIG.seq_len, CONFIG.hidden_size)
    targets = torch.stack([_tokens(2, seed=10 + s) for s in range(requests)]) if stage.is_last else None
    grad_outputs = None if stage.is_last else torch.randn(requests, 2, CONFIG.seq_len, CONFIG.hidden_size)
    merged = merged_backward(stage, inputs, targets,
                             lambda out, ent: torch.ones_like(out) if stage.is_last else grad_outputs)
    params = list(stage.parameters())
    assert len(merged.param_grads) == len(params)
    for k in range(requests):
        x = inputs[k] if stage.is_first else inputs[k].clone().requires_grad_(True)
        out = stage(x, None if targets is None else targets[k])
        wrt = params if stage.is_first else [x] + params
        grads = torch.autograd.grad(out, wrt, None if stage.is_last else grad_outputs[k])
        if not stage.is_first:
            torch.testing.assert_close(merged.grad_inputs[k], grads[0], rtol=1e-4, atol=1e-6)
        for got, want in zip(merged.param_grads, grads[0 if stage.is_first else 1:]):
            torch.testing.assert_close(got[k], want, rtol=1e-4, atol=1e-6)
        if stage.is_last:
            torch.testing.assert_close(merged.losses[k], out)


def test_stage_runners_build_llama_stages_and_match_the_full_model():
    run = RunConfig(num_stages=2, target_batch_size=8, seed=3, model=CONFIG)
    first, last = StageRunner(run, 0), StageRunner(run, 1)
    assert isinstance(first.module, LlamaStage) and isinstance(last.module, LlamaStage)
    tokens, targets = _tokens(2, seed=1), _tokens(2, seed=2)
    hidden = first.forward(tokens)
    grad_hidden, loss, _ = last.backward("mb", hidden, None, targets)
    first.backward("mb", tokens, grad_hidden)
    assert loss == pytest.approx(FullModel(CONFIG, 2, seed=3)(tokens, targets).item(), abs=1e-6)
    for runner in (first, last):
        exported = runner.export(with_gradients=True)  # what `swarm export` would collect: HF names already
        assert exported["names"] == list(hf_parameters(runner.module)) and exported["samples_pending"] == 2
        assert all(torch.count_nonzero(g) > 0 for g in exported["gradients"])
