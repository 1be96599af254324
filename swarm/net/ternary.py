"""Ternary gradients: the stage all-reduce's codec below 2 bits a value.

A replica's gradient is cut into blocks of :data:`TERNARY_BLOCK` (64) values. In each block the values larger
in magnitude than :data:`THRESHOLD` (0.3) times the block's mean magnitude travel as their sign times one scale,
the mean magnitude of those values (the scale that errs least for the values sent; Li et al., "Ternary weight
networks", 2016); the others travel as 0. Five ternary digits fit one byte (3^5 = 243), so a block costs 13
bytes and a bfloat16 scale: 15 bytes instead of the 256 of float32, 17x fewer. The scale's rounding to bfloat16
errs by at most 2^-8 of it (2^-133 absolute below bfloat16's smallest normal, as float32's, 2^-126).

What a block's encoding misses is dropped, not carried into the next step: the stage's optimizer is AdamW,
which divides each coordinate's step by its own running magnitude, and a residual added back to later
gradients (error feedback) arrives there as a burst that the optimizer scales up. In the emulated training of
``benchmarks/compression.py`` error feedback at threshold 0.7 cost +2.1% and +3.3% over float32 at 100 and 300
steps, and no residual at threshold 0.3 +0.6% and -0.9% (at 0.7 with no residual +1.5% and +0.7%). Since
nothing dropped is sent later, the low threshold lets most coordinates get their update in every step (81% of
a Gaussian block's values go out, 58% at 0.7); and no replica keeps a gradient-sized residual in memory.

The wire length depends only on the vector's size. Every field is distrusted: scales must be finite and
non-negative, each byte below 243, and the digits past the vector's end zero; anything else is a
:class:`~swarm.net.compression.CompressionError`. A NaN or inf in the input is refused, not sent.
"""

from __future__ import annotations

import torch

from swarm.model.finite import all_finite
from swarm.net.compression import CODECS, CompressionError, gradient_codec

__all__ = [
    "GRADIENT_CODECS",
    "TERNARY_BLOCK",
    "check_gradient_codec",
    "decode_ternary",
    "encode_ternary",
    "ternary_bytes",
]

TERNARY_BLOCK = 64  # values per block, with one scale each
THRESHOLD = 0.3  # of the block's mean magnitude: values above it are sent as ±scale
# how a stage's all-reduce may send gradients: what gradients travel in under any codec, and ternary
GRADIENT_CODECS = (*dict.fromkeys(gradient_codec(codec) for codec in CODECS), "ternary")
_DIGITS = 5  # ternary digits per byte
_BYTES_PER_BLOCK = -(-TERNARY_BLOCK // _DIGITS)  # 13
_TABLE = torch.stack([(torch.arange(3**_DIGITS) // 3**i) % 3 for i in range(_DIGITS)], dim=1).to(torch.uint8)


def check_gradient_codec(codec: object) -> str:
    """``codec`` if gradients can travel in it (one of :data:`GRADIENT_CODECS`); ValueError otherwise."""
    if codec not in GRADIENT_CODECS:
        raise ValueError(f"gradients travel in one of {list(GRADIENT_CODECS)}, got {codec!r}")
    return str(codec)


def _blocks(size: int) -> int:
    return -(-size // TERNARY_BLOCK)


def ternary_bytes(size: int) -> int:
    """Bytes of a gradient of ``size`` values: a bfloat16 scale and 13 bytes of digits per block of 64."""
    return (2 + _BYTES_PER_BLOCK) * _blocks(size)


def encode_ternary(vector: torch.Tensor) -> bytes:
    """``vector`` (float, any shape) as scales then digits; same input, same bytes. Raises CompressionError for
    NaN or inf, and for blocks whose scale does not fit bfloat16 (values near float32's largest).

    Memory: besides the float32 input, about 10 bytes a value at the peak (one padded float32 copy, masks,
    one-byte digits)."""
    flat = vector.detach().reshape(-1).to(torch.float32)
    if not all_finite(flat):
        raise CompressionError("gradient holds NaN or inf, which cannot be compressed")
    blocks = _blocks(flat.numel())
    magnitude = torch.zeros(blocks * TERNARY_BLOCK, dtype=torch.float32)  # the only float copy
    magnitude[: flat.numel()] = flat
    magnitude = magnitude.view(blocks, TERNARY_BLOCK)
    negative = magnitude < 0
    magnitude.abs_().div_(TERNARY_BLOCK)  # a block's sum of these is its mean magnitude, always finite
    sent = magnitude > THRESHOLD / TERNARY_BLOCK * magnitude.sum(dim=1, keepdim=True)
    count = sent.sum(dim=1, dtype=torch.int32).clamp_min(1)  # int32: a bool sum would copy to int64 first
    scales = (magnitude.mul_(sent).sum(dim=1) / count * TERNARY_BLOCK).to(torch.bfloat16)
    del magnitude
    if not bool(torch.isfinite(scales).all()):
        raise CompressionError("values this close to float32's largest cannot be sent as ternary")
    digits = sent.to(torch.uint8)  # 0, 1 (+scale), 2 (-scale)
    digits += negative.logical_and_(sent)
    return scales.view(torch.int16).numpy().tobytes() + _pack_blocks(digits, blocks).numpy().tobytes()


def _pack_blocks(digits: torch.Tensor, blocks: int) -> torch.Tensor:
    """Each block's 64 digits in 13 bytes (its last byte holds 4 digits and a zero; the padding past the vector's
    end is zero digits, since padded values are 0). A byte is at most 242: uint8 arithmetic throughout."""
    per_block = torch.zeros(blocks, _BYTES_PER_BLOCK, _DIGITS, dtype=torch.uint8)
    per_block.view(blocks, -1)[:, :TERNARY_BLOCK] = digits
    packed = per_block[:, :, 0].clone()
    for place in range(1, _DIGITS):
        packed += per_block[:, :, place] * 3**place
    return packed.view(-1)


def decode_ternary(data: bytes, size: int) -> torch.Tensor:
    """The float32 vector of ``size`` values that ``data`` encodes, every field checked (see the module)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise CompressionError(f"a gradient has a non-negative size, got {size!r}")
    if len(data) != ternary_bytes(size):
        raise CompressionError(f"ternary data of {size} values takes {ternary_bytes(size)} bytes, got {len(data)}")
    blocks = _blocks(size)
    if not blocks:
        return torch.zeros(0)
    raw = bytearray(data)
    scales = torch.frombuffer(raw, dtype=torch.int16, count=blocks).view(torch.bfloat16).to(torch.float32)
    packed = torch.frombuffer(raw, dtype=torch.uint8, offset=2 * blocks)
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise CompressionError("ternary scales must be finite and non-negative")
    if bool((packed >= 3**_DIGITS).any()):
        raise CompressionError(f"a byte of ternary digits lies below {3**_DIGITS}")
    digits = _TABLE[packed.to(torch.int64)].view(blocks, _BYTES_PER_BLOCK * _DIGITS)
    if bool(digits[:, TERNARY_BLOCK:].any()) or bool(digits.view(-1)[_beyond(size, blocks)].any()):
        raise CompressionError("ternary data holds values beyond the end of the gradient")
    kept = digits[:, :TERNARY_BLOCK]
    values = (kept == 1).to(torch.float32) - (kept == 2).to(torch.float32)
    values.mul_(scales[:, None])
    values = values.view(-1)[:size].clone()
    if not all_finite(values):
        raise CompressionError("ternary data decodes to NaN or inf")
    return values


def _beyond(size: int, blocks: int) -> torch.Tensor:
    """Positions, among the digits of all blocks, of the values past the vector's end (in its last block)."""
    width = _BYTES_PER_BLOCK * _DIGITS
    last = size - (blocks - 1) * TERNARY_BLOCK
    return torch.arange((blocks - 1) * width + last, (blocks - 1) * width + TERNARY_BLOCK)
