"""The training job being placed: model shape, batch, and how many pipeline stages.

The cost model needs three numbers from it: c_dp (bytes of one stage's gradients), c_pp
(bytes of activations one replica sends per iteration) and the floating-point work of one
stage per iteration (only used when devices have known, unequal speeds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["Workload", "PAPER_PP_BYTES", "PAPER_NUM_PARAMS"]

# c_pp of the paper's workload (global batch 1024 over 8 replicas, hidden 2048, sequence 2048,
# fp16 activations), as the planner's specification gives it (~0.48 GB; it reproduces the paper's random-placement
# figures). Other shapes scale it linearly in sequences per replica, hidden size and sequence length.
PAPER_PP_BYTES = 0.48e9
_PAPER_SEQUENCES_PER_REPLICA = 1024 / 8
# The specification gives "1.3 B parameters ... c_dp ~ 0.65 GB per stage" (4 bytes x 1.3e9 / 8): the
# exact GPT-3 XL count (12 L h^2 + V h = 1.311e9) would give 0.655 GB, 0.8% off the specification's
# model. Other shapes scale the quoted count by their exact parameter ratio.
PAPER_NUM_PARAMS = 1.3e9
_GRADIENT_BYTES = 4  # fp32 gradients, as in the paper
_FLOPS_PER_PARAM_TOKEN = 6  # forward (2) + backward (4) per parameter per token


@dataclass(frozen=True)
class Workload:
    """A GPT-style model cut into ``num_stages`` equal stages (the paper's GPT-3 XL by default).

    num_layers: transformer blocks; must divide evenly into num_stages.
    global_batch: sequences per iteration (over all data-parallel replicas).
    hidden, seq_len, vocab: model shape; parameters are 12 * layers * hidden^2 + vocab * hidden.
    num_stages: pipeline stages S.
    dp_bytes / pp_bytes: override c_dp (bytes) and c_pp (bytes at the nominal replica count).
    """

    num_layers: int = 24
    global_batch: int = 1024
    hidden: int = 2048
    seq_len: int = 2048
    vocab: int = 50257
    num_stages: int = 8
    dp_bytes: Optional[float] = None
    pp_bytes: Optional[float] = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "global_batch", "hidden", "seq_len", "vocab", "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_layers % self.num_stages:
            raise ValueError(f"num_layers ({self.num_layers}) must divide into num_stages ({self.num_stages})")
        for name in ("dp_bytes", "pp_bytes"):
            value = getattr(self, name)
            if value is not None and not (value >= 0 and value < float("inf")):
                raise ValueError(f"{name} must be a finite non-negative number of bytes, got {value!r}")

    @property
    def num_params(self) -> float:
        return 12.0 * self.num_layers * self.hidden**2 + float(self.vocab) * self.hidden

    def stage_dp_bytes(self) -> float:
        """c_dp: bytes of one stage's gradients (the paper spreads embeddings over stages too)."""
        if self.dp_bytes is not None:
            return float(self.dp_bytes)
        paper_shape = 12.0 * 24 * 2048**2 + 50257.0 * 2048
        return _GRADIENT_BYTES * PAPER_NUM_PARAMS * (self.num_params / paper_shape) / self.num_stages

    def replica_pp_bytes(self, num_replicas: int) -> float:
        """c_pp: activation bytes one replica sends to the next stage per iteration."""
        if self.pp_bytes is not None:
            return float(self.pp_bytes)
        sequences = self.global_batch / num_replicas
        scale = (sequences / _PAPER_SEQUENCES_PER_REPLICA) * (self.hidden / 2048) * (self.seq_len / 2048)
        return PAPER_PP_BYTES * scale

    def stage_flops(self) -> float:
        """Floating-point work of one stage per iteration, over the whole global batch."""
        params_per_stage = 12.0 * (self.num_layers // self.num_stages) * self.hidden**2
        tokens = float(self.global_batch) * self.seq_len
        return _FLOPS_PER_PARAM_TOKEN * params_per_stage * tokens
