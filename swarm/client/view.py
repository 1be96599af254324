"""What a trainer knows of the swarm between its reads of the DHT.

A trainer reads a few stages' records a refresh (:func:`swarm.policy.directory.stages_to_read`), so the records
of the other stages are as old as its last read of them, past their expiry in a run of many stages. It keeps
them (:func:`held_records`): who serves a stage changes rarely, a failed call makes the trainer read that stage
at once, and what changes with every step comes on the replies of its calls (:mod:`swarm.dht.ledger_fields`),
laid over the records it holds (:func:`with_replies`).
"""

from __future__ import annotations

from typing import Any, Collection, Dict, Mapping, Tuple

from swarm.dht.ledger_fields import newest
from swarm.dht.records import PeerRecord

__all__ = ["held_records", "with_replies"]


def held_records(
    previous: Mapping[str, PeerRecord], fresh: Mapping[str, PeerRecord], read: Collection[int]
) -> Dict[str, PeerRecord]:
    """The records a reader keeps after reading the stages ``read``: those it read (``fresh``, every unexpired
    record it has seen, by peer id), and the ones it held before of the stages it did not read this time,
    unless the peer appears in ``fresh`` (it moved)."""
    read = set(read)
    kept = {
        peer_id: record for peer_id, record in previous.items() if record.stage not in read and peer_id not in fresh
    }
    return {**kept, **fresh}


def with_replies(
    records: Mapping[str, PeerRecord], replied: Mapping[str, Tuple[int, Mapping[str, Any]]]
) -> Dict[str, PeerRecord]:
    """``records`` with the ledger fields of each peer's latest reply (``replied``: peer id -> (the stage it
    replied for, its fields)) laid over its record where the reply is as new or newer and names the record's
    stage."""
    merged: Dict[str, PeerRecord] = {}
    for peer_id, record in records.items():
        entry = replied.get(peer_id)
        merged[peer_id] = newest(record, entry[1]) if entry is not None and entry[0] == record.stage else record
    return merged
