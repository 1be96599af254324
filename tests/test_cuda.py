"""A stage on a CUDA device computes what it computes on the CPU, and a CUDA replica and a CPU replica of
one stage that apply the same averaged gradients stay bit-identical (replicas compare digests of their
parameters; a mismatch makes one of them download the stage's state).

The CUDA tests are skipped where torch sees no CUDA device, as on CI. On a machine with one, running the
suite with ``SWARM_TEST_DEVICE=cuda:0`` also puts every stage peer of the live tests on that device.
"""

from __future__ import annotations

import subprocess
import sys
from typing import List, Tuple

import pytest
import torch

from swarm.config.settings import PeerConfig, RunConfig
from swarm.model.devices import check_available, parse_device, synchronize
from swarm.model.gpt import ModelConfig
from swarm.server.runner import StageRunner
from tests.utils.probe import online
from tests.utils.processes import REPO

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device on this machine")

MODEL = ModelConfig(num_layers=2, hidden_size=64, num_heads=2, seq_len=16)
RUN = RunConfig(num_stages=2, target_batch_size=16, model=MODEL)
CACHE_BYTES = 64 * 2**20
TOLERANCE = dict(atol=2e-5, rtol=1e-4)  # float32 kernels of two devices reduce in different orders


def _inputs(stage: int, seed: int, batch: int = 4) -> Tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, MODEL.vocab_size, (batch, MODEL.seq_len), generator=generator)
    if stage == 0:
        return torch.randint(0, MODEL.vocab_size, (batch, MODEL.seq_len), generator=generator), targets
    return torch.randn(batch, MODEL.seq_len, MODEL.hidden_size, generator=generator), targets


def _grad_outputs(seed: int, batch: int = 4) -> torch.Tensor:
    return torch.randn(batch, MODEL.seq_len, MODEL.hidden_size, generator=torch.Generator().manual_seed(seed))


def _pair(stage: int) -> Tuple[StageRunner, StageRunner]:
    return (StageRunner(RUN, stage, "cpu", forward_cache_bytes=CACHE_BYTES),
            StageRunner(RUN, stage, "cuda:0", forward_cache_bytes=CACHE_BYTES))


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.device.type == b.device.type == "cpu", "replies leave a runner on the CPU"
    torch.testing.assert_close(a, b, **TOLERANCE)


def test_device_names_are_checked_before_anything_starts():
    assert parse_device("cpu") == torch.device("cpu")
    assert parse_device("cuda:1") == torch.device("cuda", 1)
    for bad in ("", "gpu", "cuda:x", "meta"):
        with pytest.raises(ValueError, match="device"):
            parse_device(bad)
    with pytest.raises(ValueError, match="device"):
        PeerConfig(device="gpu0")
    check_available(torch.device("cpu"))
    synchronize(torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            check_available(torch.device("cuda:0"))
    else:
        with pytest.raises(ValueError, match="CUDA device"):
            check_available(torch.device("cuda", torch.cuda.device_count()))


def test_a_peer_on_a_device_this_machine_lacks_stops_with_one_line_before_joining():
    absent = f"cuda:{torch.cuda.device_count() + 7}"
    nobody = "/ip4/127.0.0.1/tcp/9/p2p/QmVZuyouwwHcm56jT8PaDD5C8GwLskj8oT96rzS1ZH6Pgx"  # never reached
    result = subprocess.run(
        [sys.executable, "-m", "peers.cli", "peer", "--run_id", "x", "--num_stages", "2", "--stage", "0",
         "--device", absent, "--initial_peers", nobody],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"error: device {absent}:" in result.stderr and "Traceback" not in result.stderr, result.stderr


@needs_cuda
@pytest.mark.parametrize("stage", [0, 1])
def test_a_cuda_stage_computes_what_a_cpu_stage_computes(stage):
    cpu, cuda = _pair(stage)
    assert cpu.digest == cuda.digest, "both build the same initial parameters"
    last = stage == RUN.num_stages - 1
    for seed in range(3):  # training forward + cached backward, then a recomputed one, then a plain forward
        x, targets = _inputs(stage, seed)
        grad_outputs = None if last else _grad_outputs(seed)
        key = f"t:{seed}"
        if not last and seed == 0:
            _close(cpu.forward_train(key, x), cuda.forward_train(key, x))
        replies = [runner.backward(key, x, grad_outputs, targets if last else None) for runner in (cpu, cuda)]
        if stage == 0:
            assert replies[0][0] is None and replies[1][0] is None
        else:
            _close(replies[0][0], replies[1][0])
        if last:
            assert abs(replies[0][1] - replies[1][1]) < 1e-4
        _close(cpu.forward(x, targets if last else None), cuda.forward(x, targets if last else None))
    assert cuda.forward_cache.hits == int(not last) and cuda.num_recomputed == 3 - int(not last)
    for a, b in zip(cpu.export(with_gradients=True)["gradients"], cuda.export(with_gradients=True)["gradients"]):
        _close(a, b)


@needs_cuda
def test_merged_backward_on_cuda_matches_backward_one_by_one():
    merged, alone = StageRunner(RUN, 1, "cuda:0"), StageRunner(RUN, 1, "cuda:0")
    requests = []
    for seed in range(3):
        x, targets = _inputs(1, seed)
        requests.append((f"t{seed}:0", x, None, targets))
    results = merged.backward_batch(requests)
    assert not any(isinstance(r, Exception) for r in results), results
    for request, result in zip(requests, results):
        grad_inputs, loss, _ = alone.backward(*request)
        _close(result[0], grad_inputs)
        assert abs(result[1] - loss) < 1e-4
    for a, b in zip(merged.export(with_gradients=True)["gradients"], alone.export(with_gradients=True)["gradients"]):
        _close(a, b)


def _mean_grads(runner: StageRunner, seed: int) -> List[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=generator, dtype=torch.float64) * 1e-2 for p in runner.params]


@needs_cuda
@pytest.mark.parametrize("stage", [0, 1])
def test_cuda_and_cpu_replicas_stay_bit_identical_over_steps(stage):
    """What averaging hands both replicas is the same float64 mean; the step they apply must give the same
    bits on either device, or the pair would download each other's state at every step."""
    cpu, cuda = _pair(stage)
    for step in range(5):
        for runner in (cpu, cuda):
            runner.freeze()
            runner.apply(_mean_grads(runner, step), total_samples=RUN.target_batch_size)
        assert cpu.step == cuda.step == step + 1
        assert cpu.digest == cuda.digest, f"replicas diverged at step {step + 1}"
    for a, b in zip(cpu.state_tensors(), cuda.state_tensors()):
        assert torch.equal(a, b), "optimizer state diverged"


@needs_cuda
def test_state_moves_between_a_cpu_and_a_cuda_replica():
    cpu, cuda = _pair(0)
    cpu.freeze()
    cpu.apply(_mean_grads(cpu, 0), total_samples=RUN.target_batch_size)
    cuda.load_state(*cpu.state())
    assert cuda.digest == cpu.digest and cuda.step == 1
    assert all(p.device.type == "cuda" for p in cuda.params)
    back = StageRunner(RUN, 0, "cpu")
    back.load_state(*cuda.state())
    assert back.digest == cpu.digest


@needs_cuda
async def test_a_cpu_and_a_cuda_replica_average_every_step_without_downloading_each_others_state(launcher, probe):
    target = 32
    launcher.wait_ready([launcher.peer(0, target_batch_size=target, extra=["--device", device], wait=False)
                         for device in ("cpu", "cuda:0")] + [launcher.peer(1, target_batch_size=target, wait=False)])
    records = await probe.wait_for(lambda r: len(online(r, 0)) == 2 and len(online(r, 1)) == 1, 30, "2 + 1 replicas")
    resets = {r.peer_id: r.resets for r in online(records, 0)}
    trainer = launcher.trainer(target_batch_size=target, extra=["--max_samples", "128", "--batch_size", "8"])
    assert trainer.wait_event("trainer_done", timeout=120)["samples_sent"] == 128

    def settled(r) -> bool:
        replicas = online(r, 0)
        return (len(replicas) == 2 and len({x.step for x in replicas}) == 1 and replicas[0].step >= 3
                and not any(x.samples_frozen for x in replicas))

    records = await probe.wait_for(settled, 60, "both stage-0 replicas at one step, 3 steps or more")
    replicas = online(records, 0)
    for record in replicas:
        for step in range(record.step):
            members = (await probe.call(record.peer_id, "step_members", {"stage": 0, "step": step}))["members"]
            assert sorted(members) == sorted(r.peer_id for r in replicas), (step, members)
    assert {r.peer_id: r.resets for r in replicas} == resets, "a replica downloaded the other's state"
    exported = [await probe.call(r.peer_id, "parameters", {}) for r in replicas]
    assert all(torch.equal(a, b) for a, b in zip(exported[0]["parameters"], exported[1]["parameters"]))


def test_the_averager_keeps_its_tensors_in_host_memory_whatever_the_device():
    """Its process is forked from the peer's and cannot use CUDA (meta tensors stand in for a GPU's here)."""
    from swarm.server.averaging import averaged_buffers

    templates = [torch.empty(3, 4, device="meta"), torch.empty(5, device="meta", dtype=torch.float16)]
    buffers = averaged_buffers(templates)
    assert [(b.device.type, b.dtype, tuple(b.shape)) for b in buffers] == \
        [("cpu", torch.float64, (3, 4)), ("cpu", torch.float64, (5,))]
    assert all(not b.any() for b in buffers)
