"""How many parameters each stage of a run holds and how much memory a peer serving it needs.

Pure arithmetic over a :class:`~swarm.model.gpt.ModelConfig` (blocks are sized on the meta device, so
nothing is allocated): what a volunteer is told before it joins, so that it can tell whether its
device fits the stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Union

from swarm.model.devices import parse_device
from swarm.model.gpt import Block, ModelConfig, layer_ranges

__all__ = ["StageFootprint", "stage_parameter_counts", "stage_footprint", "expected_footprint",
           "COMPUTE_BYTES_PER_PARAMETER", "OPTIMIZER_BYTES_PER_PARAMETER", "PROCESS_BASE_BYTES"]

# where the stage computes, float32 copies of every parameter: the weights, the gradient sum of the step
# being accumulated, the frozen mean gradient of the step being averaged, and one backward's gradients
COMPUTE_BYTES_PER_PARAMETER = 4 * 4
# in host memory on any device: the optimizer's .grad and Adam's two moments (float32), and the averager's
# float64 copy of the gradients it all-reduces; off the CPU also the optimizer's float32 copy of the weights
OPTIMIZER_BYTES_PER_PARAMETER = 3 * 4 + 8
PROCESS_BASE_BYTES = 300 * 2**20  # torch, hivemind and p2pd before any stage is built (measured RSS of a CPU peer)


@dataclass(frozen=True)
class StageFootprint:
    """What serving ``stage`` costs: parameters, bytes of state and of cached forwards on its device, and the
    optimizer's state in host memory when the device is not the CPU (on the CPU, ``state_bytes`` holds it).
    The process itself needs about :data:`PROCESS_BASE_BYTES` of host memory besides."""

    stage: Union[int, str]  # a stage index, or 'auto' for the most any stage may need
    parameters: int
    state_bytes: int  # parameters and gradients on the device (and the optimizer's state, on the CPU)
    cache_bytes: int  # the forward cache's budget (0 at the last stage, which caches nothing)
    host_bytes: int = 0  # the optimizer's state in host memory, off the CPU

    @property
    def device_bytes(self) -> int:
        return self.state_bytes + self.cache_bytes


def _block_parameters(model: ModelConfig) -> int:
    import torch

    with torch.device("meta"):
        return sum(p.numel() for p in Block(model).parameters())


def stage_parameter_counts(model: ModelConfig, num_stages: int) -> List[int]:
    """Parameters of every stage: its blocks, plus the embeddings at the first and the final
    LayerNorm and LM head at the last (the layout of :class:`swarm.model.gpt.StageModule`)."""
    per_block, h = _block_parameters(model), model.hidden_size
    counts = [(end - start) * per_block for start, end in layer_ranges(model.num_layers, num_stages, model.stage_layers)]
    counts[0] += (model.vocab_size + model.seq_len) * h
    counts[-1] += 2 * h + h * model.vocab_size
    return counts


def stage_footprint(model: ModelConfig, num_stages: int, stage: int, forward_cache_mb: float,
                    device: str = "cpu") -> StageFootprint:
    """The footprint of ``stage`` on ``device`` (a torch device name): the optimizer steps a host copy of the
    weights off the CPU (:class:`swarm.server.runner.StageRunner`), and the weights themselves on it."""
    parameters = stage_parameter_counts(model, num_stages)[stage]
    cache = 0 if stage == num_stages - 1 else int(forward_cache_mb * 2**20)
    compute, optimizer = parameters * COMPUTE_BYTES_PER_PARAMETER, parameters * OPTIMIZER_BYTES_PER_PARAMETER
    if parse_device(device).type == "cpu":
        return StageFootprint(stage, parameters, compute + optimizer, cache)
    return StageFootprint(stage, parameters, compute, cache, host_bytes=optimizer + 4 * parameters)


def expected_footprint(model: ModelConfig, num_stages: int, stage: Union[int, str],
                       forward_cache_mb: float, device: str = "cpu") -> StageFootprint:
    """The footprint of ``stage``, or with 'auto' the most that any stage needs, figure by figure (a peer
    may be given any stage, and may later move to another)."""
    if stage != "auto":
        return stage_footprint(model, num_stages, int(stage), forward_cache_mb, device)
    stages = [stage_footprint(model, num_stages, s, forward_cache_mb, device) for s in range(num_stages)]
    return StageFootprint("auto", max(f.parameters for f in stages), max(f.state_bytes for f in stages),
                          max(f.cache_bytes for f in stages), max(f.host_bytes for f in stages))
