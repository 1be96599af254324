"""The torch device a stage runs on: parsed with the rest of a peer's settings, checked before the peer
joins, and waited for when its work is timed.

A ``--device`` that names no device, or one this machine does not have, is one clear line before the
peer starts its DHT, rather than a traceback after it has started. CUDA kernels run asynchronously:
a timer read right after launching them measures the launch, so a replica timing itself would announce
a speed its device does not have; :func:`synchronize` waits for the queued work first.
"""

from __future__ import annotations

import torch

__all__ = ["SUPPORTED_TYPES", "parse_device", "check_available", "synchronize"]

SUPPORTED_TYPES = ("cpu", "cuda", "mps")


def parse_device(name: str) -> torch.device:
    """``name`` as a torch device of a supported type (ValueError otherwise); says nothing of availability."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"device must be a torch device such as cpu or cuda:0, got {name!r}")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"device must be a torch device such as cpu or cuda:0, got {name!r}") from None
    if device.type not in SUPPORTED_TYPES:
        raise ValueError(f"device must be of type {', '.join(SUPPORTED_TYPES)}, got {name!r}")
    return device


def check_available(device: torch.device) -> None:
    """ValueError, naming what this machine has instead, unless ``device`` can hold tensors here."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            built = "built without CUDA" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise ValueError(
                f"device {device}: no CUDA device is usable on this machine (torch {torch.__version__}, "
                f"{built}); use --device cpu or install a CUDA build of torch"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"device {device}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {device}: MPS is not available on this machine; use --device cpu")


def synchronize(device: torch.device) -> None:
    """Wait until the work queued on ``device`` has run (a no-op on the CPU, whose kernels run when called)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
