"""All-reduce of one stage's gradients among its replicas, and sharing of the stage's state.

A thin subclass of hivemind's ``DecentralizedAverager`` (a separate process): one averager
per stage peer, one group prefix per stage, the group key bits set to the step being
averaged so that replicas at different steps never meet in one group. State sharing hands a
joining replica the parameters, AdamW moments and step through hivemind's download RPC.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from hivemind import DecentralizedAverager
from hivemind.utils import get_logger

__all__ = ["StageAverager", "step_group_bits"]

logger = get_logger(__name__)
GROUP_BITS = 16


def step_group_bits(step: int) -> str:
    return format(step % 2**GROUP_BITS, f"0{GROUP_BITS}b")


class StageAverager(DecentralizedAverager):
    """Averages gradient-shaped tensors; serves ``state_fn()`` to replicas that download state.

    ``state_fn`` runs in the peer's main process (hivemind calls it from a helper thread there)
    and must return (metadata dict, list of tensors).
    """

    def __init__(self, grad_shapes: Sequence[torch.Tensor], state_fn: Callable[[], Tuple[Dict[str, Any], List[torch.Tensor]]],
                 **kwargs: Any):
        self._state_fn = state_fn
        # float64: hivemind applies the average as ``x_i + (avg - x_i)``, which rounds differently on
        # each replica; in float64 the rounding error stays far below float32 resolution, so the
        # replicas' float32 results agree (and the parameter digest catches the rare case they don't)
        super().__init__([torch.zeros_like(t, dtype=torch.float64) for t in grad_shapes], **kwargs)

    def get_current_state(self):
        metadata, tensors = self._state_fn()
        return metadata, tensors, None

    async def average(self, step: int, mean_grads: Sequence[torch.Tensor], samples: int, gather: Dict[str, Any],
                      matchmaking_timeout: float, timeout: float) -> Optional[Tuple[List[torch.Tensor], Dict[str, Any]]]:
        """One all-reduce round for ``step``: returns (averaged grads, gathered metadata by peer) or None on failure.

        ``matchmaking_timeout`` bounds the search for a group: a short one lets the caller notice
        quickly that a replica died and go on without it."""
        await asyncio.get_running_loop().run_in_executor(None, lambda: self.set_group_bits(step_group_bits(step)))
        with self.get_tensors() as tensors:
            for dst, src in zip(tensors, mean_grads):
                dst.copy_(src.to(torch.float64))
        try:
            control = self.step(gather=gather, weight=float(max(samples, 1e-6)), timeout=matchmaking_timeout,
                                wait=False, allow_retries=False)
            gathered = await asyncio.wait_for(control, timeout=timeout + 5)
        except Exception as e:
            logger.info(f"averaging step {step} failed: {type(e).__name__}: {e}")
            return None
        if not gathered:
            return None
        with self.get_tensors() as tensors:
            averaged = [t.clone() for t in tensors]
        return averaged, {str(peer): data for peer, data in gathered.items()}
