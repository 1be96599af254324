"""Blockwise top-k sparsification with int8 values: the stage all-reduce's gradient codec below 8 bits a value.

A replica's gradient is cut into blocks of :data:`TOPK_BLOCK` (256) values; of each block only the ``k``
values largest in magnitude travel, each as its position in the block (one byte) and an int8 code of the
block's scale (``absmax / 127``, one float32 per block). A block costs ``4 + 2k`` bytes instead of the
1,024 of float32: at ``k = 16`` (one value in 16) that is 28x fewer bytes, at ``k = 8`` 51x.

What is dropped is not lost: the sender keeps it as a residual and adds it to its next gradient before
choosing (error feedback, :class:`ErrorFeedback`), so every coordinate travels eventually and the sum of
what was sent tracks the sum of the true gradients (Stich et al., "Sparsified SGD with memory", 2018).

The wire length depends only on the vector's size and ``k``, so a receiver knows how many bytes a gradient
takes before reading it. Every field is distrusted: positions must rise strictly within a block, stay
inside the vector, codes lie in [-127, 127], scales be finite and non-negative; anything else is a
:class:`~swarm.net.compression.CompressionError`. A NaN or inf in the input is refused, not sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from swarm.model.finite import all_finite
from swarm.net.compression import CODECS, INT8_LEVELS, CompressionError

__all__ = [
    "TOPK_BLOCK",
    "MAX_TOPK",
    "DEFAULT_TOPK",
    "GRADIENT_CODECS",
    "ErrorFeedback",
    "TopK",
    "check_topk",
    "decode_topk",
    "encode_topk",
    "topk_bytes",
]

TOPK_BLOCK = 256  # values per block: a position fits one byte
MAX_TOPK = TOPK_BLOCK // 2  # beyond half a block, int8 of the whole block sends fewer bytes
DEFAULT_TOPK = 16  # one value in 16: 28x fewer bytes than float32
GRADIENT_CODECS = (*CODECS, "topk")  # how a stage's all-reduce may send gradients
_MIN_SCALE = torch.finfo(torch.float32).tiny


def check_topk(k: object) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_TOPK:
        raise ValueError(f"values kept per block of {TOPK_BLOCK} must be an integer in 1..{MAX_TOPK}, got {k!r}")
    return k


def _blocks(size: int) -> int:
    return -(-size // TOPK_BLOCK)


def topk_bytes(size: int, k: int) -> int:
    """Bytes of a gradient of ``size`` values with ``k`` kept per block: scales, positions, codes."""
    blocks = _blocks(size)
    return 4 * blocks + 2 * k * blocks


@dataclass(frozen=True)
class TopK:
    """An encoded gradient: ``data`` is the float32 scales, then the uint8 positions, then the int8 codes."""

    size: int
    k: int
    data: bytes


def encode_topk(vector: torch.Tensor, k: int) -> TopK:
    """The ``k`` largest-magnitude values of each block of ``vector`` (float32, 1-D), int8-coded; same input,
    same bytes. Raises CompressionError for NaN, inf, or values too close to float32's largest."""
    check_topk(k)
    flat = vector.detach().reshape(-1).to(torch.float32)
    if not all_finite(flat):
        raise CompressionError("gradient holds NaN or inf, which cannot be compressed")
    size, blocks = flat.numel(), _blocks(flat.numel())
    padded = torch.zeros(blocks * TOPK_BLOCK, dtype=torch.float32)
    padded[:size] = flat
    rows = padded.view(blocks, TOPK_BLOCK)
    positions = rows.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values
    kept = rows.gather(1, positions)
    absmax = kept.abs().amax(dim=1)
    nonzero = absmax > 0
    scales = torch.where(nonzero, (absmax / INT8_LEVELS).clamp_min(_MIN_SCALE), torch.zeros_like(absmax))
    if not bool(torch.isfinite(scales * INT8_LEVELS).all()):
        raise CompressionError("values this close to float32's largest cannot be quantized to int8")
    divisors = torch.where(nonzero, scales, torch.ones_like(scales))
    codes = torch.round(kept / divisors[:, None]).clamp_(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
    codes[positions >= size - torch.arange(blocks)[:, None] * TOPK_BLOCK] = 0  # padding stays zero
    data = scales.numpy().tobytes() + positions.to(torch.uint8).numpy().tobytes() + codes.numpy().tobytes()
    return TopK(size, k, data)


def decode_topk(data: bytes, size: int, k: int) -> torch.Tensor:
    """The float32 vector of ``size`` values that ``data`` encodes, every field checked (see the module)."""
    check_topk(k)
    if not isinstance(size, int) or size < 0:
        raise CompressionError(f"a gradient has a non-negative size, got {size!r}")
    if len(data) != topk_bytes(size, k):
        raise CompressionError(f"top-{k} data of {size} values takes {topk_bytes(size, k)} bytes, got {len(data)}")
    blocks = _blocks(size)
    raw = bytearray(data)
    scales = torch.frombuffer(raw, dtype=torch.float32, count=blocks) if blocks else torch.empty(0)
    positions = torch.frombuffer(raw, dtype=torch.uint8, count=blocks * k, offset=4 * blocks).to(torch.int64)
    codes = torch.frombuffer(raw, dtype=torch.int8, count=blocks * k, offset=(4 + k) * blocks)
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise CompressionError("top-k scales must be finite and non-negative")
    if bool((codes == -INT8_LEVELS - 1).any()):
        raise CompressionError(f"top-k codes must lie in [-{INT8_LEVELS}, {INT8_LEVELS}]")
    positions, codes = positions.view(blocks, k), codes.view(blocks, k)
    if k > 1 and not bool((positions[:, 1:] > positions[:, :-1]).all()):
        raise CompressionError("top-k positions must rise strictly within each block")
    index = positions + torch.arange(blocks)[:, None] * TOPK_BLOCK
    outside = index >= size
    if bool((codes[outside] != 0).any()):
        raise CompressionError("top-k data holds values beyond the end of the gradient")
    values = torch.zeros(blocks * TOPK_BLOCK, dtype=torch.float32)
    values[index[~outside]] = (codes.to(torch.float32) * scales[:, None])[~outside]
    if not all_finite(values):
        raise CompressionError("top-k data decodes to NaN or inf")
    return values[:size].clone()


class ErrorFeedback:
    """What a sender's top-k dropped, added back to its next gradient: :meth:`prepare` gives the vector to
    encode (the gradient plus the residual), :meth:`settle` keeps what that vector's encoding left out, once the
    encoded gradient was really used (a round this member sat out keeps the old residual)."""

    def __init__(self) -> None:
        self.residual: Optional[torch.Tensor] = None

    def prepare(self, gradient: torch.Tensor) -> torch.Tensor:
        if self.residual is None or self.residual.shape != gradient.shape:
            return gradient
        return gradient + self.residual

    def settle(self, prepared: torch.Tensor, sent: torch.Tensor) -> None:
        self.residual = (prepared - sent).detach()
