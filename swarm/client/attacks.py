"""Emulated poisoning trainers: a trainer started with ``--attack`` tampers with what it sends.

Tests and attack benchmarks use it to measure what the stages' defences (see
:mod:`swarm.policy.poisoning`) hold back. An honest trainer runs with ``attack="none"`` and sends
its micro-batches untouched.

- ``scaled_grad_outputs``: every stage below the last receives 1000 times the gradient an honest
  trainer would send it (the last stage's grad_inputs are scaled once and relayed down as usual).
- ``shuffled_targets``: each micro-batch's targets are the same tokens in a random order, so they
  keep the data's byte frequencies but no longer follow from the inputs.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["ATTACKS", "GRAD_OUTPUT_SCALE", "TrainerAttack"]

ATTACKS = ("none", "scaled_grad_outputs", "shuffled_targets")
GRAD_OUTPUT_SCALE = 1000.0  # what ``scaled_grad_outputs`` multiplies the gradients by


class TrainerAttack:
    """What a trainer with ``attack`` does to its targets and to the gradients it relays; runs in its event loop."""

    def __init__(self, attack: str = "none", seed: int = 0):
        if attack not in ATTACKS:
            raise ValueError(f"attack must be one of {list(ATTACKS)}, got {attack!r}")
        self.attack = attack
        self._generator = torch.Generator().manual_seed(seed)

    def targets(self, targets: torch.Tensor) -> torch.Tensor:
        """The targets to send with a micro-batch."""
        if self.attack != "shuffled_targets":
            return targets
        order = torch.randperm(targets.numel(), generator=self._generator)
        return targets.reshape(-1)[order].reshape(targets.shape)

    def last_grad_inputs(self, grad_inputs: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The gradient to send down from the last stage's grad_inputs (what the stage below receives)."""
        if self.attack != "scaled_grad_outputs" or grad_inputs is None:
            return grad_inputs
        return grad_inputs * GRAD_OUTPUT_SCALE
