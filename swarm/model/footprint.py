"""How many parameters each stage of a run holds and how much memory a peer serving it needs.

Pure arithmetic over a :class:`~swarm.model.gpt.ModelConfig` of any architecture (stages are sized as
meta-device skeletons, so nothing is allocated): what a volunteer is told before it joins, so that it can
tell whether its device fits the stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Optional, Union

import torch

from swarm.model.devices import parse_device
from swarm.model.gpt import ModelConfig
from swarm.model.stages import stage_skeleton

if TYPE_CHECKING:  # the peer's settings import the model package; only their type is needed here
    from swarm.config.settings import PeerConfig

__all__ = [
    "StageFootprint",
    "stage_parameter_counts",
    "model_parameter_count",
    "stage_footprint",
    "expected_footprint",
    "COMPUTE_BYTES_PER_PARAMETER",
    "OPTIMIZER_BYTES_PER_PARAMETER",
    "PROCESS_BASE_BYTES",
    "COMPUTE_DTYPES",
    "StageMemory",
    "activation_bytes",
    "stage_memory",
    "memory_refusal",
    "stages_that_fit",
    "device_free_bytes",
    "peer_stage_memory",
    "check_peer_fits",
    "peer_fitting_stages",
    "StageDoesNotFit",
]

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


def stage_parameter_counts(model: ModelConfig, num_stages: int) -> List[int]:
    """Parameters of every stage, as built by :func:`swarm.model.stages.build_stage`: its blocks, plus the
    embeddings at the first and the final norm and LM head at the last (a tied LM head counted once)."""
    return [
        sum(p.numel() for p in stage_skeleton(model, stage, num_stages).parameters()) for stage in range(num_stages)
    ]


def model_parameter_count(model: ModelConfig) -> int:
    """Parameters of the whole model, whatever its architecture (the model as one stage)."""
    return stage_parameter_counts(model, 1)[0]


def stage_footprint(
    model: ModelConfig, num_stages: int, stage: int, forward_cache_mb: float, device: str = "cpu"
) -> StageFootprint:
    """The footprint of ``stage`` on ``device`` (a torch device name): the optimizer steps a host copy of the
    weights off the CPU (:class:`swarm.server.runner.StageRunner`), and the weights themselves on it."""
    parameters = stage_parameter_counts(model, num_stages)[stage]
    cache = 0 if stage == num_stages - 1 else int(forward_cache_mb * 2**20)
    compute, optimizer = parameters * COMPUTE_BYTES_PER_PARAMETER, parameters * OPTIMIZER_BYTES_PER_PARAMETER
    if parse_device(device).type == "cpu":
        return StageFootprint(stage, parameters, compute + optimizer, cache)
    return StageFootprint(stage, parameters, compute, cache, host_bytes=optimizer + 4 * parameters)


def expected_footprint(
    model: ModelConfig, num_stages: int, stage: Union[int, str], forward_cache_mb: float, device: str = "cpu"
) -> StageFootprint:
    """The footprint of ``stage``, or with 'auto' the most that any stage needs, figure by figure (a peer
    may be given any stage, and may later move to another)."""
    if stage != "auto":
        return stage_footprint(model, num_stages, int(stage), forward_cache_mb, device)
    stages = [stage_footprint(model, num_stages, s, forward_cache_mb, device) for s in range(num_stages)]
    return StageFootprint(
        "auto",
        max(f.parameters for f in stages),
        max(f.state_bytes for f in stages),
        max(f.cache_bytes for f in stages),
        max(f.host_bytes for f in stages),
    )


# ---- the memory a training peer needs, figure by figure, and whether its stage fits ----

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
GB = 1e9  # the figures a volunteer reads are decimal gigabytes, as --max_memory_gb is
# Elements autograd saves per token and layer for backward, in units of the hidden size h and the MLP width f.
# Llama: each RMSNorm saves its input and its normalised output (2 x 2h); rotary saves q and k before rotation (2h);
# attention saves q and the key/value heads repeated to every query head, and its output (4h); o_proj's input is
# attention's output, the residual adds save nothing: 10h; SwiGLU saves gate's output, its SiLU, up's output and
# their product (down_proj's input): 4f. GPT: two LayerNorms' inputs (2h), qkv (3h), attention's output (h), the
# residual and the LayerNorms' outputs (2h): 8h; the MLP's fc output and its GELU: 2f. Measured on the CPU with
# swarm.server.forward_cache.measure_saved_bytes to within 1% (tests/test_memory_fit.py checks it).
_SAVED_PER_LAYER = {"llama": (10, 4), "gpt": (8, 2)}  # (multiple of h, multiple of f)
# float32 copies per parameter where the stage computes: two gradient accumulators (the step being accumulated
# and the frozen one being averaged) and the gradients of the backward being run
_GRADIENT_COPIES = 3
# float32/float64 bytes per parameter in host memory: Adam's two moments, the optimizer's .grad (float32 each)
# and the averager's float64 copy of the gradients it all-reduces
_OPTIMIZER_BYTES = 3 * 4 + 8


@dataclass(frozen=True)
class StageMemory:
    """Bytes a training replica of ``stage`` needs, by what holds them. ``parameters``, ``gradients``,
    ``activations`` and ``forward_cache`` live on the compute device; ``master_adam`` (the float32 master copy,
    Adam's moments, the optimizer's and the averager's gradient copies) in host memory, which on the CPU is
    the same memory."""

    stage: int
    parameters: int  # the module's float32 weights, plus their compute-dtype copies that autocast makes
    master_adam: int
    gradients: int
    activations: int  # what autograd saves for backward in one call of ``batch_size`` samples
    forward_cache: int  # the budget of cached training forwards (0 at the last stage)
    on_cpu: bool

    @property
    def total(self) -> int:
        return self.parameters + self.master_adam + self.gradients + self.activations + self.forward_cache

    @property
    def device_bytes(self) -> int:
        """What must fit in the compute device's memory (everything, on the CPU)."""
        return self.total if self.on_cpu else self.total - self.master_adam

    def describe(self) -> str:
        """E.g. ``stage 2 needs 14.2 GB (parameters 2.1, master+Adam 8.4, gradients 2.1, activations 1.3,
        forward cache 0.3)``."""
        digits = 1 if self.total >= GB else 3  # a small stage's figures would all read 0.0
        gb = lambda size: f"{size / GB:.{digits}f}"  # noqa: E731
        return (
            f"stage {self.stage} needs {gb(self.total)} GB (parameters {gb(self.parameters)}, "
            f"master+Adam {gb(self.master_adam)}, gradients {gb(self.gradients)}, "
            f"activations {gb(self.activations)}, forward cache {gb(self.forward_cache)})"
        )


def activation_bytes(
    model: ModelConfig,
    num_stages: int,
    stage: int,
    batch_size: int,
    dtype: str = "fp32",
    checkpoint_activations: bool = False,
) -> int:
    """Bytes autograd keeps for the backward of one call of ``batch_size`` samples through ``stage``.

    Each block saves ``a*h + b*f`` elements per token (:data:`_SAVED_PER_LAYER`) in the compute dtype. With
    activation checkpointing a block keeps only its input (the float32 residual stream) and backward rebuilds
    one block's activations at a time. The last stage adds its logits (compute dtype) and the float32
    log-probabilities the loss saves; the first stage its embedding output."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    width = _dtype_bytes(dtype)
    tokens = batch_size * model.seq_len
    skeleton = stage_skeleton(model, stage, num_stages)
    layers = skeleton.layer_range[1] - skeleton.layer_range[0]
    per_h, per_f = _SAVED_PER_LAYER[model.architecture]
    block = (per_h * model.hidden_size + per_f * model.ffn_size) * width
    if checkpoint_activations:
        per_token = layers * model.hidden_size * 4 + (block if layers else 0)
    else:
        per_token = layers * block
    if model.boundary_dim:  # the projections save their inputs: the narrow one received, the wide one sent on
        per_token += (
            (0 if skeleton.is_first else model.boundary_dim) + (0 if skeleton.is_last else model.hidden_size)
        ) * width
    if skeleton.is_first:
        per_token += model.hidden_size * 4
    if skeleton.is_last:
        per_token += model.vocab_size * (width + 4) + model.hidden_size * 4
    return tokens * per_token


def stage_memory(
    model: ModelConfig,
    num_stages: int,
    stage: int,
    *,
    batch_size: int,
    forward_cache_mb: float,
    dtype: str = "fp32",
    checkpoint_activations: bool = False,
    device: str = "cpu",
) -> StageMemory:
    """What a training replica of ``stage`` needs (:class:`StageMemory`), as :class:`swarm.server.runner.StageRunner`
    allocates it: float32 weights on ``device`` (autocast adds a compute-dtype copy of each for the forward),
    float32 gradient accumulators beside them, and the optimizer's float32 state in host memory (the
    master copy of the weights only off the CPU, where the weights are their own master)."""
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage must be in 0..{num_stages - 1}, got {stage}")
    parameters = stage_parameter_counts(model, num_stages)[stage]
    on_cpu = parse_device(device).type == "cpu"
    casts = 0 if dtype == "fp32" else _dtype_bytes(dtype)
    master = 0 if on_cpu else 4
    cache = 0 if stage == num_stages - 1 else int(forward_cache_mb * 2**20)
    return StageMemory(
        stage,
        parameters * (4 + casts),
        parameters * (master + _OPTIMIZER_BYTES),
        parameters * 4 * _GRADIENT_COPIES,
        activation_bytes(model, num_stages, stage, batch_size, dtype, checkpoint_activations),
        cache,
        on_cpu,
    )


def memory_refusal(memory: StageMemory, max_memory_gb: float, device_free_bytes: Optional[int] = None) -> Optional[str]:
    """Why the stage does not fit, in one line, or None when it does: its total over ``max_memory_gb`` (0 = no
    limit), or its device part over the device's free memory (``device_free_bytes``, off the CPU)."""
    if max_memory_gb and memory.total > max_memory_gb * GB:
        return f"{memory.describe()} but --max_memory_gb is {max_memory_gb:g}"
    if device_free_bytes is not None and not memory.on_cpu and memory.device_bytes > device_free_bytes:
        return (
            f"{memory.describe()}, of which {memory.device_bytes / GB:.1f} GB on the device, "
            f"but the device has {device_free_bytes / GB:.1f} GB free"
        )
    return None


def stages_that_fit(
    model: ModelConfig, num_stages: int, max_memory_gb: float, device_free_bytes: Optional[int] = None, **estimate: Any
) -> List[int]:
    """The stages whose :func:`stage_memory` (with ``estimate``'s settings) passes :func:`memory_refusal`."""
    return [
        stage
        for stage in range(num_stages)
        if memory_refusal(stage_memory(model, num_stages, stage, **estimate), max_memory_gb, device_free_bytes) is None
    ]


def _dtype_bytes(dtype: str) -> int:
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {dtype!r}")
    return COMPUTE_DTYPES[dtype].itemsize


def device_free_bytes(device: str) -> Optional[int]:
    """Free memory of a CUDA ``device`` (None elsewhere: the CPU's limit is ``max_memory_gb`` alone)."""
    parsed = parse_device(device)
    if parsed.type != "cuda" or not torch.cuda.is_available():
        return None
    return int(torch.cuda.mem_get_info(parsed)[0])


def peer_stage_memory(peer: "PeerConfig", stage: int) -> StageMemory:
    """:func:`stage_memory` of ``stage`` with a peer's settings."""
    return stage_memory(
        peer.run.model,
        peer.run.num_stages,
        stage,
        batch_size=peer.memory_batch_samples,
        forward_cache_mb=peer.forward_cache_mb,
        dtype=peer.dtype,
        checkpoint_activations=peer.checkpoint_activations,
        device=peer.device,
    )


class StageDoesNotFit(ValueError):
    """A stage needs more memory than the peer may use; the message names every figure."""


def check_peer_fits(peer: "PeerConfig", stage: int) -> None:
    """:class:`StageDoesNotFit`, in one line naming every figure, unless ``stage`` fits the peer's ``max_memory_gb`` and (on
    CUDA) its device's free memory: a peer refuses a stage it would run out of memory serving."""
    refusal = memory_refusal(peer_stage_memory(peer, stage), peer.max_memory_gb, device_free_bytes(peer.device))
    if refusal is not None:
        raise StageDoesNotFit(refusal)


def peer_fitting_stages(peer: "PeerConfig") -> List[int]:
    """The stages a peer with these settings may serve (what ``--stage auto`` chooses among)."""
    free = device_free_bytes(peer.device)
    return [
        stage
        for stage in range(peer.run.num_stages)
        if memory_refusal(peer_stage_memory(peer, stage), peer.max_memory_gb, free) is None
    ]
