"""The stages of a run's model, whatever its architecture: what servers, trainers and baselines build.

``ModelConfig.architecture`` picks the module (:mod:`swarm.model.gpt` or :mod:`swarm.model.llama`); every
stage has the interface of :class:`~swarm.model.gpt.PipelineStage`, so nothing outside ``swarm.model`` needs
to know which one it holds.
"""

from __future__ import annotations

from typing import Callable, Dict, cast

import torch
import torch.nn as nn

from swarm.model import gpt, llama
from swarm.model.gpt import ModelConfig, PipelineStage

__all__ = ["PipelineStage", "build_stage", "stage_skeleton", "FullModel"]

_BUILDERS: Dict[str, Callable[[ModelConfig, int, int, int], PipelineStage]] = {
    "gpt": gpt.build_stage,
    "llama": llama.build_stage,
}
_CLASSES: Dict[str, type] = {"gpt": gpt.StageModule, "llama": llama.LlamaStage}


def build_stage(config: ModelConfig, stage_index: int, num_stages: int, seed: int) -> PipelineStage:
    """Stage ``stage_index`` of ``num_stages`` of ``config``'s architecture, deterministic from (seed, stage_index):
    replicas of a stage start identical, and the global RNG state is left untouched."""
    return _BUILDERS[config.architecture](config, stage_index, num_stages, seed)


def stage_skeleton(config: ModelConfig, stage_index: int, num_stages: int) -> PipelineStage:
    """The stage on the meta device: its parameter names and shapes, with nothing allocated (for checking a
    checkpoint against the stage, and for counting parameters)."""
    return _CLASSES[config.architecture](config, stage_index, num_stages, empty=True)


class FullModel(nn.Module):
    """All stages chained in one process (for single-process baselines and exact-match tests); built from
    build_stage(...) for each stage with the same seed so it starts from exactly the same initialisation as
    the swarm."""

    def __init__(self, config: ModelConfig, num_stages: int, seed: int):
        super().__init__()
        self.config = config
        self.stages = nn.ModuleList(build_stage(config, index, num_stages, seed) for index in range(num_stages))

    def _last_inputs(self, tokens: torch.Tensor) -> torch.Tensor:
        x = tokens
        for stage in self.stages[:-1]:
            x = stage(x)
        return x

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over all B*T positions."""
        return self.stages[-1](self._last_inputs(tokens), targets)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits [B, T, vocab]."""
        return cast(PipelineStage, self.stages[-1]).logits(self._last_inputs(tokens))
