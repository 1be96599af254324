"""Messages between trainers and stage peers: msgpack maps carrying raw tensors.

Everything that crosses the network is decoded here, with limits, before any of it reaches
torch: a malformed or hostile message becomes a :class:`WireError` with a readable reason,
never a crash, an integer overflow or an oversized allocation. Sizes are checked with Python
integers (which cannot overflow) and capped before they are multiplied, so no shape can make
the byte count wrap around and slip past the length check.

Float tensors may travel compressed (float16, or int8 with a scale per block; see
:mod:`swarm.net.compression`) under their own tag, and always decode to float32. The receiver
checks every field of such an entry before it decodes a byte of it.
"""

from __future__ import annotations

import reprlib
from typing import Any, Dict, List, Mapping, Tuple

import msgpack
import torch

from swarm.net.compression import (
    DEFAULT_BLOCK_SIZE,
    FLOAT_DTYPES,
    Compressed,
    CompressionError,
    check_block_size,
    check_codec,
    gradient_codec,
    compress,
    decompress,
)

__all__ = [
    "WireError",
    "MAX_MESSAGE_BYTES",
    "MIN_COMPRESSED_ELEMENTS",
    "encode",
    "decode",
    "pack_tensor",
    "unpack_tensor",
    "pack_compressed",
    "unpack_compressed",
    "payload_size_hint",
]

MAX_MESSAGE_BYTES = 256 * 2**20  # hard cap on one message (bytes); a stage config may lower it
MAX_TENSOR_DIMS = 8
MAX_TENSOR_ELEMENTS = MAX_MESSAGE_BYTES  # a tensor with more elements cannot fit in a message (1+ byte each)
MAX_NESTING = 32  # lists and maps inside each other; our messages nest 2-3 deep
_DTYPES: Dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_ELEMENT_BYTES = {name: torch.empty((), dtype=dtype).element_size() for name, dtype in _DTYPES.items()}
MIN_COMPRESSED_ELEMENTS = 64  # smaller tensors go uncompressed: the scales and the tag would outweigh the saving
_TENSOR_TAG = "__tensor__"
_COMPRESSED_TAG = "__qtensor__"
_PLAIN = (type(None), bool, int, float, str, bytes)
_brief = reprlib.Repr()
_brief.maxlist = _brief.maxtuple = _brief.maxdict = 10
_brief.maxstring = _brief.maxother = 60


class WireError(ValueError):
    """A message that cannot be decoded or violates the protocol."""


def pack_tensor(tensor: torch.Tensor) -> Dict[str, Any]:
    """The wire form of a tensor, holding a copy of its bytes (safe to keep after the tensor changes)."""
    packed = _pack_tensor_view(tensor)
    packed["data"] = bytes(packed["data"])
    return packed


def _pack_tensor_view(tensor: torch.Tensor) -> Dict[str, Any]:
    """The wire form of a tensor whose data is a read-only view of the tensor's memory, not a copy: for
    :func:`encode`, which serializes it at once (the view keeps the memory alive meanwhile)."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype not in _NAMES:
        raise WireError(f"dtype {tensor.dtype} cannot be sent; supported: {sorted(_DTYPES)}")
    raw = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
    data = raw.numpy().data.cast("B").toreadonly() if raw.numel() else b""
    return {_TENSOR_TAG: True, "dtype": _NAMES[tensor.dtype], "shape": list(tensor.shape), "data": data}


def _wire_shape(shape: Any) -> Tuple[List[int], int]:
    """A wire shape as a list of sizes, and its element count, refusing anything that is not a short list of
    sane sizes.

    Every size is capped before the product is taken, and the running product is capped too,
    so the count stays a small exact integer whatever the sender wrote.
    """
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_TENSOR_DIMS:
        raise WireError(f"tensor shape must be a list of at most {MAX_TENSOR_DIMS} sizes, got {_brief.repr(shape)}")
    count = 1
    for size in shape:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise WireError(f"tensor shape must hold non-negative integers, got {_brief.repr(shape)}")
        if size > MAX_TENSOR_ELEMENTS:
            raise WireError(f"tensor size {size} exceeds the limit of {MAX_TENSOR_ELEMENTS} elements")
        count *= size
        if count > MAX_TENSOR_ELEMENTS:
            raise WireError(f"tensor of shape {_brief.repr(shape)} exceeds the limit of {MAX_TENSOR_ELEMENTS} elements")
    return list(shape), count


def unpack_tensor(obj: Any) -> torch.Tensor:
    """A writable tensor from its wire form, after checking dtype, shape and byte count.

    msgpack hands out immutable ``bytes``, so the data is copied once into a buffer the tensor
    owns: the receiver may then modify it in place (torch refuses to promise that of ``bytes``).
    """
    if not isinstance(obj, Mapping) or obj.get(_TENSOR_TAG) is not True:
        raise WireError(f"expected a tensor, got {type(obj).__name__}")
    dtype_name, data = obj.get("dtype"), obj.get("data")
    if not isinstance(dtype_name, str) or dtype_name not in _DTYPES:
        raise WireError(f"unsupported tensor dtype {_brief.repr(dtype_name)}; supported: {sorted(_DTYPES)}")
    shape, count = _wire_shape(obj.get("shape"))
    if not isinstance(data, (bytes, bytearray)):
        raise WireError(f"tensor data must be bytes, got {type(data).__name__}")
    expected = count * _ELEMENT_BYTES[dtype_name]
    if expected != len(data):
        raise WireError(f"tensor of shape {shape} and dtype {dtype_name} needs {expected} bytes, got {len(data)}")
    dtype = _DTYPES[dtype_name]
    view_dtype = torch.int16 if dtype == torch.bfloat16 else dtype
    flat = torch.frombuffer(bytearray(data), dtype=view_dtype) if data else torch.empty(0, dtype=view_dtype)
    return flat.view(dtype).reshape(shape) if dtype == torch.bfloat16 else flat.reshape(shape)


def pack_compressed(c: Compressed) -> Dict[str, Any]:
    """The wire form of a compressed tensor: the bytes it already holds, so several peers may share one compression."""
    return {
        _COMPRESSED_TAG: True,
        "codec": c.codec,
        "shape": list(c.shape),
        "block_size": c.block_size,
        "data": c.data,
        "scales": c.scales,
    }


def unpack_compressed(obj: Any) -> torch.Tensor:
    """A writable float32 tensor from a compressed entry, after checking every field a sender could lie about."""
    if not isinstance(obj, Mapping) or obj.get(_COMPRESSED_TAG) is not True:
        raise WireError(f"expected a compressed tensor, got {type(obj).__name__}")
    shape, _ = _wire_shape(obj.get("shape"))
    # as the sender wrote them: Compressed checks every field, and that they agree, as it is built
    fields: Tuple[Any, ...] = (
        obj.get("codec"),
        tuple(shape),
        obj.get("block_size"),
        obj.get("data"),
        obj.get("scales"),
    )
    try:
        return decompress(Compressed(*fields))
    except CompressionError as e:
        raise WireError(f"compressed tensor: {e}") from None


def _compresses(tensor: torch.Tensor, codec: str) -> bool:
    return codec != "none" and tensor.dtype in FLOAT_DTYPES and tensor.numel() >= MIN_COMPRESSED_ELEMENTS


def _to_wire(obj: Any, codec: str = "none", block_size: int = DEFAULT_BLOCK_SIZE) -> Any:
    if isinstance(obj, torch.Tensor):
        return pack_compressed(compress(obj, codec, block_size)) if _compresses(obj, codec) else _pack_tensor_view(obj)
    if isinstance(obj, Compressed):
        return pack_compressed(obj)
    if isinstance(obj, Mapping):
        return {key: _to_wire(value, _codec_of(key, codec), block_size) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_wire(value, codec, block_size) for value in obj]
    return obj


def _codec_of(key: Any, codec: str) -> str:
    """The codec for the value under ``key``: gradients (``grad_*``) in :func:`gradient_codec` of ``codec``."""
    return gradient_codec(codec) if isinstance(key, str) and key.startswith("grad") else codec


def _from_wire(obj: Any, depth: int = 0) -> Any:
    if depth > MAX_NESTING:
        raise WireError(f"message nests deeper than {MAX_NESTING} levels")
    if isinstance(obj, dict):
        if _TENSOR_TAG in obj:
            return unpack_tensor(obj)
        if _COMPRESSED_TAG in obj:
            return unpack_compressed(obj)
        return {key: _from_wire(value, depth + 1) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_from_wire(value, depth + 1) for value in obj]
    if not isinstance(obj, _PLAIN):  # msgpack extension types, timestamps
        raise WireError(f"unsupported value of type {type(obj).__name__}")
    return obj


def encode(message: Mapping[str, Any], compression: str = "none", block_size: int = DEFAULT_BLOCK_SIZE) -> bytes:
    """Serialize a map of plain values, tensors and :class:`~swarm.net.compression.Compressed` tensors.

    With ``compression`` ``"fp16"``, ``"int8"`` or ``"int4"`` (gradients, keys ``grad_*``, in int8), float tensors of
    at least
    :data:`MIN_COMPRESSED_ELEMENTS` elements are sent compressed (the receiver gets float32);
    integer tensors such as token ids and targets, and small tensors, are sent exactly. Raises
    :class:`~swarm.net.compression.CompressionError` for a tensor that cannot be compressed
    faithfully (NaN, inf, float16 overflow).
    """
    check_codec(compression)
    check_block_size(block_size)
    return msgpack.packb(_to_wire(message, compression, block_size), use_bin_type=True)


def decode(payload: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> Dict[str, Any]:
    """Parse a message, refusing oversized or malformed input with :class:`WireError`."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise WireError(f"a message must be bytes, got {type(payload).__name__}")
    if len(payload) > max_bytes:
        raise WireError(f"message of {len(payload)} bytes exceeds the limit of {max_bytes} bytes")
    try:
        message = msgpack.unpackb(payload, raw=False, strict_map_key=True, max_bin_len=max_bytes)
    except Exception as e:  # msgpack raises several unrelated exception types on garbage
        raise WireError(f"undecodable message ({type(e).__name__}: {_brief.repr(str(e))})") from None
    if not isinstance(message, dict):
        raise WireError(f"a message must be a map, got {type(message).__name__}")
    return _from_wire(message)


def payload_size_hint(obj: Any, _depth: int = 0) -> int:
    """Bytes of tensor data in a message about to be encoded: decides whether encoding is worth a thread."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Compressed):
        return obj.nbytes
    if _depth > MAX_NESTING:
        return 0
    if isinstance(obj, Mapping):
        return sum(payload_size_hint(value, _depth + 1) for value in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(payload_size_hint(value, _depth + 1) for value in obj)
    return len(obj) if isinstance(obj, (bytes, str)) else 0
