"""The model config every architecture shares, the stage interface, and a small GPT-style decoder LM
cut into contiguous pipeline stages (the default architecture).

Read top to bottom: config, attention, MLP, block, the partition of layers into stages, the
interface every stage implements (:class:`PipelineStage`), the GPT stage, and its deterministic
builder. The Llama architecture lives in :mod:`swarm.model.llama`; :mod:`swarm.model.stages`
picks one by ``ModelConfig.architecture``.

The model knows nothing about networking. A stage is a plain ``nn.Module``: the first
stage embeds byte tokens, middle stages map hidden states to hidden states, and the last
stage applies the final LayerNorm and LM head and returns the loss, so targets travel with
the micro-batch and logits never leave the peer. Embedding and LM head are not tied,
because they live on different stages (usually different machines).

There is no dropout anywhere: the exact-match and convergence tests compare the swarm with
a single process bit for bit, which needs a deterministic forward pass.
"""

from __future__ import annotations

import abc
import hashlib
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Union, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from swarm.model.finite import all_finite

__all__ = [
    "ARCHITECTURES",
    "MAX_BATCH_SIZE",
    "ModelConfig",
    "layer_ranges",
    "PipelineStage",
    "StageModule",
    "build_stage",
    "check_seed",
    "seeded_generator",
]

ARCHITECTURES = ("gpt", "llama")

# Upper bound on the samples in one request a stage accepts; guards a peer against a
# request that would exhaust its memory. A server may lower it per module.
MAX_BATCH_SIZE = 4096

_INIT_STD = 0.02  # GPT-2's initialisation scale for embeddings and linear weights
_LLAMA_FFN_MULTIPLE = 256  # Llama rounds its default SwiGLU width up to a multiple of this


def _require_positive_int(name: str, value: object) -> None:
    # bool is an int subclass; `num_layers=True` is a config mistake, not 1 layer
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _require_non_negative_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")


def _require_positive_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


@dataclass
class ModelConfig:
    """Shape of the model; every peer and trainer of a run must use the same one.

    ``architecture`` picks the network: "gpt" (learned positions, LayerNorm, GELU MLP, biases) or
    "llama" (rotary positions, RMSNorm, SwiGLU MLP, grouped-query attention, no biases). The fields
    after it are Llama's; their defaults leave a GPT unchanged. Zero in ``num_kv_heads`` and
    ``intermediate_size`` means the architecture's default (see :attr:`kv_heads`, :attr:`ffn_size`),
    so that a config states only what it changes.
    """

    vocab_size: int = 256  # tokens; 256 = one token per byte
    seq_len: int = 64  # tokens per sample (maximum sequence length)
    num_layers: int = 4  # transformer blocks, split over the pipeline stages
    hidden_size: int = 128  # width of the residual stream
    num_heads: int = 4  # attention heads; must divide hidden_size
    stage_layers: List[int] = field(default_factory=list)  # blocks per stage, e.g. [1, 3]; empty = as even as possible
    architecture: str = "gpt"  # gpt, or llama (RoPE, RMSNorm, SwiGLU MLP, grouped-query attention, no biases)
    num_kv_heads: int = 0  # key/value heads (llama: grouped-query attention, must divide num_heads); 0 = num_heads
    intermediate_size: int = 0  # MLP width; 0 = 4 * hidden_size (gpt) or Llama's 8/3 * hidden_size rounded up to 256
    rope_theta: float = 10000.0  # llama: base of the rotary position frequencies
    rms_norm_eps: float = 1e-5  # llama: epsilon inside RMSNorm
    tie_embeddings: bool = False  # llama: the LM head reuses the token embedding (single-stage runs only)
    boundary_dim: int = field(
        default=0,
        metadata={
            "help": (
                "width of the activations between stages: 0 = hidden_size; less = each stage but the last ends in a "
                "learned projection to this width and the next projects back (fewer bytes on the wire)"
            )
        },
    )

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "num_layers", "hidden_size", "num_heads"):
            _require_positive_int(name, getattr(self, name))
        self.stage_layers = list(self.stage_layers)
        for count in self.stage_layers:
            _require_positive_int("stage_layers", count)
        if self.stage_layers and sum(self.stage_layers) != self.num_layers:
            raise ValueError(f"stage_layers {self.stage_layers} must add up to num_layers ({self.num_layers})")
        if self.hidden_size % self.num_heads != 0:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        self._check_architecture_fields()
        self._check_boundary()

    def _check_boundary(self) -> None:
        _require_non_negative_int("boundary_dim", self.boundary_dim)
        if self.boundary_dim >= self.hidden_size:
            raise ValueError(
                f"boundary_dim ({self.boundary_dim}) must be less than hidden_size ({self.hidden_size}), "
                "or 0 for activations of the full width: it narrows what travels between stages"
            )

    def _check_architecture_fields(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture must be one of {list(ARCHITECTURES)}, got {self.architecture!r}")
        _require_non_negative_int("num_kv_heads", self.num_kv_heads)
        _require_non_negative_int("intermediate_size", self.intermediate_size)
        _require_positive_float("rope_theta", self.rope_theta)
        _require_positive_float("rms_norm_eps", self.rms_norm_eps)
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"tie_embeddings must be true or false, got {self.tie_embeddings!r}")
        if self.num_heads % self.kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads}): "
                "each key/value head serves a whole group of query heads"
            )
        if self.architecture == "gpt":
            if self.kv_heads != self.num_heads:
                raise ValueError(
                    f"num_kv_heads ({self.num_kv_heads}) must be 0 or num_heads ({self.num_heads}) for "
                    "architecture gpt: grouped-query attention is an architecture llama setting"
                )
            if self.tie_embeddings:
                raise ValueError(
                    "tie_embeddings is an architecture llama setting: the gpt's embedding and LM head are separate"
                )
        elif self.head_dim % 2 != 0:
            raise ValueError(
                f"hidden_size / num_heads ({self.head_dim}) must be even for architecture llama: "
                "rotary embeddings rotate pairs of dimensions"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_heads

    @property
    def wire_width(self) -> int:
        """Width of the hidden states that travel between stages: ``boundary_dim``, or ``hidden_size`` when 0."""
        return self.boundary_dim or self.hidden_size

    @property
    def kv_heads(self) -> int:
        """Key/value heads in effect: ``num_kv_heads``, or ``num_heads`` when that is 0."""
        return self.num_kv_heads or self.num_heads

    @property
    def ffn_size(self) -> int:
        """MLP width in effect: ``intermediate_size``, or the architecture's default when that is 0.

        Llama's default is two thirds of 4 * hidden_size (SwiGLU has three matrices where a GELU MLP
        has two, so this keeps the parameter count) rounded up to a multiple of 256, which gives
        Llama-7B's 11008 for hidden_size 4096."""
        if self.intermediate_size:
            return self.intermediate_size
        if self.architecture == "gpt":
            return 4 * self.hidden_size
        return _LLAMA_FFN_MULTIPLE * -(-(8 * self.hidden_size // 3) // _LLAMA_FFN_MULTIPLE)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only itself and earlier ones."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        q, k, v = self.qkv(x).split(hidden, dim=2)
        # [B, T, H] -> [B, heads, T, H / heads]
        q, k, v = (t.view(batch, length, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, length, hidden))


class MLP(nn.Module):
    """Position-wise feed-forward network, ``ffn_size`` wide (4x by default) with GELU."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(config.hidden_size, config.ffn_size)
        self.proj = nn.Linear(config.ffn_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.hidden_size)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def layer_ranges(num_layers: int, num_stages: int, stage_layers: Sequence[int] = ()) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` layer ranges, one per stage: ``stage_layers`` blocks each if given,
    else sizes differing by at most 1.

    By default the earlier stages get the extra layers: the last stage also carries the LM head
    and the loss, so it is the one that should not get more blocks. An explicit split lets a run
    balance stages whose costs differ for other reasons (the first stage, for one, recomputes its
    forward in every backward pass).
    """
    if stage_layers:
        if len(stage_layers) != num_stages or sum(stage_layers) != num_layers or min(stage_layers) < 1:
            raise ValueError(
                f"stage_layers {list(stage_layers)} must give {num_stages} positive counts "
                f"adding up to num_layers ({num_layers})"
            )
        starts = [sum(stage_layers[:i]) for i in range(num_stages)]
        return [(start, start + count) for start, count in zip(starts, stage_layers)]
    _require_positive_int("num_layers", num_layers)
    _require_positive_int("num_stages", num_stages)
    if num_stages > num_layers:
        raise ValueError(
            f"num_stages ({num_stages}) must not exceed num_layers ({num_layers}): every stage needs at least one layer"
        )
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for stage in range(num_stages):
        end = start + base + (1 if stage < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


class PipelineStage(nn.Module, metaclass=abc.ABCMeta):
    """What a stage of any architecture is to the rest of the swarm: its place in the pipeline, the checks
    a server runs on every request, and the loss of the last stage.

    A subclass builds its layers on the meta device (so that construction never draws from the global RNG)
    and then calls :meth:`_materialise`. Its ``forward(inputs, targets=None, reduction="mean")`` maps token
    ids [B, T] (first stage) or hidden states [B, T, H] to hidden states, or on the last stage to the loss;
    the last stage's LM head is a submodule named ``lm_head`` (servers hook it to read the logits).
    ``forward`` trusts its inputs; a server must call :meth:`check_inputs` first.
    """

    lm_head: nn.Linear  # the last stage's LM head (other stages have none)

    def __init__(self, config: ModelConfig, stage_index: int, num_stages: int):
        super().__init__()
        ranges = layer_ranges(config.num_layers, num_stages, config.stage_layers)
        if isinstance(stage_index, bool) or not isinstance(stage_index, int) or not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index must be an int in [0, {num_stages}), got {stage_index!r}")
        self.config = config
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.layer_range: tuple[int, int] = ranges[stage_index]
        self.max_batch_size = MAX_BATCH_SIZE
        # recompute each block's activations in backward instead of keeping them: less memory for one more forward
        self.checkpoint_activations = False

    def _run_block(self, block: nn.Module, x: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        """``block(x, *args)``, checkpointed when :attr:`checkpoint_activations` is set and autograd records."""
        if self.checkpoint_activations and torch.is_grad_enabled():
            return cast(torch.Tensor, checkpoint(block, x, *args, use_reentrant=False))
        return block(x, *args)

    def _materialise(self, empty: bool) -> None:
        """Allocate the meta-device parameters on the CPU and initialise them as seed 0 would, unless ``empty``:
        then the stage stays a skeleton whose names and shapes describe it without allocating anything."""
        with torch.device("meta"):
            self._build_boundaries()
        if not empty:
            self.allocate("cpu")
            self.reset_parameters(seed=0)

    def _build_boundaries(self) -> None:
        """The learned projections at the stage's ends when the run narrows its activations (``boundary_dim``):
        ``boundary_in`` widens what the previous stage sent back to ``hidden_size``, ``boundary_out`` narrows what
        goes to the next stage. The residual stream crosses the boundary at the narrow width, so the model learns
        what to keep of it; the bytes of the activations and of their gradients shrink by the same factor."""
        width, hidden = self.config.boundary_dim, self.config.hidden_size
        if not width:
            return
        if not self.is_first:
            self.boundary_in = nn.Linear(width, hidden, bias=False)
        if not self.is_last:
            self.boundary_out = nn.Linear(hidden, width, bias=False)

    @torch.no_grad()
    def _reset_boundaries(self, seed: int) -> None:
        """Both halves of a boundary from one generator keyed by the boundary's layer index: the sender's
        ``boundary_out`` is a random [width, hidden] matrix with rows of about unit norm and the receiver's
        ``boundary_in`` its transpose, so the pair starts as (about) a projection onto a random subspace instead of
        a random map. Drawn with ``normal_`` alone, so every machine computes the same bits."""
        width, hidden = self.config.boundary_dim, self.config.hidden_size
        if not width:
            return
        for module, layer, transpose in (
            (getattr(self, "boundary_in", None), self.layer_range[0], True),
            (getattr(self, "boundary_out", None), self.layer_range[1], False),
        ):
            if module is None:
                continue
            basis = torch.empty(width, hidden)
            basis.normal_(0.0, 1.0 / math.sqrt(hidden), generator=seeded_generator(seed, f"boundary.{layer}"))
            module.weight.copy_(basis.T if transpose else basis)

    def _boundary_names(self) -> Dict[str, str]:
        """The boundaries' keys in ``state_dict()`` -> their names in a whole-model checkpoint: the boundary before
        global layer ``i`` is ``boundaries.{i}``, its sender's half ``down`` and its receiver's ``up``."""
        names = {}
        if hasattr(self, "boundary_in"):
            names["boundary_in.weight"] = f"boundaries.{self.layer_range[0]}.up.weight"
        if hasattr(self, "boundary_out"):
            names["boundary_out.weight"] = f"boundaries.{self.layer_range[1]}.down.weight"
        return names

    def allocate(self, device: Union[str, torch.device]) -> None:
        """Give a skeleton's parameters uninitialised storage on ``device``; ``load_state_dict`` or
        :meth:`reset_parameters` must fill them. Tied parameters stay one parameter."""
        self.to_empty(device=device)
        self._tie_weights()  # to_empty gives every parameter new storage, tied ones included

    def _tie_weights(self) -> None:
        """Make tied parameters one parameter again (none here; an architecture with tied weights says which)."""

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Initialise every parameter from generators local to (seed, component); see :func:`build_stage`."""
        self._reset_layers(seed)
        self._reset_boundaries(seed)

    @abc.abstractmethod
    def _reset_layers(self, seed: int) -> None:
        """Initialise the architecture's own parameters (all but the boundaries') from generators local to
        (seed, component)."""

    @abc.abstractmethod
    def _hidden(self, inputs: torch.Tensor) -> torch.Tensor:
        """Tokens [B, T] (first stage) or hidden [B, T, H] -> hidden [B, T, H] through this stage's blocks."""

    @abc.abstractmethod
    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last stage's final norm and LM head: hidden [B, T, H] -> logits [B, T, vocab]."""

    def forward(
        self, inputs: torch.Tensor, targets: Optional[torch.Tensor] = None, reduction: str = "mean"
    ) -> torch.Tensor:
        """Tokens [B, T] (first stage) or hidden [B, T, W] -> hidden [B, T, W], or on the last stage the mean loss
        (``reduction="none"``: the loss of every token, [B, T], which a server splits between merged requests).
        W is ``config.wire_width``: ``hidden_size``, or ``boundary_dim`` where the run narrows its boundaries."""
        x = self._hidden(self._widen(inputs))
        if not self.is_last:
            return self._narrow(x)
        return self._loss(self._head(x), targets, reduction)

    def _widen(self, inputs: torch.Tensor) -> torch.Tensor:
        """What the previous stage sent, back at ``hidden_size`` (unchanged without a boundary, or on stage 0)."""
        return self.boundary_in(inputs) if hasattr(self, "boundary_in") else inputs

    def _narrow(self, hidden: torch.Tensor) -> torch.Tensor:
        """What this stage sends on, at ``boundary_dim`` (unchanged without a boundary)."""
        return self.boundary_out(hidden) if hasattr(self, "boundary_out") else hidden

    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        """Next-token logits [B, T, vocab] of the last stage for ``inputs`` (for evaluation and export checks;
        training never moves logits off the peer)."""
        self._require_last()
        return self._head(self._hidden(self._widen(inputs)))

    @abc.abstractmethod
    def checkpoint_names(self) -> Dict[str, str]:
        """Every key of ``state_dict()`` -> its name in a whole-model checkpoint (global layer indices).
        Tied weights map several keys to one name."""

    def _require_last(self) -> None:
        if not self.is_last:
            raise ValueError(
                f"stage {self.stage_index}/{self.num_stages} has no LM head: only the last stage computes logits"
            )

    def _loss(self, logits: torch.Tensor, targets: Optional[torch.Tensor], reduction: str) -> torch.Tensor:
        """The mean cross-entropy (``reduction="none"``: the loss of every token, [B, T], which a server splits
        between merged requests)."""
        if targets is None:
            raise ValueError("targets are required on the last stage")
        if reduction not in ("mean", "none"):
            raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
        losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction=reduction)
        return losses if reduction == "mean" else losses.view(targets.shape)

    def check_inputs(self, inputs: torch.Tensor, targets: Optional[torch.Tensor]) -> None:
        """Raise ValueError describing the first problem with a request for this stage.

        Called by the stage server on every request before any compute, so a malformed
        request gets a clear answer instead of a crash or a silently poisoned gradient.
        """
        where = f"stage {self.stage_index}/{self.num_stages}"
        if not isinstance(inputs, torch.Tensor):
            raise ValueError(f"{where}: inputs must be a torch.Tensor, got {type(inputs).__name__}")
        if self.is_first:
            self._check_tokens("inputs", inputs, where)
        else:
            self._check_hidden(inputs, where)
        batch, length = inputs.shape[:2]
        if self.is_last:
            if targets is None:
                raise ValueError(f"{where}: targets are required on the last stage")
            if not isinstance(targets, torch.Tensor):
                raise ValueError(f"{where}: targets must be a torch.Tensor, got {type(targets).__name__}")
            if tuple(targets.shape) != (batch, length):
                raise ValueError(
                    f"{where}: targets shape {tuple(targets.shape)} must match the inputs' "
                    f"[batch, seq] = {(batch, length)}"
                )
            self._check_tokens("targets", targets, where)
        elif targets is not None:
            raise ValueError(f"{where}: targets are only accepted by the last stage")

    def _check_tokens(self, name: str, tokens: torch.Tensor, where: str) -> None:
        if tokens.dtype != torch.int64:
            raise ValueError(f"{where}: {name} must be int64 token ids, got dtype {tokens.dtype}")
        if tokens.ndim != 2:
            raise ValueError(f"{where}: {name} must be [batch, seq], got shape {tuple(tokens.shape)}")
        self._check_batch_and_length(name, tokens.shape[0], tokens.shape[1], where)
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= self.config.vocab_size:
            raise ValueError(
                f"{where}: {name} token ids must lie in [0, {self.config.vocab_size}), got values in [{low}, {high}]"
            )

    def _check_hidden(self, hidden: torch.Tensor, where: str) -> None:
        expected_dtype = next(self.parameters()).dtype  # hidden states travel in the dtype the stage computes in
        if hidden.dtype != expected_dtype:
            raise ValueError(f"{where}: hidden states must be {expected_dtype}, got dtype {hidden.dtype}")
        width = self.config.wire_width
        if hidden.ndim != 3 or hidden.shape[2] != width:
            raise ValueError(f"{where}: hidden states must be [batch, seq, {width}], got shape {tuple(hidden.shape)}")
        self._check_batch_and_length("hidden states", hidden.shape[0], hidden.shape[1], where)
        if not all_finite(hidden):
            kind = "NaN" if bool(torch.isnan(hidden).any()) else "inf"
            raise ValueError(f"{where}: hidden states contain {kind} values")

    def _check_batch_and_length(self, name: str, batch: int, length: int, where: str) -> None:
        if not 1 <= batch <= self.max_batch_size:
            raise ValueError(f"{where}: {name} batch size must be in [1, {self.max_batch_size}], got {batch}")
        if not 1 <= length <= self.config.seq_len:
            raise ValueError(f"{where}: {name} sequence length must be in [1, {self.config.seq_len}], got {length}")


class StageModule(PipelineStage):
    """One contiguous slice of the GPT. The first stage holds the token+position embeddings, the last the final
    LayerNorm, the LM head and the loss.

    A freshly constructed module is initialised as ``build_stage(config, stage_index,
    num_stages, seed=0)`` would; use :func:`build_stage` to pick the run's seed. ``empty=True``
    leaves it a meta-device skeleton (names and shapes only).
    """

    def __init__(self, config: ModelConfig, stage_index: int, num_stages: int, empty: bool = False):
        super().__init__(config, stage_index, num_stages)
        if config.architecture != "gpt":
            raise ValueError(
                f"StageModule builds architecture gpt, got {config.architecture!r} "
                "(swarm.model.stages.build_stage picks the architecture's stage)"
            )
        with torch.device("meta"):
            if self.is_first:
                self.token_embedding = nn.Embedding(config.vocab_size, config.hidden_size)
                self.position_embedding = nn.Embedding(config.seq_len, config.hidden_size)
            self.blocks = nn.ModuleList(Block(config) for _ in range(*self.layer_range))
            if self.is_last:
                self.ln_f = nn.LayerNorm(config.hidden_size)
                self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._materialise(empty)

    @torch.no_grad()
    def _reset_layers(self, seed: int) -> None:
        """GPT-2 initialisation drawn from generators local to (seed, component).

        Each block is keyed by its global layer index (and the embeddings and head by
        name), so a stage's weights depend on the seed and on which layers it holds, not
        on the global RNG: replicas of a stage start identical, and the same seed gives
        the same network however it is cut into stages.
        """
        # GPT-2 scales residual projections by 1/sqrt(2 * layers) so the residual stream's
        # variance does not grow with depth.
        residual_std = _INIT_STD / math.sqrt(2 * self.config.num_layers)
        if self.is_first:
            gen = seeded_generator(seed, "embeddings")
            self.token_embedding.weight.normal_(0.0, _INIT_STD, generator=gen)
            self.position_embedding.weight.normal_(0.0, _INIT_STD, generator=gen)
        for layer, item in zip(range(*self.layer_range), self.blocks):
            block = cast(Block, item)
            gen = seeded_generator(seed, f"block.{layer}")
            for module in block.modules():
                if isinstance(module, nn.LayerNorm):
                    module.weight.fill_(1.0)
                    module.bias.zero_()
            for linear, std in (
                (block.attn.qkv, _INIT_STD),
                (block.attn.proj, residual_std),
                (block.mlp.fc, _INIT_STD),
                (block.mlp.proj, residual_std),
            ):
                linear.weight.normal_(0.0, std, generator=gen)
                linear.bias.zero_()
        if self.is_last:
            self.ln_f.weight.fill_(1.0)
            self.ln_f.bias.zero_()
            self.lm_head.weight.normal_(0.0, _INIT_STD, generator=seeded_generator(seed, "lm_head"))

    def _hidden(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            positions = torch.arange(inputs.shape[1], device=inputs.device)
            x = self.token_embedding(inputs) + self.position_embedding(positions)
        else:
            x = inputs
        for block in self.blocks:
            x = self._run_block(block, x)
        return x

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden))

    def checkpoint_names(self) -> Dict[str, str]:
        """Block ``j`` of this stage is block ``layer_range[0] + j`` of the model; other names are global already."""
        start, names = self.layer_range[0], {}
        for key in self.state_dict(keep_vars=True):
            if key.startswith("blocks."):
                local, rest = key[len("blocks.") :].split(".", 1)
                names[key] = f"blocks.{start + int(local)}.{rest}"
            else:
                names[key] = key
        return names | self._boundary_names()


def seeded_generator(seed: int, component: str) -> torch.Generator:
    """A CPU generator seeded from (seed, component) by a stable hash, never from global state."""
    digest = hashlib.sha256(f"{seed}:{component}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def check_seed(seed: object) -> None:
    """ValueError unless ``seed`` is an int (a bool is a config mistake)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")


def build_stage(config: ModelConfig, stage_index: int, num_stages: int, seed: int) -> StageModule:
    """The GPT stage, deterministic from (seed, stage_index): replicas of a stage start identical, without touching
    the global RNG state (use a local torch.Generator). :func:`swarm.model.stages.build_stage` picks the
    architecture; this builds the GPT."""
    check_seed(seed)
    stage = StageModule(config, stage_index, num_stages)
    if seed != 0:  # the constructor already initialised with seed 0
        stage.reset_parameters(seed)
    return stage
