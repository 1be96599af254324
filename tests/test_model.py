import math

import pytest
import torch

from swarm.model.gpt import ModelConfig, PipelineStage, StageModule, layer_ranges
from swarm.model.stages import FullModel, build_stage

CONFIG = ModelConfig(vocab_size=256, seq_len=16, num_layers=4, hidden_size=32, num_heads=4)


def _tokens(batch: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (batch, CONFIG.seq_len), generator=torch.Generator().manual_seed(seed))


def _state_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize(
    "num_layers, num_stages, expected",
    [
        (4, 1, [(0, 4)]),
        (4, 2, [(0, 2), (2, 4)]),
        (5, 3, [(0, 2), (2, 4), (4, 5)]),
        (3, 3, [(0, 1), (1, 2), (2, 3)]),
    ],
)
def test_layer_ranges(num_layers, num_stages, expected):
    assert layer_ranges(num_layers, num_stages) == expected


def test_layer_ranges_cover_all_layers_evenly():
    for num_layers in range(1, 13):
        for num_stages in range(1, num_layers + 1):
            ranges = layer_ranges(num_layers, num_stages)
            assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
            assert all(prev[1] == nxt[0] for prev, nxt in zip(ranges, ranges[1:]))
            sizes = [end - start for start, end in ranges]
            assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("num_layers, num_stages", [(4, 5), (4, 0), (0, 1), (4, -1)])
def test_layer_ranges_rejects_bad_counts(num_layers, num_stages):
    with pytest.raises(ValueError, match="num_stages|num_layers"):
        layer_ranges(num_layers, num_stages)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"hidden_size": 30, "num_heads": 4}, "hidden_size"),
        ({"num_layers": 0}, "num_layers"),
        ({"seq_len": -1}, "seq_len"),
        ({"vocab_size": 2.5}, "vocab_size"),
        ({"num_heads": True}, "num_heads"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig(**kwargs)


def test_stage_roles_and_parameters():
    stages = [build_stage(CONFIG, i, 3, seed=1) for i in range(3)]
    assert [(s.is_first, s.is_last) for s in stages] == [(True, False), (False, False), (False, True)]
    assert hasattr(stages[0], "token_embedding") and not hasattr(stages[1], "token_embedding")
    assert hasattr(stages[2], "lm_head") and not hasattr(stages[0], "lm_head")
    assert [len(s.blocks) for s in stages] == [2, 1, 1]
    with pytest.raises(ValueError, match="stage_index"):
        StageModule(CONFIG, 3, 3)


def test_replicas_identical_and_differ_by_stage_and_seed():
    a = build_stage(CONFIG, 1, 2, seed=7)
    b = build_stage(CONFIG, 1, 2, seed=7)
    assert _state_equal(a, b)
    assert not torch.equal(a.blocks[0].attn.qkv.weight, build_stage(CONFIG, 1, 2, seed=8).blocks[0].attn.qkv.weight)
    other_stage = build_stage(CONFIG, 0, 2, seed=7)
    assert not torch.equal(a.blocks[0].attn.qkv.weight, other_stage.blocks[0].attn.qkv.weight)


def test_build_stage_leaves_global_rng_untouched():
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    build_stage(CONFIG, 0, 2, seed=5)
    FullModel(CONFIG, 2, seed=5)
    assert torch.equal(torch.rand(4), expected)


def test_chained_stages_equal_full_model_exactly():
    tokens, targets = _tokens(seed=1), _tokens(seed=2)
    full = FullModel(CONFIG, 2, seed=3)
    stages = [build_stage(CONFIG, i, 2, seed=3) for i in range(2)]
    hidden = stages[0](tokens)
    assert hidden.shape == (3, CONFIG.seq_len, CONFIG.hidden_size) and hidden.dtype == torch.float32
    loss = stages[1](hidden, targets)
    assert loss.ndim == 0
    assert torch.equal(loss, full(tokens, targets))

    # Gradients through a "network boundary": the hidden state detached and re-attached,
    # as a stage server does, must give the same gradients as the chained model.
    full(tokens, targets).backward()
    remote_hidden = stages[0](tokens)
    received = remote_hidden.detach().requires_grad_(True)
    stages[1](received, targets).backward()
    remote_hidden.backward(received.grad)
    for stage, full_stage in zip(stages, full.stages):
        for (name, p), q in zip(stage.named_parameters(), full_stage.parameters()):
            assert p.grad is not None and torch.count_nonzero(p.grad) > 0, name
            assert torch.equal(p.grad, q.grad), name


def test_same_seed_same_network_however_it_is_cut():
    tokens = _tokens()
    losses = [FullModel(CONFIG, n, seed=4)(tokens, tokens) for n in (1, 2, 4)]
    assert torch.allclose(losses[0], losses[1], atol=1e-6) and torch.allclose(losses[0], losses[2], atol=1e-6)


def test_single_stage_model_trains():
    model = FullModel(CONFIG, 1, seed=0)
    assert model.stages[0].is_first and model.stages[0].is_last
    tokens = _tokens()
    loss = model(tokens, tokens)
    assert math.isclose(loss.item(), math.log(CONFIG.vocab_size), rel_tol=0.1)  # near-uniform at init
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_shorter_sequences_are_causal():
    stage = build_stage(CONFIG, 0, 2, seed=0)
    tokens = _tokens()
    full = stage(tokens)
    prefix = stage(tokens[:, :5])
    assert torch.allclose(full[:, :5], prefix, atol=1e-5)


def _good_inputs(stage: PipelineStage, batch: int = 2):
    inputs = _tokens(batch) if stage.is_first else torch.randn(batch, CONFIG.seq_len, CONFIG.hidden_size)
    targets = _tokens(batch) if stage.is_last else None
    return inputs, targets


def test_check_inputs_accepts_good_requests():
    for index in range(2):
        stage = build_stage(CONFIG, index, 2, seed=0)
        stage.check_inputs(*_good_inputs(stage))
    single = build_stage(CONFIG, 0, 1, seed=0)
    single.check_inputs(_tokens(), _tokens())


FIRST, MIDDLE, LAST = 0, 1, 2
H, T = CONFIG.hidden_size, CONFIG.seq_len
_BAD_CASES = {
    "first: float tokens": (FIRST, torch.zeros(2, T), None, "int64"),
    "first: int32 tokens": (FIRST, torch.zeros(2, T, dtype=torch.int32), None, "int64"),
    "first: 1-D tokens": (FIRST, torch.zeros(T, dtype=torch.long), None, r"\[batch, seq\]"),
    "first: too long": (FIRST, torch.zeros(2, T + 1, dtype=torch.long), None, "sequence length"),
    "first: empty batch": (FIRST, torch.zeros(0, T, dtype=torch.long), None, "batch size"),
    "first: huge batch": (FIRST, torch.zeros(5000, T, dtype=torch.long), None, "batch size"),
    "first: token too big": (FIRST, torch.full((2, T), 256), None, r"\[0, 256\)"),
    "first: negative token": (FIRST, torch.full((2, T), -1), None, r"\[0, 256\)"),
    "first: unexpected targets": (FIRST, torch.zeros(2, T, dtype=torch.long), torch.zeros(2, T, dtype=torch.long),
                                  "only accepted by the last"),
    "first: not a tensor": (FIRST, [[1, 2]], None, "torch.Tensor"),
    "middle: int tokens": (MIDDLE, torch.zeros(2, T, H, dtype=torch.long), None, "float32"),
    "middle: float64": (MIDDLE, torch.zeros(2, T, H, dtype=torch.float64), None, "float32"),
    "middle: wrong hidden": (MIDDLE, torch.zeros(2, T, H + 1), None, rf"\[batch, seq, {H}\]"),
    "middle: 2-D hidden": (MIDDLE, torch.zeros(2, H), None, rf"\[batch, seq, {H}\]"),
    "middle: NaN": (MIDDLE, torch.zeros(2, T, H).index_fill_(1, torch.tensor([3]), float("nan")), None, "NaN"),
    "middle: inf": (MIDDLE, torch.zeros(2, T, H).index_fill_(1, torch.tensor([3]), float("inf")), None, "inf"),
    "last: missing targets": (LAST, torch.zeros(2, T, H), None, "targets are required"),
    "last: targets shape": (LAST, torch.zeros(2, T, H), torch.zeros(2, T - 1, dtype=torch.long), "targets shape"),
    "last: targets dtype": (LAST, torch.zeros(2, T, H), torch.zeros(2, T), "int64"),
    "last: targets out of range": (LAST, torch.zeros(2, T, H), torch.full((2, T), 300), r"\[0, 256\)"),
    "last: -inf hidden": (LAST, torch.full((2, T, H), float("-inf")), torch.zeros(2, T, dtype=torch.long), "inf"),
}


@pytest.mark.parametrize("case", sorted(_BAD_CASES))
def test_check_inputs_rejects_bad_requests(case):
    stage_index, inputs, targets, message = _BAD_CASES[case]
    stage = build_stage(CONFIG, stage_index, 3, seed=0)
    with pytest.raises(ValueError, match=message) as error:
        stage.check_inputs(inputs, targets)
    assert f"stage {stage_index}/3" in str(error.value)


def test_explicit_stage_layers_split():
    assert layer_ranges(4, 2, [1, 3]) == [(0, 1), (1, 4)]
    with pytest.raises(ValueError, match="stage_layers"):
        layer_ranges(4, 2, [2, 3])
    with pytest.raises(ValueError, match="stage_layers"):
        ModelConfig(num_layers=4, stage_layers=[0, 4])
    config = ModelConfig(num_layers=4, hidden_size=32, num_heads=2, seq_len=16, stage_layers=[1, 3])
    full, even = FullModel(config, 2, seed=0), FullModel(ModelConfig(num_layers=4, hidden_size=32, num_heads=2,
                                                                     seq_len=16), 2, seed=0)
    assert len(full.stages[0].blocks) == 1 and len(full.stages[1].blocks) == 3
    tokens = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(full(tokens, tokens), even(tokens, tokens))  # same network, cut elsewhere


def test_mlp_width_defaults_to_four_times_hidden_and_follows_intermediate_size():
    fc = build_stage(CONFIG, 0, 2, seed=0).blocks[0].mlp.fc
    assert fc.weight.shape == (4 * CONFIG.hidden_size, CONFIG.hidden_size)
    narrow = ModelConfig(vocab_size=256, seq_len=16, num_layers=4, hidden_size=32, num_heads=4, intermediate_size=48)
    stage = build_stage(narrow, 1, 2, seed=0)
    assert stage.blocks[0].mlp.fc.weight.shape == (48, 32) and stage.blocks[0].mlp.proj.weight.shape == (32, 48)


def test_logits_and_checkpoint_names_of_the_last_stage():
    stages = [build_stage(CONFIG, i, 2, seed=6) for i in range(2)]
    tokens = _tokens()
    hidden = stages[0](tokens)
    logits = stages[1].logits(hidden)
    assert logits.shape == (3, CONFIG.seq_len, CONFIG.vocab_size)
    torch.testing.assert_close(stages[1](hidden, tokens), torch.nn.functional.cross_entropy(
        logits.reshape(-1, CONFIG.vocab_size), tokens.reshape(-1)), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="only the last stage"):
        stages[0].logits(tokens)
    names = stages[1].checkpoint_names()
    assert names["blocks.0.attn.qkv.weight"] == "blocks.2.attn.qkv.weight"
    assert names["lm_head.weight"] == "lm_head.weight"
    assert set(stages[0].checkpoint_names().values()).isdisjoint(names.values())
