"""A run that starts from a Hugging Face checkpoint: the organiser signs what it is, each peer loads its part.

The organiser (``swarm bootstrap --init_from DIR``) hashes the checkpoint's ``config.json`` and, stage by
stage, the tensors each stage will hold (:func:`sign_checkpoint`); the manifest carries both. A peer given
its own copy of the checkpoint (``swarm peer --init_from DIR``) reads only its stage's tensors and keeps them
only if they hash to what the manifest signs (:func:`initial_stage_tensors`), so a peer with a different or
damaged copy refuses to serve instead of training a model the others do not hold.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence

import torch

from swarm.model.gpt import ModelConfig
from swarm.model.hf_checkpoint import CONFIG_FILE, CheckpointError, PathLike, read_stage_tensors, tensor_digest
from swarm.model.stages import stage_skeleton

__all__ = [
    "CheckpointSignature",
    "config_sha256",
    "checkpoint_stage_digest",
    "sign_checkpoint",
    "initial_stage_tensors",
]


@dataclass(frozen=True)
class CheckpointSignature:
    """What a manifest states about the checkpoint a run starts from: the SHA-256 of its config.json and, per
    stage, the digest of the tensors that stage holds (:func:`swarm.model.hf_checkpoint.tensor_digest` under
    their checkpoint names)."""

    config_sha256: str
    stage_digests: Sequence[str]


def config_sha256(path: PathLike) -> str:
    """SHA-256 (hex) of the checkpoint's ``config.json`` bytes."""
    file = Path(path) / CONFIG_FILE
    try:
        return hashlib.sha256(file.read_bytes()).hexdigest()
    except OSError as e:
        raise CheckpointError(f"cannot read {file}: {e}") from None


def _by_checkpoint_name(
    config: ModelConfig, stage_index: int, num_stages: int, tensors: Dict[str, torch.Tensor]
) -> Dict[str, torch.Tensor]:
    names = stage_skeleton(config, stage_index, num_stages).checkpoint_names()
    return {name: tensors[local] for local, name in names.items()}


def checkpoint_stage_digest(path: PathLike, config: ModelConfig, stage_index: int, num_stages: int) -> str:
    """The digest of stage ``stage_index``'s tensors in the checkpoint, as a stage loaded from it computes it
    (:func:`swarm.model.hf_checkpoint.stage_digest`). Holds one stage's tensors at a time."""
    tensors = read_stage_tensors(path, config, stage_index, num_stages)
    return tensor_digest(_by_checkpoint_name(config, stage_index, num_stages, tensors))


def sign_checkpoint(path: PathLike, config: ModelConfig, num_stages: int) -> CheckpointSignature:
    """Hash the checkpoint in ``path`` for a run of ``num_stages`` stages of ``config``; the checkpoint's
    config must be ``config`` (:class:`CheckpointError` names the first setting that differs)."""
    digests: List[str] = [checkpoint_stage_digest(path, config, stage, num_stages) for stage in range(num_stages)]
    return CheckpointSignature(config_sha256(path), digests)


def initial_stage_tensors(
    path: PathLike, config: ModelConfig, stage_index: int, num_stages: int, signature: CheckpointSignature
) -> Dict[str, torch.Tensor]:
    """Stage ``stage_index``'s tensors from the local checkpoint in ``path`` (keyed as the stage's
    ``state_dict()``), kept only if its config.json and the stage's tensors hash to ``signature``;
    otherwise :class:`CheckpointError` naming both hashes."""
    if len(signature.stage_digests) != num_stages:
        raise CheckpointError(f"the run signs {len(signature.stage_digests)} stage digests for {num_stages} stages")
    local_config = config_sha256(path)
    if local_config != signature.config_sha256:
        raise CheckpointError(
            f"{Path(path) / CONFIG_FILE} has SHA-256 {local_config}, the run's manifest signs "
            f"{signature.config_sha256}: this is not the checkpoint the run starts from"
        )
    tensors = read_stage_tensors(path, config, stage_index, num_stages)
    digest = tensor_digest(_by_checkpoint_name(config, stage_index, num_stages, tensors))
    expected = signature.stage_digests[stage_index]
    if digest != expected:
        raise CheckpointError(
            f"{path}: stage {stage_index}'s tensors hash to {digest}, the run's manifest signs "
            f"{expected}: this copy of the checkpoint differs from the organiser's"
        )
    return tensors
