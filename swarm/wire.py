"""Messages between trainers and stage peers: msgpack maps carrying raw tensors.

Everything that crosses the network is decoded here, with limits, before any of it reaches
torch: a malformed or hostile message becomes a :class:`WireError` with a readable reason,
never a crash or an oversized allocation.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping

import msgpack
import numpy as np
import torch

__all__ = ["WireError", "MAX_MESSAGE_BYTES", "encode", "decode", "pack_tensor", "unpack_tensor"]

MAX_MESSAGE_BYTES = 256 * 2**20  # hard cap on one message (bytes); a stage config may lower it
MAX_TENSOR_DIMS = 8
_DTYPES: Dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_TENSOR_TAG = "__tensor__"


class WireError(ValueError):
    """A message that cannot be decoded or violates the protocol."""


def pack_tensor(tensor: torch.Tensor) -> Dict[str, Any]:
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype not in _NAMES:
        raise WireError(f"dtype {tensor.dtype} cannot be sent; supported: {sorted(_DTYPES)}")
    raw = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
    return {_TENSOR_TAG: True, "dtype": _NAMES[tensor.dtype], "shape": list(tensor.shape), "data": raw.numpy().tobytes()}


def unpack_tensor(obj: Any) -> torch.Tensor:
    if not isinstance(obj, Mapping) or not obj.get(_TENSOR_TAG):
        raise WireError(f"expected a tensor, got {type(obj).__name__}")
    dtype_name, shape, data = obj.get("dtype"), obj.get("shape"), obj.get("data")
    if dtype_name not in _DTYPES:
        raise WireError(f"unsupported tensor dtype {dtype_name!r}; supported: {sorted(_DTYPES)}")
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_TENSOR_DIMS:
        raise WireError(f"tensor shape must be a list of at most {MAX_TENSOR_DIMS} sizes, got {shape!r}")
    if not all(isinstance(size, int) and not isinstance(size, bool) and size >= 0 for size in shape):
        raise WireError(f"tensor shape must hold non-negative integers, got {shape!r}")
    if not isinstance(data, (bytes, bytearray)):
        raise WireError("tensor data must be bytes")
    dtype = _DTYPES[dtype_name]
    expected = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
    if expected != len(data):
        raise WireError(f"tensor of shape {list(shape)} and dtype {dtype_name} needs {expected} bytes, got {len(data)}")
    view_dtype = torch.int16 if dtype == torch.bfloat16 else dtype
    tensor = torch.frombuffer(bytearray(data), dtype=view_dtype) if data else torch.empty(0, dtype=view_dtype)
    return tensor.view(dtype).reshape(shape) if dtype == torch.bfloat16 else tensor.reshape(shape)


def _to_wire(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return pack_tensor(obj)
    if isinstance(obj, Mapping):
        return {key: _to_wire(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_wire(value) for value in obj]
    return obj


def _from_wire(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        if obj.get(_TENSOR_TAG):
            return unpack_tensor(obj)
        return {key: _from_wire(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_from_wire(value) for value in obj]
    return obj


def encode(message: Mapping[str, Any]) -> bytes:
    """Serialize a map of plain values and tensors."""
    return msgpack.packb(_to_wire(message), use_bin_type=True)


def decode(payload: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> Dict[str, Any]:
    """Parse a message, refusing oversized or malformed input with :class:`WireError`."""
    if len(payload) > max_bytes:
        raise WireError(f"message of {len(payload)} bytes exceeds the limit of {max_bytes} bytes")
    try:
        message = msgpack.unpackb(payload, raw=False, strict_map_key=True, max_bin_len=max_bytes)
    except Exception as e:  # msgpack raises several unrelated exception types on garbage
        raise WireError(f"undecodable message ({type(e).__name__}: {e})") from None
    if not isinstance(message, dict):
        raise WireError(f"a message must be a map, got {type(message).__name__}")
    return _from_wire(message)
