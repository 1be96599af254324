"""Whether tensors hold only finite values, at the cost of a sum rather than of an element-wise test.

Every tensor a peer or trainer receives or computes on the hot path (activations, their gradients,
a backward's parameter gradients, decoded payloads) is refused if it holds a NaN or an infinity.
``torch.isfinite(t).all()`` builds a boolean tensor as large as ``t`` and is slow on CPU: over the
1.7M parameter gradients of one stage of the default benchmark model it takes about 8 ms, against
0.6 ms for their sums, once per backward.

An IEEE sum is finite only if every term is: a NaN makes it NaN, an infinity makes it infinite (or
NaN, with an infinity of the other sign). So a finite sum proves a tensor finite. A non-finite sum
means a non-finite value or finite values whose sum overflows; only then does the element-wise
test run, and it decides. The answer is always the element-wise one.
"""

from __future__ import annotations

import torch

__all__ = ["all_finite"]


def all_finite(tensor: torch.Tensor) -> bool:
    """True iff no element of ``tensor`` is NaN or infinite (integer and bool tensors always are finite)."""
    if not tensor.is_floating_point():
        return bool(torch.isfinite(tensor).all())
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())
