"""Emulated faulty replicas: a peer started with ``--fault`` corrupts its replies on purpose.

Tests and benchmarks use it to check that trainers detect a bad reply, ban the peer that sent it and
carry on. An honest peer runs with ``fault="none"``, and its replies pass through untouched.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

__all__ = ["FAULTS", "corrupt_reply"]

FAULTS = ("none", "non_numeric_loss", "nan_loss", "nan_outputs", "wrong_shape_outputs", "missing_step")


def corrupt_reply(fault: str, method: str, reply: Dict[str, Any]) -> Dict[str, Any]:
    """``reply`` as a replica with ``fault`` would send it."""
    if fault == "none":
        return reply
    reply = dict(reply)
    if "loss" in reply and fault == "non_numeric_loss":
        reply["loss"] = "not a number"
    elif "loss" in reply and fault == "nan_loss":
        reply["loss"] = float("nan")
    elif fault == "missing_step" and method == "backward":
        reply.pop("step", None)
    for key in ("outputs", "grad_inputs"):
        value = reply.get(key)
        if not isinstance(value, torch.Tensor):
            continue
        if fault == "nan_outputs":
            reply[key] = torch.full_like(value, float("nan"))
        elif fault == "wrong_shape_outputs":
            reply[key] = value[..., :-1].contiguous() if value.ndim >= 1 and value.shape[-1] > 1 else value.unsqueeze(0)
    return reply
