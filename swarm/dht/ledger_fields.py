"""The fields of a replica's record that a trainer's ledger settles by, carried on the replica's backward replies.

A replica re-stores its record only every announce period (tens of seconds), and a trainer of a run with many
stages reads each stage's records less often still. What the trainer's ledger needs to commit a contribution
(:class:`swarm.client.ledger.ReplicaRecord`: the steps the replica applied, whether its own gradients were in
them, the states it adopted) changes with every step, so each backward reply carries those fields
(``ledger_fields``), and the trainer lays the newest it got over the record it read. The reply comes over the
replica's own authenticated connection: it is as much the replica's word as its signed record is. (Stage-mates
exchange other fields of their records, those the step protocol reads: :mod:`swarm.server.progress`.)
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

from swarm.dht.records import PeerRecord

__all__ = ["LEDGER_FIELDS", "ledger_fields_of", "with_ledger_fields", "ledger_order", "newest"]

LEDGER_FIELDS = (
    "state",
    "step",
    "accum_step",
    "samples_frozen",
    "resets",
    "reset_from",
    "contributed_base",
    "contributed_bits",
    "tentative_bits",
)


def ledger_fields_of(record: PeerRecord) -> Dict[str, Any]:
    """The ledger's fields of ``record``, as a backward reply carries them."""
    return record.model_dump(include=set(LEDGER_FIELDS))


def with_ledger_fields(record: PeerRecord, fields: Any) -> PeerRecord:
    """``record`` with the ledger's fields set from ``fields``; ValueError if ``fields`` is not a complete, valid
    set of them (a record's own bounds apply)."""
    if not isinstance(fields, Mapping) or set(fields) != set(LEDGER_FIELDS):
        got = sorted(map(str, fields)) if isinstance(fields, Mapping) else type(fields).__name__
        raise ValueError(f"ledger fields must be exactly {list(LEDGER_FIELDS)}, got {got}")
    return PeerRecord.model_validate({**record.model_dump(), **fields})


def ledger_order(fields: Mapping[str, Any]) -> Tuple[int, int, int, int]:
    """A key that grows as a replica trains: a state adopted, a step applied, a step frozen, and a tentative
    step confirmed (the only change that leaves the others as they were)."""
    return (
        int(fields["resets"]),
        int(fields["step"]),
        int(fields["accum_step"]),
        -bin(int(fields["tentative_bits"])).count("1"),
    )


def newest(record: PeerRecord, fields: Mapping[str, Any]) -> PeerRecord:
    """``record`` with the ledger ``fields`` of a reply laid over it where they are as new as the record's own or
    newer (fields already validated: :func:`with_ledger_fields` accepted them when the reply came)."""
    if ledger_order(fields) >= ledger_order(ledger_fields_of(record)):
        return with_ledger_fields(record, fields)
    return record
