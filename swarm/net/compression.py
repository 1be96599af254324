"""Lossy compression of float tensors for the wire: float16, or 8 or 4 bits per value with a scale per block.

Volunteer links are slow: a home uplink moves a few megabytes a second, and the activations and
gradients that cross between pipeline stages dominate a step's traffic. Sending them in float16
halves the bytes; blockwise int8 cuts them almost four times, and int4 almost eight.

int8 splits the flattened tensor into blocks of ``block_size`` values (the last may be short)
and stores one float32 scale per block, ``absmax / 127``, with each value rounded to the nearest
multiple of its block's scale. A scale per block, rather than one per tensor, bounds each
value's error by the largest value *of its own block*: an outlier coarsens its block only,
and blocks of small values keep their precision (:func:`error_bound` gives the bound). int4 is the
same with ``absmax / 7`` and codes in [-7, 7], two to a byte (the even element in the low four bits,
each stored as ``code + 8``; an odd count pads the last byte with a zero code). Its step is 18 times
int8's, so it rounds with a dither instead of to the nearest code: ``floor(x / scale + u)`` with ``u`` from a
fixed pseudo-random pattern in [0, 1). Nearest rounding sends a small value the same wrong way every time (a
bias that accumulates over the steps of training: +2.3% loss in 6 seeds of ``benchmarks/compression.py``'s
emulation, 300 steps with int4 gradients too, against +0.5% dithered); dithered, a value's error averages out over the values and steps it
meets, and the same input still gives the same bytes. The price is a bound of a whole step instead of half.
It suits activations, whose errors the next stage averages over many values, and not gradients: under int4 a
message's gradients (``grad_*`` keys, :func:`gradient_codec`) and the all-reduce travel in int8.

Input that has no faithful encoding is refused with :class:`CompressionError`: NaN and inf
(which would poison a whole block's scale, or the receiver), and for float16 values beyond
its range (which would silently become inf).

The receiver distrusts every field: the codec must be known, the block size within
[:data:`MIN_BLOCK_SIZE`, :data:`MAX_BLOCK_SIZE`], the data exactly one byte (int8), half a byte
(int4) or two (fp16) per element, the scales exactly one float32 per block, finite and non-negative, the
codes within [-127, 127] or [-7, 7] (and an int4 pad zero), and the decoded values finite. A decoded tensor is
float32, so it takes four bytes of memory per byte of int8 received, and eight per byte of int4.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Tuple

import torch

from swarm.model.finite import all_finite

__all__ = [
    "CODECS",
    "DEFAULT_BLOCK_SIZE",
    "MIN_BLOCK_SIZE",
    "MAX_BLOCK_SIZE",
    "CompressionError",
    "Compressed",
    "check_codec",
    "gradient_codec",
    "check_block_size",
    "compress",
    "decompress",
    "error_bound",
    "num_blocks",
]

CODECS = ("none", "fp16", "int8", "int4")
DEFAULT_BLOCK_SIZE = 256
MIN_BLOCK_SIZE = 64
MAX_BLOCK_SIZE = 4096
INT8_LEVELS = 127  # codes lie in [-127, 127], symmetric around zero so that 0 stays exact
INT4_LEVELS = 7  # codes lie in [-7, 7], likewise
_LEVELS = {"int8": INT8_LEVELS, "int4": INT4_LEVELS}
_DITHER_LENGTH = 65536  # values of int4's dither pattern before it repeats
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FP16_MAX = torch.finfo(torch.float16).max
_MIN_SCALE = torch.finfo(torch.float32).tiny  # a normal float32: keeps x / scale and code * scale accurate
_ROUNDING_SLACK = 2.0**-15  # float32 rounding in the division and the product, in units of the scale
_FP16_RELATIVE_ERROR = 2.0**-11  # half a float16 ulp, relative to the rounded value
_FP16_ABSOLUTE_ERROR = 2.0**-25  # half the smallest float16 subnormal


class CompressionError(ValueError):
    """A tensor that cannot be compressed faithfully, or a compressed tensor that is malformed."""


@dataclass(frozen=True)
class Compressed:
    """A float tensor in compressed form, ready to send (to several peers alike, without compressing again).

    ``data`` holds one int8 code per element (``int8``), two 4-bit codes per byte (``int4``) or the
    float16 values (``fp16``); ``scales`` holds one float32 per block for int8 and int4 and is empty for
    fp16, whose block size is carried but unused. Construction checks that the fields agree with each other.
    """

    codec: str
    shape: Tuple[int, ...]
    block_size: int
    data: bytes
    scales: bytes

    def __post_init__(self) -> None:
        check_codec(self.codec, allow_none=False)
        check_block_size(self.block_size)
        object.__setattr__(self, "shape", _check_shape(self.shape))
        _check_lengths(self)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of payload on the wire (data and scales)."""
        return len(self.data) + len(self.scales)


def check_codec(codec: object, allow_none: bool = True) -> str:
    """``codec`` if it is one of :data:`CODECS` (``"none"`` only where ``allow_none``)."""
    allowed = CODECS if allow_none else CODECS[1:]
    if not isinstance(codec, str) or codec not in allowed:
        raise CompressionError(f"unknown codec {codec!r:.60}; expected one of {list(allowed)}")
    return codec


def gradient_codec(codec: str) -> str:
    """The codec that gradients travel in where values travel in ``codec``: int8 under int4, ``codec`` otherwise.

    A gradient's large values are few and its small ones many, and those set the direction: at int4's step (a
    seventh of the block's largest value) most of them round away, dithered or not. In emulated training
    (``benchmarks/compression.py``'s test model, 1,000 steps) int4 activation gradients cost +10% loss, int4
    activations with int8 gradients +2 to +5%."""
    return "int8" if codec == "int4" else codec


def check_block_size(block_size: object) -> int:
    """``block_size`` if it is an integer within [MIN_BLOCK_SIZE, MAX_BLOCK_SIZE]."""
    if not isinstance(block_size, int) or isinstance(block_size, bool):
        raise CompressionError(f"block size must be an integer, got {type(block_size).__name__}")
    if not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
        raise CompressionError(f"block size {block_size} is outside [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]")
    return block_size


def num_blocks(numel: int, block_size: int) -> int:
    """Blocks that ``numel`` values fill, the last one possibly short."""
    return -(-numel // block_size)


def _check_shape(shape: object) -> Tuple[int, ...]:
    if not isinstance(shape, (tuple, list, torch.Size)):
        raise CompressionError(f"shape must be a sequence of sizes, got {type(shape).__name__}")
    if not all(isinstance(size, int) and not isinstance(size, bool) and size >= 0 for size in shape):
        raise CompressionError("shape must hold non-negative integers")
    return tuple(shape)


def _check_lengths(c: Compressed) -> None:
    if not isinstance(c.data, (bytes, bytearray)) or not isinstance(c.scales, (bytes, bytearray)):
        raise CompressionError("compressed data and scales must be bytes")
    data_bytes = {"int8": c.numel, "int4": -(-c.numel // 2), "fp16": 2 * c.numel}[c.codec]
    if len(c.data) != data_bytes:
        raise CompressionError(f"{c.codec} data of shape {list(c.shape)} needs {data_bytes} bytes, got {len(c.data)}")
    scale_bytes = 4 * num_blocks(c.numel, c.block_size) if c.codec in _LEVELS else 0
    if len(c.scales) != scale_bytes:
        raise CompressionError(
            f"{c.codec} scales of {c.numel} elements in blocks of {c.block_size} need "
            f"{scale_bytes} bytes, got {len(c.scales)}"
        )


def _to_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().numpy().tobytes()


def _from_bytes(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    """A tensor that owns a copy of ``data`` (msgpack's bytes are read-only)."""
    return torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)


def _flat_float32(tensor: torch.Tensor) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in FLOAT_DTYPES:
        kind = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise CompressionError(f"only float32, float16 and bfloat16 tensors can be compressed, got {kind}")
    flat = tensor.detach().cpu().reshape(-1).to(torch.float32)
    if not all_finite(flat):
        raise CompressionError("tensor holds NaN or inf, which cannot be compressed")
    return flat


def _blocks(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    """``flat`` padded with zeros to whole blocks, as (blocks, block_size)."""
    padding = num_blocks(flat.numel(), block_size) * block_size - flat.numel()
    return torch.cat([flat, flat.new_zeros(padding)]).view(-1, block_size)


def _quantize(flat: torch.Tensor, block_size: int, codec: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Codes (int8 values within the codec's levels, same length as ``flat``) and one scale per block (float32)."""
    levels = _LEVELS[codec]
    blocks = _blocks(flat, block_size)
    absmax = blocks.abs().amax(dim=1)
    nonzero = absmax > 0
    scales = torch.where(nonzero, (absmax / levels).clamp_min(_MIN_SCALE), torch.zeros_like(absmax))
    if not bool(torch.isfinite(scales * levels).all()):
        raise CompressionError(f"values this close to float32's largest cannot be quantized to {codec}")
    divisors = torch.where(nonzero, scales, torch.ones_like(scales))
    steps = blocks / divisors[:, None]
    rounded = torch.round(steps) if codec == "int8" else torch.floor(steps + _dither(steps.numel()).view_as(steps))
    codes = rounded.clamp_(-levels, levels).to(torch.int8)
    return codes.view(-1)[: flat.numel()], scales


@functools.lru_cache(maxsize=1)
def _dither_pattern() -> torch.Tensor:
    """Fixed offsets in [0, 1): the same on every machine, so the same input gives the same int4 bytes."""
    return torch.rand(_DITHER_LENGTH, generator=torch.Generator().manual_seed(0))


def _dither(numel: int) -> torch.Tensor:
    """``numel`` offsets of the fixed pattern, repeated as often as needed."""
    pattern = _dither_pattern()
    return pattern.repeat(-(-numel // _DITHER_LENGTH))[:numel]


def _pack_int4(codes: torch.Tensor) -> bytes:
    """Two codes a byte, each as ``code + 8``: the even element in the low four bits, an odd count padded with 0."""
    nibbles = (codes + (INT4_LEVELS + 1)).to(torch.uint8)
    if nibbles.numel() % 2:
        nibbles = torch.cat([nibbles, nibbles.new_full((1,), INT4_LEVELS + 1)])
    pairs = nibbles.view(-1, 2)
    return _to_bytes(pairs[:, 0] | (pairs[:, 1] << 4))


def _unpack_int4(c: Compressed) -> torch.Tensor:
    """The codes of ``c.data`` (int8 values), refusing the one nibble no code makes and a pad that is not zero."""
    packed = _from_bytes(c.data, torch.uint8)
    nibbles = torch.stack([packed & 15, packed >> 4], dim=1).view(-1)
    if bool((nibbles == 0).any()):
        raise CompressionError(f"int4 codes must lie in [-{INT4_LEVELS}, {INT4_LEVELS}]")
    if nibbles.numel() > c.numel and int(nibbles[-1]) != INT4_LEVELS + 1:
        raise CompressionError("int4 data of an odd length must pad its last byte with a zero code")
    return nibbles[: c.numel].to(torch.int8) - (INT4_LEVELS + 1)


def _dequantize(codes: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    """Codes times their block's scale, in one float32 buffer (the receiver's peak memory is 4 bytes a code)."""
    values = torch.zeros(scales.numel() * block_size, dtype=torch.float32)
    values[: codes.numel()] = codes
    values.view(-1, block_size).mul_(scales[:, None])
    return values[: codes.numel()]


def _compress_fp16(flat: torch.Tensor) -> bytes:
    if flat.numel() and float(flat.abs().max()) > _FP16_MAX:
        raise CompressionError(f"tensor holds values beyond float16's range (±{_FP16_MAX:g}); use int8 or none")
    return _to_bytes(flat.to(torch.float16))


def compress(tensor: torch.Tensor, codec: str, block_size: int = DEFAULT_BLOCK_SIZE) -> Compressed:
    """``tensor`` (float32, float16 or bfloat16) in ``codec`` ``"fp16"``, ``"int8"`` or ``"int4"``; same input, same
    bytes.

    ``"none"`` is not accepted: uncompressed tensors are sent as themselves.
    """
    check_codec(codec, allow_none=False)
    check_block_size(block_size)
    flat = _flat_float32(tensor)
    if codec == "fp16":
        return Compressed(codec, tuple(tensor.shape), block_size, _compress_fp16(flat), b"")
    codes, scales = _quantize(flat, block_size, codec)
    data = _pack_int4(codes) if codec == "int4" else _to_bytes(codes)
    return Compressed(codec, tuple(tensor.shape), block_size, data, _to_bytes(scales))


def _decode_scales(c: Compressed) -> torch.Tensor:
    scales = _from_bytes(c.scales, torch.float32)
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise CompressionError(f"{c.codec} scales must be finite and non-negative")
    return scales


def _decode_codes(c: Compressed) -> torch.Tensor:
    codes = _from_bytes(c.data, torch.int8)
    if bool((codes == -INT8_LEVELS - 1).any()):
        raise CompressionError(f"int8 codes must lie in [-{INT8_LEVELS}, {INT8_LEVELS}]")
    return codes


def decompress(c: Compressed) -> torch.Tensor:
    """A writable float32 tensor of ``c.shape``, refusing contents that decode to NaN or inf."""
    if c.codec == "fp16":
        values = _from_bytes(c.data, torch.float16).to(torch.float32)
    else:
        codes = _unpack_int4(c) if c.codec == "int4" else _decode_codes(c)
        values = _dequantize(codes, _decode_scales(c), c.block_size)
    if not all_finite(values):
        raise CompressionError(f"{c.codec} data decodes to NaN or inf")
    return values.view(c.shape)


def error_bound(c: Compressed) -> torch.Tensor:
    """The largest absolute error of each decoded element, as a float32 tensor of ``c.shape``.

    int8: half a quantization step of the element's block, ``scale / 2 = absmax / 254``; int4, which rounds
    with a dither: a whole step, ``scale = absmax / 7``; both
    widened by ``2**-15 * scale`` for float32 rounding in the division and the product. A block
    whose largest value is below ``levels * 2**-126`` uses the step ``2**-126`` instead.
    fp16: half a float16 ulp of the value, at most ``2**-11 * |decoded| + 2**-25``.
    """
    if c.codec == "fp16":
        return decompress(c).abs_().mul_(_FP16_RELATIVE_ERROR).add_(_FP16_ABSOLUTE_ERROR)
    scales = _decode_scales(c) * ((0.5 if c.codec == "int8" else 1.0) + _ROUNDING_SLACK)
    return scales.repeat_interleave(c.block_size)[: c.numel].view(c.shape)
