"""Periodic on-disk checkpoints of a stage's state, so a stage that lost every replica can resume.

A checkpoint holds what a joining replica would download from a live one (parameters, AdamW
moments, step) plus the run id, so a peer never restores another run's or another stage's state.
Writes are atomic (temporary file, then rename): a peer killed mid-write leaves the last good one.
A state with a NaN or infinite value is never written (the last good file stays) and never restored.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

import torch
from hivemind.utils import get_logger

from swarm.model.finite import all_finite

from swarm.server.host import CurrentStage, Loops, Settings, served
from swarm.server.lifecycle import PeerState

__all__ = [
    "checkpoint_path",
    "save_checkpoint",
    "load_checkpoint",
    "non_finite_indices",
    "Checkpointer",
    "CheckpointHost",
]

logger = get_logger(__name__)


def checkpoint_path(directory: str, run_id: str, stage: int) -> Path:
    return Path(directory) / f"{run_id}_stage{stage}.pt"


def non_finite_indices(tensors: Sequence[torch.Tensor]) -> List[int]:
    """The positions of the tensors that hold a NaN or infinite value."""
    return [i for i, t in enumerate(tensors) if not all_finite(t)]


def save_checkpoint(path: Path, run_id: str, metadata: Dict[str, int], tensors: List[torch.Tensor]) -> None:
    """Write the state atomically; ValueError (and the file at ``path`` untouched) if any value is not finite."""
    bad = non_finite_indices(tensors)
    if bad:
        raise ValueError(f"tensors {bad[:5]} hold NaN or infinite values")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save({"run_id": run_id, "metadata": dict(metadata), "tensors": tensors}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, run_id: str, stage: int) -> Optional[Tuple[Dict[str, int], List[torch.Tensor]]]:
    """The (metadata, tensors) stored at ``path``, or None if there is none; ValueError if it is foreign or corrupt."""
    if not path.exists():
        return None
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"checkpoint {path} is unreadable: {type(e).__name__}: {e}") from None
    if not isinstance(payload, dict) or payload.get("run_id") != run_id:
        raise ValueError(
            f"checkpoint {path} belongs to run {payload.get('run_id') if isinstance(payload, dict) else '?'}, "
            f"not {run_id}"
        )
    metadata, tensors = payload.get("metadata"), payload.get("tensors")
    if not isinstance(metadata, dict) or metadata.get("stage") != stage or not isinstance(tensors, list):
        raise ValueError(f"checkpoint {path} does not hold stage {stage}")
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ValueError(f"checkpoint {path} is corrupt: its state holds something other than tensors")
    bad = non_finite_indices(tensors)
    if bad:
        raise ValueError(f"checkpoint {path} holds NaN or infinite values (tensors {bad[:5]}); refusing to restore it")
    return metadata, tensors


class CheckpointHost(Settings, CurrentStage, Loops, Protocol):
    """What checkpoints read of the peer: the stage it serves and the state it holds of it."""

    def shared_state(self) -> Tuple[Dict[str, Any], List[torch.Tensor]]: ...


class Checkpointer:
    """Saves the stage a peer serves every ``checkpoint_period_s`` (and when it leaves); restores it on joining."""

    def __init__(self, peer: CheckpointHost):
        self.peer = peer

    def _path(self) -> Optional[Path]:
        """Where the stage's checkpoint lives; None without a checkpoint directory or before the peer chose a stage."""
        peer = self.peer
        if not peer.config.checkpoint_dir or peer.stage is None:
            return None
        return checkpoint_path(peer.config.checkpoint_dir, peer.run.run_id, peer.stage)

    async def restore(self) -> bool:
        path, peer = self._path(), self.peer
        if path is None:
            return False
        stage = served(peer.stage, "stage")  # there is one: _path gave a path
        loaded = await asyncio.get_running_loop().run_in_executor(None, load_checkpoint, path, peer.run.run_id, stage)
        if loaded is None:
            return False
        runner = served(peer.runner, "runner")
        await peer.compute.run(runner.load_state, *loaded)
        logger.info(f"stage {peer.stage}: restored from checkpoint {path} at step {runner.step}")
        return True

    async def save(self) -> Optional[Path]:
        path, peer = self._path(), self.peer
        if path is None or peer.runner is None or peer.state != PeerState.ONLINE:
            return None
        metadata, tensors = await peer.compute.run(peer.shared_state)
        try:
            await asyncio.get_running_loop().run_in_executor(
                None, save_checkpoint, path, peer.run.run_id, metadata, tensors
            )
        except ValueError as e:
            logger.error(
                f"stage {peer.stage}: not checkpointing step {metadata.get('step')}: {e}; "
                f"keeping the last good checkpoint {path}"
            )
            return None
        return path

    async def run(self) -> None:
        peer = self.peer
        while not peer.stopping.is_set():
            await peer.sleep_or_progress(None, peer.config.checkpoint_period_s, peer.config.checkpoint_period_s)
            if peer.stopping.is_set():
                return  # a leaving peer saves its final checkpoint itself (StagePeer.leave)
            try:
                await self.save()
            except Exception:
                logger.exception("checkpoint failed")
