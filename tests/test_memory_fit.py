"""What a stage needs in memory, refusing a stage that does not fit, activation checkpointing and mixed
precision: the estimate against what autograd really saves, the one-line refusal, ``--stage auto`` among
fitting stages, checkpointed gradients equal to plain ones, bf16 on the CPU, replicas of different dtypes
agreeing on their parameters, and the GPU benchmark's ``--tiny`` run on the CPU."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swarm.config.settings import PeerConfig, RunConfig
from swarm.model.footprint import (GB, activation_bytes, check_peer_fits, memory_refusal, peer_fitting_stages,
                                   stage_memory, stage_parameter_counts, stages_that_fit)
from swarm.model.gpt import ModelConfig
from swarm.model.stages import build_stage
from swarm.policy.rebalance import choose_stage_for_new_peer, settle_join_choice
from swarm.policy.snapshot import PeerInfo
from swarm.server.forward_cache import measure_saved_bytes
from swarm.server.runner import LossScale, StageRunner

REPO = Path(__file__).resolve().parents[1]
LLAMA = ModelConfig(architecture="llama", vocab_size=300, seq_len=32, num_layers=6, hidden_size=64, num_heads=4,
                    num_kv_heads=2)
GPT = ModelConfig(vocab_size=300, seq_len=32, num_layers=6, hidden_size=64, num_heads=4)


def _measured(model: ModelConfig, stage: int, num_stages: int, batch: int, checkpointed: bool = False) -> int:
    module = build_stage(model, stage, num_stages, seed=0)
    module.checkpoint_activations = checkpointed
    inputs = torch.randint(0, model.vocab_size, (batch, model.seq_len)) if stage == 0 else \
        torch.randn(batch, model.seq_len, model.hidden_size, requires_grad=True)
    targets = torch.randint(0, model.vocab_size, (batch, model.seq_len)) if stage == num_stages - 1 else None
    _, saved = measure_saved_bytes(lambda: module(inputs, targets), iter(module.parameters()))
    return saved


@pytest.mark.parametrize("model", [LLAMA, GPT], ids=["llama", "gpt"])
def test_activation_estimate_matches_what_autograd_saves(model):
    for stage, tolerance in ((1, 0.03), (0, 0.1), (2, 0.1)):  # the ends add embeddings and the loss
        estimate = activation_bytes(model, 3, stage, batch_size=3)
        measured = _measured(model, stage, 3, batch=3)
        assert abs(estimate - measured) <= tolerance * measured, (stage, estimate, measured)
    assert activation_bytes(model, 3, 1, 6) == 2 * activation_bytes(model, 3, 1, 3)
    assert activation_bytes(model, 3, 1, 3, dtype="bf16") == activation_bytes(model, 3, 1, 3) // 2


def test_checkpointing_keeps_only_block_inputs_and_the_estimate_says_so():
    plain, checkpointed = (activation_bytes(LLAMA, 3, 1, 4, checkpoint_activations=c) for c in (False, True))
    tokens, h = 4 * LLAMA.seq_len, LLAMA.hidden_size
    assert checkpointed == tokens * 2 * h * 4 + plain // 2  # two block inputs, plus one block rebuilt in backward
    assert _measured(LLAMA, 1, 3, 4, checkpointed=True) < _measured(LLAMA, 1, 3, 4) / 3


def test_stage_memory_figures_on_cpu_and_cuda():
    params = stage_parameter_counts(LLAMA, 3)[1]
    cpu = stage_memory(LLAMA, 3, 1, batch_size=2, forward_cache_mb=1.0)
    assert (cpu.parameters, cpu.master_adam, cpu.gradients) == (4 * params, 20 * params, 12 * params)
    assert cpu.forward_cache == 2**20 and cpu.device_bytes == cpu.total
    gpu = stage_memory(LLAMA, 3, 1, batch_size=2, forward_cache_mb=1.0, dtype="bf16", device="cuda:0")
    assert gpu.parameters == 6 * params, "float32 weights and their bf16 autocast copies"
    assert gpu.master_adam == 24 * params, "the host holds the float32 master copy besides Adam's state"
    assert gpu.device_bytes == gpu.total - gpu.master_adam
    assert stage_memory(LLAMA, 3, 2, batch_size=2, forward_cache_mb=1.0).forward_cache == 0, "the last caches nothing"
    with pytest.raises(ValueError, match="dtype"):
        stage_memory(LLAMA, 3, 1, batch_size=2, forward_cache_mb=0, dtype="int8")
    with pytest.raises(ValueError, match="stage"):
        stage_memory(LLAMA, 3, 3, batch_size=2, forward_cache_mb=0)


def test_refusal_names_every_figure_in_one_line():
    memory = stage_memory(LLAMA, 3, 1, batch_size=64, forward_cache_mb=300, device="cuda:0")
    limit = round(memory.total / GB / 2, 3)
    line = memory_refusal(memory, limit)
    assert line is not None and "\n" not in line
    assert memory.total < GB, "a small stage: its figures in MB-sized steps"
    assert line.startswith(f"stage 1 needs {memory.total / GB:.3f} GB (parameters ")
    for figure in ("master+Adam", "gradients", "activations", "forward cache 0.315)"):
        assert figure in line
    assert line.endswith(f"but --max_memory_gb is {limit:g}")
    assert memory_refusal(memory, 0) is None and memory_refusal(memory, 2 * limit + 1) is None
    small_device = memory_refusal(memory, 0, device_free_bytes=memory.device_bytes - 1)
    assert small_device is not None and "free" in small_device
    assert memory_refusal(memory, 0, device_free_bytes=memory.device_bytes) is None
    big = stage_memory(dataclasses.replace(LLAMA, hidden_size=1024, num_heads=8), 3, 1,
                       batch_size=64, forward_cache_mb=300)
    assert big.total > GB and big.describe().endswith(f"activations {big.activations / GB:.1f}, forward cache 0.3)")


def test_peer_refuses_a_stage_that_does_not_fit_and_auto_picks_among_those_that_do():
    run = RunConfig(num_stages=3, model=LLAMA)
    needs = [stage_memory(LLAMA, 3, s, batch_size=8, forward_cache_mb=0).total / GB for s in range(3)]
    biggest = max(range(3), key=lambda s: needs[s])
    limit = (needs[biggest] + max(n for s, n in enumerate(needs) if s != biggest)) / 2  # refuses only the biggest
    others = [s for s in range(3) if s != biggest]
    peer = PeerConfig(run=run, max_memory_gb=limit, forward_cache_mb=0, memory_batch_samples=8)
    assert peer_fitting_stages(peer) == others == stages_that_fit(LLAMA, 3, limit, batch_size=8, forward_cache_mb=0)
    with pytest.raises(ValueError, match=rf"^stage {biggest} needs .* but --max_memory_gb is"):
        check_peer_fits(peer, biggest)
    check_peer_fits(peer, others[0])
    check_peer_fits(PeerConfig(run=run, forward_cache_mb=0), biggest)  # 0 = no limit
    # the bottleneck is the stage that does not fit: the next one that needs capacity most is chosen instead
    peers = [PeerInfo("a", others[0], throughput=3.0), PeerInfo("b", others[1], throughput=2.0)]
    assert choose_stage_for_new_peer(peers, 3) == biggest
    assert choose_stage_for_new_peer(peers, 3, fitting=peer_fitting_stages(peer)) == others[1]
    assert choose_stage_for_new_peer(peers, 3, fitting=[others[0]]) == others[0]
    rivals = [*peers, PeerInfo("0", others[1], "joining"), PeerInfo("z", others[1], "joining")]
    assert settle_join_choice(rivals, "z", others[1], 3) == biggest, "the rival with the smaller id keeps the stage"
    assert settle_join_choice(rivals, "z", others[1], 3, fitting=others) == others[0]
    with pytest.raises(ValueError, match="no stage"):
        choose_stage_for_new_peer(peers, 3, fitting=[])
    with pytest.raises(ValueError, match="fitting"):
        choose_stage_for_new_peer(peers, 3, fitting=[3])


def test_peer_config_checks_the_new_settings():
    with pytest.raises(ValueError, match="max_memory_gb"):
        PeerConfig(max_memory_gb=-1)
    with pytest.raises(ValueError, match="dtype"):
        PeerConfig(dtype="fp8")
    with pytest.raises(ValueError, match="CUDA"):
        PeerConfig(dtype="fp16")
    with pytest.raises(ValueError, match="memory_batch_samples"):
        PeerConfig(memory_batch_samples=0)


@pytest.mark.parametrize("model", [LLAMA, GPT], ids=["llama", "gpt"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_checkpointed_gradients_equal_plain_ones(model, stage):
    grads = []
    for checkpointed in (False, True):
        module = build_stage(model, stage, 3, seed=5)
        module.checkpoint_activations = checkpointed
        gen = torch.Generator().manual_seed(stage)
        inputs = torch.randint(0, model.vocab_size, (2, model.seq_len), generator=gen) if stage == 0 else \
            torch.randn(2, model.seq_len, model.hidden_size, generator=gen).requires_grad_(True)
        targets = torch.randint(0, model.vocab_size, (2, model.seq_len), generator=gen) if stage == 2 else None
        out = module(inputs, targets)
        cotangent = torch.ones_like(out) if stage == 2 else torch.randn(out.shape, generator=gen)
        wrt = list(module.parameters()) + ([inputs] if stage else [])
        grads.append(torch.autograd.grad(out, wrt, cotangent))
    for plain, checkpointed in zip(*grads):
        torch.testing.assert_close(checkpointed, plain, rtol=0, atol=1e-6)


def _micro_batch(run: RunConfig, stage: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    model = run.model
    inputs = torch.randint(0, model.vocab_size, (4, model.seq_len), generator=gen) if stage == 0 else \
        torch.randn(4, model.seq_len, model.hidden_size, generator=gen)
    targets = torch.randint(0, model.vocab_size, (4, model.seq_len), generator=gen) if stage == run.num_stages - 1 \
        else None
    grad_outputs = None if stage == run.num_stages - 1 else \
        torch.randn(4, model.seq_len, model.hidden_size, generator=gen) * 1e-3
    return inputs, grad_outputs, targets


@pytest.mark.parametrize("model", [LLAMA, GPT], ids=["llama", "gpt"])
def test_bf16_on_cpu_is_close_to_fp32_and_accumulates_float32(model):
    run = RunConfig(num_stages=2, model=model, defences=False)
    last = {dtype: StageRunner(run, 1, dtype=dtype) for dtype in ("fp32", "bf16")}
    inputs, _, targets = _micro_batch(run, 1, seed=3)
    losses = {dtype: r.backward("t:1", inputs, None, targets)[1] for dtype, r in last.items()}
    assert abs(losses["bf16"] - losses["fp32"]) <= 0.03 * losses["fp32"]
    assert losses["bf16"] != losses["fp32"], "bf16 autocast computed something"
    first = {dtype: StageRunner(run, 0, dtype=dtype) for dtype in ("fp32", "bf16")}
    tokens, grad_outputs, _ = _micro_batch(run, 0, seed=4)
    for dtype, runner in first.items():
        out = runner.forward(tokens)
        assert out.dtype == torch.float32, "activations travel in float32"
        runner.backward("t:1", tokens, grad_outputs)
    for runner in (*last.values(), *first.values()):
        assert all(g.dtype == torch.float32 for g in runner.grad_sum)
        assert all(p.dtype == torch.float32 for p in runner.masters)
    for plain, mixed in zip(first["fp32"].grad_sum, first["bf16"].grad_sum):
        assert torch.linalg.vector_norm(mixed - plain) <= 0.05 * torch.linalg.vector_norm(plain) + 1e-9


def test_replicas_of_different_dtypes_keep_one_digest():
    run = RunConfig(num_stages=2, model=LLAMA, defences=False)
    replicas = [StageRunner(run, 1, dtype="fp32"), StageRunner(run, 1, dtype="bf16", checkpoint_activations=True)]
    assert replicas[0].digest == replicas[1].digest
    inputs, _, targets = _micro_batch(run, 1, seed=7)
    for runner in replicas:
        runner.backward("t:1", inputs, None, targets)
        runner.freeze()
    assert not torch.equal(replicas[0].frozen.mean_grads[0], replicas[1].frozen.mean_grads[0])
    averaged = [(a + b) / 2 for a, b in zip(replicas[0].frozen.mean_grads, replicas[1].frozen.mean_grads)]
    for runner in replicas:
        runner.apply(averaged, 8)
    assert replicas[0].step == replicas[1].step == 1
    assert replicas[0].digest == replicas[1].digest
    assert replicas[0].digest != StageRunner(run, 1).digest, "the step changed the parameters"


def test_fp16_needs_cuda_and_the_loss_scale_moves():
    with pytest.raises(ValueError, match="CUDA"):
        StageRunner(RunConfig(num_stages=2, model=LLAMA), 0, dtype="fp16")
    scale = LossScale(scale=1024.0, growth_interval=3)
    scale.update(overflowed=True)
    assert scale.scale == 512.0
    for _ in range(2):
        scale.update(overflowed=False)
    assert scale.scale == 512.0
    scale.update(overflowed=False)
    assert scale.scale == 1024.0 and scale.clean == 0
    floor = LossScale(scale=1.0)
    floor.update(overflowed=True)
    assert floor.scale == 1.0


@pytest.mark.long
def test_gpu_benchmark_runs_tiny_on_cpu(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--tiny", "--no_record"],
                            cwd=REPO, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["device"] == "cpu"
    assert summary["stage_tokens_per_s"] > 0 and summary["swarm_over_single"] > 0
    assert summary["stage_mfu"] is None, "no peak FLOPs is known for a CPU"
    assert summary["memory_estimate_error"] is None, "peak memory is measured on CUDA only"


def test_mixed_precision_and_checkpointed_requests_are_served_one_by_one():
    run = RunConfig(num_stages=2, model=LLAMA, defences=False)
    for dtype, checkpointed in (("bf16", False), ("fp32", True)):
        runner = StageRunner(run, 0, dtype=dtype, checkpoint_activations=checkpointed)
        requests = [(f"t:{i}", *_micro_batch(run, 0, seed=i)) for i in range(2)]
        results = runner.backward_batch(requests)
        assert not any(isinstance(r, Exception) for r in results), results
        assert runner.num_recomputed == 2 and runner.samples_pending == 8
