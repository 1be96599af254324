"""A small GPT-style decoder LM, cut into contiguous pipeline stages.

Read top to bottom: config, attention, MLP, block, the partition of layers into stages,
one stage, the deterministic stage builder, and all stages chained in one process.

The model knows nothing about networking. A stage is a plain ``nn.Module``: the first
stage embeds byte tokens, middle stages map hidden states to hidden states, and the last
stage applies the final LayerNorm and LM head and returns the loss, so targets travel with
the micro-batch and logits never leave the peer. Embedding and LM head are not tied,
because they live on different stages (usually different machines).

There is no dropout anywhere: the exact-match and convergence tests compare the swarm with
a single process bit for bit, which needs a deterministic forward pass.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from swarm.model.finite import all_finite

__all__ = [
    "MAX_BATCH_SIZE",
    "ModelConfig",
    "layer_ranges",
    "StageModule",
    "build_stage",
    "FullModel",
]

# Upper bound on the samples in one request a stage accepts; guards a peer against a
# request that would exhaust its memory. A server may lower it per module.
MAX_BATCH_SIZE = 4096

_INIT_STD = 0.02  # GPT-2's initialisation scale for embeddings and linear weights


def _require_positive_int(name: str, value: object) -> None:
    # bool is an int subclass; `num_layers=True` is a config mistake, not 1 layer
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass
class ModelConfig:
    """Shape of the GPT; every peer and trainer of a run must use the same one."""

    vocab_size: int = 256  # tokens; 256 = one token per byte
    seq_len: int = 64  # tokens per sample (maximum sequence length)
    num_layers: int = 4  # transformer blocks, split over the pipeline stages
    hidden_size: int = 128  # width of the residual stream
    num_heads: int = 4  # attention heads; must divide hidden_size
    stage_layers: List[int] = field(default_factory=list)  # blocks per pipeline stage, e.g. [1, 3]; empty = as even as possible

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "num_layers", "hidden_size", "num_heads"):
            _require_positive_int(name, getattr(self, name))
        self.stage_layers = list(self.stage_layers)
        for count in self.stage_layers:
            _require_positive_int("stage_layers", count)
        if self.stage_layers and sum(self.stage_layers) != self.num_layers:
            raise ValueError(f"stage_layers {self.stage_layers} must add up to num_layers ({self.num_layers})")
        if self.hidden_size % self.num_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})"
            )


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
    """Position-wise feed-forward network, 4x wide with GELU."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(config.hidden_size, 4 * config.hidden_size)
        self.proj = nn.Linear(4 * config.hidden_size, config.hidden_size)

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
            raise ValueError(f"stage_layers {list(stage_layers)} must give {num_stages} positive counts "
                             f"adding up to num_layers ({num_layers})")
        starts = [sum(stage_layers[:i]) for i in range(num_stages)]
        return [(start, start + count) for start, count in zip(starts, stage_layers)]
    _require_positive_int("num_layers", num_layers)
    _require_positive_int("num_stages", num_stages)
    if num_stages > num_layers:
        raise ValueError(
            f"num_stages ({num_stages}) must not exceed num_layers ({num_layers}): "
            "every stage needs at least one layer"
        )
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for stage in range(num_stages):
        end = start + base + (1 if stage < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


class StageModule(nn.Module):
    """One contiguous slice of the GPT. The first stage holds the token+position embeddings, the last the final LayerNorm, the LM head and the loss.

    A freshly constructed module is initialised as ``build_stage(config, stage_index,
    num_stages, seed=0)`` would; use :func:`build_stage` to pick the run's seed.
    ``forward`` trusts its inputs; a server must call :meth:`check_inputs` first.
    """

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

        # Built on the meta device so that construction never draws from the global RNG;
        # every parameter is then materialised and set by reset_parameters.
        with torch.device("meta"):
            if self.is_first:
                self.token_embedding = nn.Embedding(config.vocab_size, config.hidden_size)
                self.position_embedding = nn.Embedding(config.seq_len, config.hidden_size)
            self.blocks = nn.ModuleList(Block(config) for _ in range(*self.layer_range))
            if self.is_last:
                self.ln_f = nn.LayerNorm(config.hidden_size)
                self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.to_empty(device="cpu")
        self.reset_parameters(seed=0)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
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
            gen = _generator(seed, "embeddings")
            self.token_embedding.weight.normal_(0.0, _INIT_STD, generator=gen)
            self.position_embedding.weight.normal_(0.0, _INIT_STD, generator=gen)
        for layer, block in zip(range(*self.layer_range), self.blocks):
            gen = _generator(seed, f"block.{layer}")
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
            self.lm_head.weight.normal_(0.0, _INIT_STD, generator=_generator(seed, "lm_head"))

    def forward(self, inputs: torch.Tensor, targets: Optional[torch.Tensor] = None, reduction: str = "mean") -> torch.Tensor:
        """Tokens [B, T] (first stage) or hidden [B, T, H] -> hidden [B, T, H], or on the last stage the mean loss
        (``reduction="none"``: the loss of every token, [B, T], which a server splits between merged requests)."""
        if self.is_first:
            positions = torch.arange(inputs.shape[1], device=inputs.device)
            x = self.token_embedding(inputs) + self.position_embedding(positions)
        else:
            x = inputs
        for block in self.blocks:
            x = block(x)
        if not self.is_last:
            return x
        if targets is None:
            raise ValueError("targets are required on the last stage")
        if reduction not in ("mean", "none"):
            raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
        logits = self.lm_head(self.ln_f(x))
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
                f"{where}: {name} token ids must lie in [0, {self.config.vocab_size}), "
                f"got values in [{low}, {high}]"
            )

    def _check_hidden(self, hidden: torch.Tensor, where: str) -> None:
        expected_dtype = self.blocks[0].ln_1.weight.dtype
        if hidden.dtype != expected_dtype:
            raise ValueError(f"{where}: hidden states must be {expected_dtype}, got dtype {hidden.dtype}")
        if hidden.ndim != 3 or hidden.shape[2] != self.config.hidden_size:
            raise ValueError(
                f"{where}: hidden states must be [batch, seq, {self.config.hidden_size}], "
                f"got shape {tuple(hidden.shape)}"
            )
        self._check_batch_and_length("hidden states", hidden.shape[0], hidden.shape[1], where)
        if not all_finite(hidden):
            kind = "NaN" if bool(torch.isnan(hidden).any()) else "inf"
            raise ValueError(f"{where}: hidden states contain {kind} values")

    def _check_batch_and_length(self, name: str, batch: int, length: int, where: str) -> None:
        if not 1 <= batch <= self.max_batch_size:
            raise ValueError(f"{where}: {name} batch size must be in [1, {self.max_batch_size}], got {batch}")
        if not 1 <= length <= self.config.seq_len:
            raise ValueError(f"{where}: {name} sequence length must be in [1, {self.config.seq_len}], got {length}")


def _generator(seed: int, component: str) -> torch.Generator:
    """A CPU generator seeded from (seed, component) by a stable hash, never from global state."""
    digest = hashlib.sha256(f"{seed}:{component}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def build_stage(config: ModelConfig, stage_index: int, num_stages: int, seed: int) -> StageModule:
    """Deterministic init from (seed, stage_index): replicas of a stage start identical, without touching the global RNG state (use a local torch.Generator)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    stage = StageModule(config, stage_index, num_stages)
    if seed != 0:  # the constructor already initialised with seed 0
        stage.reset_parameters(seed)
    return stage


class FullModel(nn.Module):
    """All stages chained in one process (for single-process baselines and exact-match tests); built from build_stage(...) for each stage with the same seed so it starts from exactly the same initialisation as the swarm."""

    def __init__(self, config: ModelConfig, num_stages: int, seed: int):
        super().__init__()
        self.config = config
        self.stages = nn.ModuleList(build_stage(config, index, num_stages, seed) for index in range(num_stages))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over all B*T positions."""
        x = tokens
        for stage in self.stages[:-1]:
            x = stage(x)
        return self.stages[-1](x, targets)
