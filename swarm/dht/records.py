"""Typed DHT records: what peers and trainers announce about themselves, and who may write them.

Layout: a stage's records under one DHT key (``stage_key``), or under shards of it once the stage is large
(``shard_key``, :mod:`swarm.policy.directory`), one for trainers (``trainers_key``), one for the
run's manifest (``manifest_key``) and one for trainers' accusations of replicas (``accusations_key``).
Every record is stored under the subkey of its owner, ``[owner:<RSA public key>]``, and signed with that key (hivemind's ``RSASignatureValidator``); the
owner's key is also its libp2p identity, so a record whose ``peer_id``/``trainer_id`` is not the
peer id of the key that signed it is a forgery (``check_record``). ``run_schema_validator`` makes
every run key a dictionary of owner subkeys holding bounded values, so nodes that run it (every
role does) refuse plain values, foreign subkeys and oversized records, both when asked to store
them and when a lookup returns them.

Records expire on their own: a peer that dies disappears from the snapshot after ``expiration``
seconds without anyone removing it. Every field is bounded, so a record's size is bounded by
construction, whatever the number of replicas.
"""

from __future__ import annotations

import hashlib
import re
import typing
from dataclasses import dataclass
from typing import Any, Dict, Generic, List, Literal, Optional, Tuple, Type, TypeVar

import annotated_types
import pydantic.v1 as pydantic_v1
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.utils import MSGPackSerializer, get_logger
from pydantic import AllowInfNan, BaseModel, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo

from swarm.dht.identity import peer_id_of
from swarm.net.addresses import MAX_MADDR_CHARS, MAX_MADDRS
from swarm.policy.directory import MAX_LEVEL, shard_count
from swarm.policy.snapshot import PeerInfo

__all__ = [
    "excluded_by",
    "PeerRecord",
    "TrainerRecord",
    "AccusationRecord",
    "RecordVerdict",
    "stage_key",
    "shard_key",
    "trainers_key",
    "manifest_key",
    "accusations_key",
    "validate_run_id",
    "owner_public_key",
    "check_record",
    "parse_entries",
    "parse_records",
    "record_id_of",
    "update_contributed",
    "rewind_contributed",
    "run_schema",
    "run_schema_validator",
    "to_peer_infos",
    "CONTRIBUTION_WINDOW",
    "MAX_STAGES",
    "MAX_MANIFEST_PAYLOAD_BYTES",
]

logger = get_logger(__name__)
_RUN_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_OWNER_SUBKEY = re.compile(rb"\[owner:([^\]]+)\]")  # exactly hivemind's RSASignatureValidator.local_public_key

MAX_STAGES = 4096
MAX_COUNT = 2**53  # samples and steps: far above any run, small enough for every JSON reader
MAX_ID_LENGTH = 64  # base58 libp2p peer ids are 46 (RSA) to 52 characters
CONTRIBUTION_WINDOW = 64  # steps covered by PeerRecord.contributed_bits
MAX_EXCLUDED = 4  # banned stage-mates a PeerRecord lists (the record must stay under the DHT's value size)
MAX_MANIFEST_PAYLOAD_BYTES = 16384
MAX_KEY_MATERIAL_BYTES = 2048  # an OpenSSH RSA-4096 public key or base64 signature fits
R = TypeVar("R", bound=BaseModel)


def validate_run_id(run_id: str) -> str:
    # hivemind's averaging prefixes may not contain '.', and the id is part of DHT keys
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
        raise ValueError(f"run_id must be 1-64 characters of letters, digits, '_' or '-', got {run_id!r}")
    return run_id


def stage_key(run_id: str, stage: int) -> str:
    return f"{run_id}_stage{stage}"


def shard_key(run_id: str, stage: int, level: int, shard: int) -> str:
    """The key of one shard of a stage's directory (:mod:`swarm.policy.directory`); level 0 is the stage key."""
    if not 0 <= shard < shard_count(level):
        raise ValueError(f"shard {shard} is outside level {level}'s {shard_count(level)} shards")
    return stage_key(run_id, stage) if level == 0 else f"{run_id}_stage{stage}_{level}_{shard}"


def trainers_key(run_id: str) -> str:
    return f"{run_id}_trainers"


def manifest_key(run_id: str) -> str:
    return f"{run_id}_manifest"


def accusations_key(run_id: str) -> str:
    return f"{run_id}_accusations"


class _Record(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    version: int = Field(ge=1, le=65535)


class PeerRecord(_Record):
    """What a stage peer announces, re-stored every announce period with an expiration."""

    peer_id: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    stage: int = Field(ge=0, lt=MAX_STAGES)
    state: Literal["joining", "online", "leaving"]
    throughput: float = Field(ge=0.0, le=1e12, allow_inf_nan=False)  # samples/s, EMA of real work
    queue_length: int = Field(ge=0, le=MAX_COUNT)
    step: int = Field(ge=0, le=MAX_COUNT)  # global steps applied to this replica's parameters
    accum_step: int = Field(ge=0, le=MAX_COUNT)  # the step that backward passes accumulate into now
    samples_pending: int = Field(ge=0, le=MAX_COUNT)  # samples accumulated for accum_step
    samples_frozen: int = Field(default=0, ge=0, le=MAX_COUNT)  # samples of the previous step, being averaged now
    samples_admitted: int = Field(default=0, ge=0, le=MAX_COUNT)  # samples of backward passes under way
    samples_applied: int = Field(ge=0, le=MAX_COUNT)  # samples inside all global steps applied so far
    digest: str = Field(default="", max_length=64)  # hash of the parameters at `step`
    samples_processed: int = Field(default=0, ge=0, le=MAX_COUNT)  # samples this replica ran backward for
    # bit i of contributed_bits: this replica's own gradients were in applied step contributed_base - i
    contributed_base: int = Field(default=0, ge=0, le=MAX_COUNT)
    contributed_bits: int = Field(default=0, ge=0, lt=2**CONTRIBUTION_WINDOW)
    # bit i of tentative_bits: applied step contributed_base - i was averaged by less than a majority of the
    # stage, so a resync may still drop it; whether it kept this replica's gradients is not known yet
    tentative_bits: int = Field(default=0, ge=0, lt=2**CONTRIBUTION_WINDOW)
    # states this replica adopted (each drops the gradients it held), and the lowest step whose gradients the
    # latest adoption dropped: a trainer re-sends a micro-batch taken before an adoption unless it was below
    resets: int = Field(default=0, ge=0, le=MAX_COUNT)
    reset_from: int = Field(default=0, ge=0, le=MAX_COUNT)
    run_hash: str = Field(default="", max_length=16)  # hash of the run settings: tells runs apart
    # stage-mates this replica banned from averaging (for lying), comma-separated, most recent first: trainers
    # stop sending work to a replica that most of its stage-mates banned
    excluded: str = Field(default="", max_length=MAX_EXCLUDED * (MAX_ID_LENGTH + 1))
    # where to reach this peer: its visible multiaddrs, comma-separated (callers connect p2pd to them, see swarm.net.addresses)
    maddrs: str = Field(default="", max_length=MAX_MADDRS * (MAX_MADDR_CHARS + 1))

    @property
    def excluded_peers(self) -> List[str]:
        return [p for p in self.excluded.split(",") if p][:MAX_EXCLUDED]

    @property
    def addresses(self) -> List[str]:
        return [m for m in self.maddrs.split(",") if m][:MAX_MADDRS]

    def contributed_to(self, step: int) -> Optional[bool]:
        """Whether this replica's gradients were included in global step ``step`` (0-based, as
        ``accum_step`` counts): None when that is unknown (the step is not applied yet, or it is
        older than the window of ``CONTRIBUTION_WINDOW`` steps kept in the record)."""
        if step < 0 or step >= self.step or self.is_tentative(step):
            return None
        offset = self.contributed_base - step
        if not 0 <= offset < CONTRIBUTION_WINDOW:
            return None
        return bool(self.contributed_bits >> offset & 1)

    def is_tentative(self, step: int) -> bool:
        """Whether applied step ``step`` is on a lineage that may still be dropped: a minority of the stage
        averaged it, and the replica has neither seen the stage's majority reach it nor given it up."""
        offset = self.contributed_base - step
        return 0 <= step < self.step and 0 <= offset < CONTRIBUTION_WINDOW and bool(self.tentative_bits >> offset & 1)


class TrainerRecord(_Record):
    """Per-trainer metrics, published so that anyone can watch a run from the DHT."""

    trainer_id: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    samples_sent: int = Field(ge=0, le=MAX_COUNT)
    loss: Optional[float] = Field(default=None, ge=-1e9, le=1e9, allow_inf_nan=False)
    samples_per_s: float = Field(ge=0.0, le=1e12, allow_inf_nan=False)
    tokens_per_s: float = Field(ge=0.0, le=1e15, allow_inf_nan=False)


class AccusationRecord(_Record):
    """A trainer's latest accusation: a replica's reply was outvoted by two others at the same step.

    Evidence, not a verdict: readers check the accused themselves (:mod:`swarm.policy.verification`).
    Hashes are :func:`swarm.policy.verification.fingerprint` values; the record stays under 1 KB."""

    trainer_id: str = Field(min_length=1, max_length=MAX_ID_LENGTH)  # the author, who signed it
    accused: str = Field(min_length=1, max_length=MAX_ID_LENGTH)  # the outvoted replica
    witness: str = Field(min_length=1, max_length=MAX_ID_LENGTH)  # a replica whose reply outvoted it
    referee: str = Field(min_length=1, max_length=MAX_ID_LENGTH)  # the other one
    stage: int = Field(ge=0, lt=MAX_STAGES)
    method: Literal["forward", "backward"]
    step: int = Field(ge=0, le=MAX_COUNT)  # the step of the parameters all three replies were computed with
    inputs_hash: str = Field(min_length=1, max_length=32)  # hash of the request (inputs, grad_outputs, targets)
    accused_hash: str = Field(min_length=1, max_length=32)  # hash of the accused replica's reply
    witness_hash: str = Field(min_length=1, max_length=32)  # hash of the witness's reply


def update_contributed(base: int, bits: int, step: int, included: bool) -> Tuple[int, int]:
    """The ``(contributed_base, contributed_bits)`` of a replica after it applies global step ``step``.

    A jump of ``CONTRIBUTION_WINDOW`` or more forgets the whole window (those steps were applied
    elsewhere, e.g. downloaded with the state). A step at or below ``base`` is a step applied again on
    another lineage (the replica gave up its own and downloaded an older state of the stage's): the
    bits of that step and of every later one are dropped first (see :func:`rewind_contributed`)."""
    if step < 0:
        raise ValueError(f"steps are non-negative, got {step}")
    if not 0 <= bits < 2**CONTRIBUTION_WINDOW:
        raise ValueError(f"contributed bits must fit in {CONTRIBUTION_WINDOW} bits, got {bits}")
    if step <= base and bits:
        base, bits = rewind_contributed(base, bits, step)
    shift = step - base
    bits = 0 if shift >= CONTRIBUTION_WINDOW else (bits << shift) & (2**CONTRIBUTION_WINDOW - 1)
    return step, (bits | 1) if included else (bits & ~1)


def rewind_contributed(base: int, bits: int, step: int) -> Tuple[int, int]:
    """Forget the bits of step ``step`` and of every later step: the steps a replica keeps after it adopts
    a state at ``step`` (every step below it)."""
    if step > base:
        return base, bits
    if step <= 0:
        return 0, 0
    shift = base - (step - 1)
    return step - 1, bits >> shift if shift < CONTRIBUTION_WINDOW else 0


# ---- who wrote a record ----


@dataclass(frozen=True)
class RecordVerdict(Generic[R]):
    """The outcome of checking one stored value: the record, or why it was refused."""

    record: Optional[R]
    reason: str = ""


def owner_public_key(subkey: object) -> bytes:
    """The public key inside an ``[owner:<key>]`` subkey; ``ValueError`` for any other subkey."""
    match = _OWNER_SUBKEY.fullmatch(subkey) if isinstance(subkey, bytes) else None
    if match is None:
        raise ValueError(f"subkey {_preview(subkey)} is not an [owner:<public key>] subkey")
    return match.group(1)


def check_record(subkey: object, payload: object, model: Type[R]) -> RecordVerdict[R]:
    """Accept ``payload`` only if it is a valid ``model`` written by the owner of ``subkey``.

    The signature itself is checked by the DHT's ``RSASignatureValidator`` before a value reaches
    the caller; this check binds the record's id (``peer_id`` or ``trainer_id``) to the signer."""
    try:
        owner = peer_id_of(owner_public_key(subkey))
    except ValueError as e:
        return RecordVerdict(None, str(e))
    try:
        record = model.model_validate(payload)
    except ValidationError as e:
        reasons = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()[:3])
        return RecordVerdict(None, f"malformed record from {owner}: {reasons}")
    claimed = record_id_of(record)
    if claimed != owner:
        return RecordVerdict(None, f"record claims to be {claimed!r} but is signed by {owner}")
    return RecordVerdict(record)


def parse_entries(value: object, model: Type[R]) -> Tuple[Dict[str, Tuple[R, float]], List[str]]:
    """The valid records in the value of a subkeyed DHT entry, keyed by their id, each with its
    expiration time, and the reasons for every value refused. A withdrawn record (``None``) is neither."""
    if value is None:
        return {}, []
    if not isinstance(value, dict):
        return {}, [f"expected a dictionary of owner subkeys, got {type(value).__name__}"]
    entries: Dict[str, Tuple[R, float]] = {}
    refused = []
    for subkey, item in value.items():
        payload = getattr(item, "value", None)
        if payload is None:
            continue
        verdict = check_record(subkey, payload, model)
        if verdict.record is None:
            refused.append(verdict.reason)
            continue
        record_id, expiration = record_id_of(verdict.record), float(getattr(item, "expiration_time", 0.0))
        if record_id is None:  # not reached: check_record accepts only a record whose id is its signer's
            refused.append(f"record from {_preview(subkey)} names no peer_id or trainer_id")
            continue
        if record_id not in entries or expiration > entries[record_id][1]:  # one key may come in two spellings
            entries[record_id] = (verdict.record, expiration)
    return entries, refused


def withdrawn_ids(value: object) -> Dict[str, float]:
    """The ids whose owners withdrew their record (``None`` under their owner subkey) in the value of a subkeyed
    DHT entry, each with the withdrawal's expiration time; subkeys of any other form are left out."""
    if not isinstance(value, dict):
        return {}
    withdrawn: Dict[str, float] = {}
    for subkey, item in value.items():
        if getattr(item, "value", 0) is not None:
            continue
        try:
            owner = peer_id_of(owner_public_key(subkey))
        except ValueError:
            continue
        withdrawn[owner] = max(withdrawn.get(owner, 0.0), float(getattr(item, "expiration_time", 0.0)))
    return withdrawn


def parse_records(value: object, model: Type[R]) -> Tuple[Dict[str, R], List[str]]:
    """Like ``parse_entries``, without the expiration times."""
    entries, refused = parse_entries(value, model)
    return {record_id: record for record_id, (record, _) in entries.items()}, refused


def record_id_of(record: BaseModel) -> Optional[str]:
    """Who a record speaks for: ``peer_id`` or ``trainer_id``."""
    return getattr(record, "peer_id", None) or getattr(record, "trainer_id", None)


def _preview(value: object, limit: int = 48) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# ---- the schema that every node of a run enforces ----


class _WireSchema(pydantic_v1.BaseModel):
    class Config:
        # set explicitly: hivemind's SchemaValidator assigns ``Config.extra`` of the schema it is given
        extra = pydantic_v1.Extra.forbid


if typing.TYPE_CHECKING:  # what the constrained types hold, for mypy: it cannot read a type made by a call
    _ManifestPayload = bytes
    _KeyMaterial = bytes
else:
    _ManifestPayload = pydantic_v1.conbytes(strict=True, max_length=MAX_MANIFEST_PAYLOAD_BYTES)
    _KeyMaterial = pydantic_v1.conbytes(strict=True, max_length=MAX_KEY_MATERIAL_BYTES)


class _ManifestWire(_WireSchema):
    payload: _ManifestPayload
    signature: _KeyMaterial
    public_key: _KeyMaterial


def _bounds(info: FieldInfo) -> Dict[str, Any]:
    names = {
        annotated_types.Ge: "ge",
        annotated_types.Gt: "gt",
        annotated_types.Le: "le",
        annotated_types.Lt: "lt",
        annotated_types.MinLen: "min_length",
        annotated_types.MaxLen: "max_length",
        AllowInfNan: "allow_inf_nan",
    }
    bounds = {}
    for item in info.metadata:
        name = names.get(type(item))
        if name is None:
            raise TypeError(f"no wire form for the constraint {item!r}")
        bounds[name] = getattr(item, name)
    return bounds


def _wire_type(name: str, annotation: Any, bounds: Dict[str, Any]) -> Any:
    """The strict pydantic.v1 type of one record field (hivemind's SchemaValidator needs pydantic.v1
    and strict types). Refuses an unbounded field, so that every record's size stays bounded."""
    if typing.get_origin(annotation) is typing.Union:
        inner = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"field {name}: only Optional[X] unions have a wire form")
        return Optional[_wire_type(name, inner[0], bounds)]
    if typing.get_origin(annotation) is Literal:
        return annotation
    if annotation is int and ({"ge", "gt"} & bounds.keys()) and ({"le", "lt"} & bounds.keys()):
        return pydantic_v1.conint(strict=True, **bounds)
    if (
        annotation is float
        and bounds.get("allow_inf_nan") is False
        and ({"ge", "gt"} & bounds.keys())
        and ({"le", "lt"} & bounds.keys())
    ):
        return pydantic_v1.confloat(strict=True, **bounds)
    if annotation is str and "max_length" in bounds:
        return pydantic_v1.constr(strict=True, **bounds)
    raise TypeError(f"field {name}: {annotation} with bounds {bounds} is unbounded or has no wire form")


def _wire_model(model: Type[BaseModel]) -> Type[pydantic_v1.BaseModel]:
    """The record as stored: every field present (``model_dump`` writes them all), strictly typed."""
    fields: Dict[str, Any] = {
        name: (_wire_type(name, info.annotation, _bounds(info)), ...) for name, info in model.model_fields.items()
    }
    return pydantic_v1.create_model(f"{model.__name__}Wire", __base__=_WireSchema, **fields)


_PEER_WIRE = _wire_model(PeerRecord)
_TRAINER_WIRE = _wire_model(TrainerRecord)
_ACCUSATION_WIRE = _wire_model(AccusationRecord)


def run_schema() -> Type[pydantic_v1.BaseModel]:
    """The DHT schema of a run's keys, one field per kind of key: ``stage`` (every shard of every stage's
    directory, ``shard_key``), ``trainers``, ``manifest``, ``accusations``; each a dictionary from owner
    subkeys to a record (or None, a withdrawn record)."""
    fields: Dict[str, Any] = {
        "stage": (_subkeyed(_PEER_WIRE), None),
        "trainers": (_subkeyed(_TRAINER_WIRE), None),
        "manifest": (_subkeyed(_ManifestWire), None),
        "accusations": (_subkeyed(_ACCUSATION_WIRE), None),
    }
    return pydantic_v1.create_model("RunSchema", __base__=_WireSchema, **fields)


def _subkeyed(wire: Any) -> Any:
    """The type of one run key's value: owner subkeys, each to a ``wire`` record or to None (withdrawn). ``wire``
    is ``Any``: the record models are built at import (``_wire_model``), and mypy takes no variable as a type."""
    return Dict[BytesWithPublicKey, Optional[wire]]


def run_key_kinds(run_id: str, num_stages: int) -> Dict[str, str]:
    """Every key of a run -> the ``run_schema`` field that holds it to its record type."""
    if not isinstance(num_stages, int) or not 1 <= num_stages <= MAX_STAGES:
        raise ValueError(f"num_stages must be an integer in 1..{MAX_STAGES}, got {num_stages!r}")
    kinds = {
        shard_key(run_id, stage, level, shard): "stage"
        for stage in range(num_stages)
        for level in range(MAX_LEVEL + 1)
        for shard in range(shard_count(level))
    }
    kinds.update(
        {trainers_key(run_id): "trainers", manifest_key(run_id): "manifest", accusations_key(run_id): "accusations"}
    )
    return kinds


class RunSchemaValidator(SchemaValidator):
    """hivemind's ``SchemaValidator`` over ``run_schema``, with many keys per field: a run has one field per
    kind of record but a key per directory shard (hundreds per stage), and one schema field per key would
    make every validation walk them all."""

    def __init__(self, run_id: str, num_stages: int):
        super().__init__(run_schema(), allow_extra_keys=True)
        self._key_id_to_field_name = {
            key_id(key): kind for key, kind in run_key_kinds(validate_run_id(run_id), num_stages).items()
        }


def key_id(key: str) -> bytes:
    """``DHTID.generate(source=key).to_bytes()`` without the detour through a 160-bit int: the SHA-1 of the
    key's msgpack form. A run of many stages has thousands of shard keys, all hashed when a node starts."""
    return hashlib.sha1(MSGPackSerializer.dumps(key)).digest()


def run_schema_validator(run_id: str, num_stages: int) -> SchemaValidator:
    """A validator that holds the run's keys to ``run_schema``; other keys (averaging) stay free."""
    return RunSchemaValidator(run_id, num_stages)


# ---- snapshots for the policies ----


def excluded_by(records: Dict[str, PeerRecord], stage: int) -> Dict[str, List[str]]:
    """Each online replica of ``stage`` -> the stage-mates it announces as banned from averaging (the input of
    :func:`swarm.policy.aggregation.banned_by_majority`)."""
    return {r.peer_id: r.excluded_peers for r in records.values() if r.stage == stage and r.state == "online"}


def to_peer_infos(records: Dict[str, PeerRecord], num_stages: int) -> Tuple[PeerInfo, ...]:
    """The plain snapshot that the pure policies take; peers of stages outside the run are dropped."""
    infos = []
    for record in records.values():
        if record.stage >= num_stages:
            logger.warning(f"ignoring peer {record.peer_id}: stage {record.stage} outside 0..{num_stages - 1}")
            continue
        infos.append(PeerInfo(record.peer_id, record.stage, record.state, record.throughput, record.queue_length))
    return tuple(sorted(infos, key=lambda info: (info.stage, info.peer_id)))
