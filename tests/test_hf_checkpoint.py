"""Checkpoints in Hugging Face's layout: our Llama stages exported and loaded by transformers, an HF checkpoint
loaded into our stages, sharding, a stage reading only its own tensors, the GPT's own format, the stage digest,
and clear errors for what cannot be used. Every checkpoint is made here; nothing is downloaded."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import swarm.model.hf_checkpoint as hf_checkpoint
from swarm.model.gpt import ModelConfig
from swarm.model.hf_checkpoint import (CheckpointError, config_from_hf, export_checkpoint, load_stage_from_checkpoint,
                                       read_stage_tensors, stage_digest, tensor_digest)
from swarm.model.stages import FullModel, build_stage

transformers = pytest.importorskip("transformers")

LLAMA = ModelConfig(architecture="llama", vocab_size=64, seq_len=16, num_layers=3, hidden_size=32, num_heads=4,
                    num_kv_heads=2, intermediate_size=48, rope_theta=500.0, rms_norm_eps=1e-6)
GPT = ModelConfig(vocab_size=64, seq_len=16, num_layers=3, hidden_size=32, num_heads=4)


def _tokens(config: ModelConfig, batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (batch, config.seq_len), generator=torch.Generator().manual_seed(seed))


def _perturbed(model: FullModel, seed: int = 1) -> FullModel:
    """Every parameter moved off its initial value, so that a norm left at 1 or a swapped tensor shows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    return model


def _states(model: FullModel) -> list:
    return [stage.state_dict() for stage in model.stages]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A 2-stage Llama of ours, exported in shards of at most 16 KiB."""
    model = _perturbed(FullModel(LLAMA, 2, seed=3))
    out = tmp_path_factory.mktemp("exported")
    files = export_checkpoint(LLAMA, _states(model), out, max_shard_bytes=16 * 1024)
    return model, out, files


@pytest.fixture(scope="module")
def hf_made(tmp_path_factory):
    """A tiny LlamaForCausalLM made and saved by transformers itself (random weights, norms perturbed)."""
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=16,
                                      rope_theta=250.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    out = tmp_path_factory.mktemp("hf_made")
    model.save_pretrained(out)
    return model, out


# ---- ours -> transformers ----

def test_export_loads_in_transformers_with_the_same_logits(exported):
    model, out, files = exported
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert set(hf.state_dict()) == {name for stage in model.stages for name in stage.state_dict()}
    tokens = _tokens(LLAMA)
    with torch.no_grad():
        ours, theirs = model.logits(tokens), hf(tokens).logits
    assert (ours - theirs).abs().max().item() <= 1e-4
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["LlamaForCausalLM"] and written["num_key_value_heads"] == 2
    assert config_from_hf(out) == LLAMA


def test_sharded_export_index_and_round_trip(exported):
    model, out, files = exported
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    sizes = {shard: sum(t.numel() * t.element_size() for t in load_file(out / shard).values()) for shard in shards}
    largest = max(p.numel() * 4 for p in model.parameters())
    assert all(size <= max(16 * 1024, largest) for size in sizes.values())
    assert index["metadata"]["total_size"] == sum(sizes.values()) == sum(p.numel() * 4 for p in model.parameters())
    for index_, stage in enumerate(model.stages):
        loaded = load_stage_from_checkpoint(out, LLAMA, index_, 2)
        assert loaded.state_dict().keys() == stage.state_dict().keys()
        assert all(torch.equal(loaded.state_dict()[k], v) for k, v in stage.state_dict().items())
        assert stage_digest(loaded) == stage_digest(stage)


def test_a_stage_reads_only_its_own_tensors(exported, monkeypatch, tmp_path):
    model, out, _ = exported
    read = []
    real_safe_open = hf_checkpoint.safe_open

    class Recording:
        def __init__(self, path, framework):
            self.path, self.handle = path, real_safe_open(path, framework=framework)

        def __enter__(self):
            self.inner = self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, name):
            return self.inner.get_slice(name)

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(hf_checkpoint, "safe_open", Recording)
    last = read_stage_tensors(out, LLAMA, 1, 2)
    assert sorted(read) == sorted(model.stages[1].state_dict()) == sorted(last)
    # the shards holding only stage 0's tensors are never opened: the stage loads without them
    index = json.loads((out / "model.safetensors.index.json").read_text())
    needed = {index["weight_map"][name] for name in model.stages[1].state_dict()}
    for path in out.iterdir():
        if path.name in needed or path.suffix == ".json":
            (tmp_path / path.name).write_bytes(path.read_bytes())
    assert len(list(tmp_path.glob("*.safetensors"))) < len(list(out.glob("*.safetensors")))
    assert read_stage_tensors(tmp_path, LLAMA, 1, 2).keys() == last.keys()
    with pytest.raises(CheckpointError, match="does not exist"):
        read_stage_tensors(tmp_path, LLAMA, 0, 2)


# ---- transformers -> ours ----

@pytest.mark.parametrize("num_stages, stage_layers", [(1, []), (2, []), (3, [1, 1, 1])])
def test_hf_checkpoint_loads_into_our_stages_with_the_same_logits(hf_made, num_stages, stage_layers):
    hf, out = hf_made
    config = dataclasses.replace(config_from_hf(out), stage_layers=stage_layers)
    assert (config.architecture, config.kv_heads, config.ffn_size, config.rope_theta, config.seq_len) == \
        ("llama", 1, 40, 250.0, 16)
    stages = [load_stage_from_checkpoint(out, config, i, num_stages) for i in range(num_stages)]
    tokens = _tokens(config, seed=4)
    with torch.no_grad():
        x = tokens
        for stage in stages[:-1]:
            x = stage(x)
        ours, theirs = stages[-1].logits(x), hf(tokens).logits
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_tied_hf_checkpoint_loads_as_one_stage_only(tmp_path):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                      num_attention_heads=2, max_position_embeddings=8, tie_word_embeddings=True)
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    ours = config_from_hf(tmp_path)
    assert ours.tie_embeddings and ours.rms_norm_eps == config.rms_norm_eps
    stage = load_stage_from_checkpoint(tmp_path, ours, 0, 1)
    assert stage.lm_head.weight is stage.model.embed_tokens.weight
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (stage.logits(tokens) - hf(tokens).logits).abs().max().item() <= 1e-4
    with pytest.raises(ValueError, match="tie_embeddings needs the token embedding and the LM head on one peer"):
        load_stage_from_checkpoint(tmp_path, ours, 0, 2)
    out = tmp_path / "again"
    export_checkpoint(ours, [stage.state_dict()], out)
    assert "lm_head.weight" not in load_file(out / "model.safetensors")  # stored once, as HF stores it


# ---- the GPT's own format ----

def test_gpt_export_round_trip(tmp_path):
    model = _perturbed(FullModel(GPT, 2, seed=5))
    files = export_checkpoint(GPT, _states(model), tmp_path)
    assert [p.name for p in files] == ["model.safetensors", "config.json"]
    names = set(load_file(tmp_path / "model.safetensors"))
    assert {"token_embedding.weight", "blocks.0.attn.qkv.weight", "blocks.2.attn.qkv.weight", "lm_head.weight"} <= names
    assert config_from_hf(tmp_path) == GPT
    stages = [load_stage_from_checkpoint(tmp_path, GPT, i, 2) for i in range(2)]
    tokens = _tokens(GPT)
    with torch.no_grad():
        assert torch.equal(stages[1].logits(stages[0](tokens)), model.logits(tokens))
    recut = load_stage_from_checkpoint(tmp_path, GPT, 0, 1)  # the same checkpoint, cut differently
    with torch.no_grad():
        torch.testing.assert_close(recut.logits(tokens), model.logits(tokens), rtol=0, atol=1e-5)


# ---- digest ----

def test_digest_covers_names_dtypes_shapes_and_bits():
    a, b = build_stage(LLAMA, 1, 2, seed=9), build_stage(LLAMA, 1, 2, seed=9)
    assert stage_digest(a) == stage_digest(b) and len(stage_digest(a)) == 64
    assert stage_digest(a) != stage_digest(build_stage(LLAMA, 1, 2, seed=10))
    tensors = {"x": torch.arange(6, dtype=torch.float32).reshape(2, 3), "y": torch.ones(2)}
    base = tensor_digest(tensors)
    assert tensor_digest(dict(reversed(list(tensors.items())))) == base  # order of the mapping does not matter
    assert tensor_digest({**tensors, "x": tensors["x"].t().contiguous().t()}) == base  # nor memory layout
    changed = tensors["x"].clone()
    changed.view(-1)[4] = torch.nextafter(changed.view(-1)[4], torch.tensor(100.0))
    for other in ({**tensors, "x": changed}, {"z": tensors["x"], "y": tensors["y"]},
                  {**tensors, "x": tensors["x"].reshape(3, 2)}, {**tensors, "x": tensors["x"].double()}):
        assert tensor_digest(other) != base


# ---- what cannot be used ----

def _write_config(path, **changes):
    data = json.loads((path / "config.json").read_text())
    data.update(changes)
    (path / "config.json").write_text(json.dumps(data))


@pytest.mark.parametrize("changes, message", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500.0}}, "rope_type 'llama3'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_dropout": 0.1}, "no dropout"),
    ({"head_dim": 16}, "head_dim"),
    ({"model_type": "gpt2"}, "model_type 'gpt2'"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "LlamaForCausalLM"),
    ({"num_key_value_heads": 3}, "divisible by num_kv_heads"),
])
def test_unsupported_configs_are_refused(tmp_path, changes, message):
    export_checkpoint(LLAMA, _states(FullModel(LLAMA, 1, seed=0)), tmp_path)
    _write_config(tmp_path, **changes)
    with pytest.raises(CheckpointError, match=message):
        config_from_hf(tmp_path)


def test_legacy_transformers_config_is_read(tmp_path):
    export_checkpoint(LLAMA, _states(FullModel(LLAMA, 1, seed=0)), tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    del data["rope_parameters"], data["dtype"]  # transformers 4 writes rope_theta and torch_dtype only
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert config_from_hf(tmp_path).rope_theta == 500.0
    assert config_from_hf(tmp_path, seq_len=8).seq_len == 8


def test_load_errors_name_the_problem(tmp_path):
    model = FullModel(LLAMA, 2, seed=0)
    export_checkpoint(LLAMA, _states(model), tmp_path)
    with pytest.raises(CheckpointError, match="rope_theta 500.0, the run's model 10000.0"):
        read_stage_tensors(tmp_path, dataclasses.replace(LLAMA, rope_theta=10000.0), 0, 2)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.2.mlp.up_proj.weight"
    save_file({**tensors, name: torch.zeros(47, 32)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model.layers.2.mlp.up_proj.weight'.*shape \(47, 32\).*\(48, 32\)"):
        read_stage_tensors(tmp_path, LLAMA, 1, 2)
    read_stage_tensors(tmp_path, LLAMA, 0, 2)  # stage 0 never reads that tensor
    del tensors[name]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="'model.layers.2.mlp.up_proj.weight' is missing"):
        read_stage_tensors(tmp_path, LLAMA, 1, 2)
    save_file({**tensors, name: torch.full((48, 32), float("nan"))}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="NaN or infinite"):
        read_stage_tensors(tmp_path, LLAMA, 1, 2)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        read_stage_tensors(tmp_path, LLAMA, 1, 2)


def test_export_errors_name_the_problem(tmp_path):
    states = _states(FullModel(LLAMA, 2, seed=0))
    missing = {k: v for k, v in states[1].items() if k != "model.norm.weight"}
    with pytest.raises(CheckpointError, match="stage 1/2: tensor 'model.norm.weight' is missing"):
        export_checkpoint(LLAMA, [states[0], missing], tmp_path / "a")
    with pytest.raises(CheckpointError, match="stage 1/2: unexpected tensor 'model.embed_tokens.weight'"):
        export_checkpoint(LLAMA, [states[0], {**states[1], **states[0]}], tmp_path / "b")
    wrong = {**states[1], "lm_head.weight": torch.zeros(3, 3)}
    with pytest.raises(CheckpointError, match=r"'lm_head.weight' has shape \(3, 3\)"):
        export_checkpoint(LLAMA, [states[0], wrong], tmp_path / "c")
    with pytest.raises(CheckpointError, match="mix dtypes"):
        export_checkpoint(LLAMA, [states[0], {k: v.double() for k, v in states[1].items()}], tmp_path / "d")
    export_checkpoint(LLAMA, states, tmp_path / "e", dtype=torch.bfloat16)
    assert load_file(tmp_path / "e" / "model.safetensors")["lm_head.weight"].dtype == torch.bfloat16
    assert json.loads((tmp_path / "e" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = load_stage_from_checkpoint(tmp_path / "e", LLAMA, 1, 2)  # computes in float32 again
    assert all(torch.equal(loaded.state_dict()[k], v.bfloat16().float()) for k, v in states[1].items())
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        export_checkpoint(LLAMA, states, tmp_path / "e")
