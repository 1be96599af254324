"""Typed DHT records: what peers and trainers announce about themselves, validated on read.

All peers of a run announce under one DHT key (a subkey each), so a trainer or a peer gets a
whole snapshot of the swarm with a single lookup. Records expire on their own: a peer that
dies disappears from the snapshot after ``expiration`` seconds without anyone removing it.
Unknown fields are ignored (newer peers may add some); malformed or foreign records are
dropped with a log line, never trusted.
"""

from __future__ import annotations

import re
from typing import Dict, List, Literal, Optional, Tuple

from hivemind.utils import get_logger
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from swarm.policy.snapshot import PeerInfo

__all__ = [
    "PeerRecord",
    "TrainerRecord",
    "peers_key",
    "trainers_key",
    "validate_run_id",
    "parse_records",
    "to_peer_infos",
]

logger = get_logger(__name__)
_RUN_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def validate_run_id(run_id: str) -> str:
    # hivemind's averaging prefixes may not contain '.', and the id is part of DHT keys
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
        raise ValueError(f"run_id must be 1-64 characters of letters, digits, '_' or '-', got {run_id!r}")
    return run_id


def peers_key(run_id: str) -> str:
    return f"{run_id}_peers"


def trainers_key(run_id: str) -> str:
    return f"{run_id}_trainers"


class _Record(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    version: int = Field(ge=1)


class PeerRecord(_Record):
    """What a stage peer announces, re-stored every announce period with an expiration."""

    peer_id: str = Field(min_length=1, max_length=128)
    stage: int = Field(ge=0, le=4096)
    state: Literal["joining", "online", "leaving"]
    throughput: float = Field(ge=0.0, allow_inf_nan=False)  # samples/s, EMA of real work
    queue_length: int = Field(ge=0)
    step: int = Field(ge=0)  # global steps applied to this replica's parameters
    accum_step: int = Field(ge=0)  # the step that backward passes accumulate into now
    samples_pending: int = Field(ge=0)  # samples accumulated for accum_step
    samples_frozen: int = Field(default=0, ge=0)  # samples of the previous step, being averaged now
    samples_admitted: int = Field(default=0, ge=0)  # samples of backward passes under way (not yet pending)
    samples_applied: int = Field(ge=0)  # samples inside all global steps applied so far
    digest: str = Field(default="", max_length=64)  # hash of the parameters at `step`
    samples_processed: int = Field(default=0, ge=0)  # samples this replica ran backward for
    # recent completed steps: step -> peer ids whose gradients that step averaged
    contributors: Dict[int, List[str]] = Field(default_factory=dict)


class TrainerRecord(_Record):
    """Per-trainer metrics, published so that anyone can watch a run from the DHT."""

    trainer_id: str = Field(min_length=1, max_length=128)
    samples_sent: int = Field(ge=0)
    loss: Optional[float] = Field(default=None, allow_inf_nan=False)
    samples_per_s: float = Field(ge=0.0, allow_inf_nan=False)
    tokens_per_s: float = Field(ge=0.0, allow_inf_nan=False)


def parse_records(raw: object, model: type, *, key: str) -> Dict[str, BaseModel]:
    """Turn the value of a subkeyed DHT entry into validated records keyed by subkey.

    Anything malformed is skipped with a warning; a record of a newer protocol version is kept
    (its unknown fields ignored), an older one is kept too as long as it validates.
    """
    value = getattr(raw, "value", None)
    if value is None:
        return {}
    if not isinstance(value, dict):
        logger.warning(f"ignoring DHT entry {key!r}: expected a dictionary of subkeys, got {type(value).__name__}")
        return {}
    records = {}
    for subkey, item in value.items():
        payload = getattr(item, "value", None)
        try:
            record = model.model_validate(payload)
        except ValidationError as e:
            reason = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()[:3])
            logger.warning(f"ignoring malformed record under {key!r} (subkey {subkey!r}): {reason}")
            continue
        owner = getattr(record, "peer_id", None) or getattr(record, "trainer_id", None)
        if isinstance(subkey, str) and owner != subkey:
            logger.warning(f"ignoring record under {key!r}: subkey {subkey!r} does not match its id {owner!r}")
            continue
        records[owner] = record
    return records


def to_peer_infos(records: Dict[str, PeerRecord], num_stages: int) -> Tuple[PeerInfo, ...]:
    """The plain snapshot that the pure policies take; peers of stages outside the run are dropped."""
    infos = []
    for record in records.values():
        if record.stage >= num_stages:
            logger.warning(f"ignoring peer {record.peer_id}: stage {record.stage} outside 0..{num_stages - 1}")
            continue
        infos.append(PeerInfo(record.peer_id, record.stage, record.state, record.throughput, record.queue_length))
    return tuple(sorted(infos, key=lambda info: (info.stage, info.peer_id)))

