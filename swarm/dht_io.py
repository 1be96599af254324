"""Reading and writing the swarm's signed records in a hivemind DHT, every call bounded in time.

Writes go under the writer's own ``[owner:<public key>]`` subkey; the DHT process signs them
(its ``RSASignatureValidator`` holds the same key) and every node that stores or returns them
checks the signature. Reads keep only records whose id is the peer id of the key that signed
them (``swarm.records.check_record``); everything else is dropped with a warning, once per culprit.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from functools import partial
from typing import Any, Dict, Optional, Tuple, Type, TypeVar

from hivemind import DHT
from hivemind.utils import get_dht_time, get_logger
from pydantic import BaseModel

from swarm.dht import get_many_in_dht, identity_of
from swarm.reach import address_book
from swarm.records import PeerRecord, parse_entries, record_id_of, stage_key

__all__ = ["fetch_records", "fetch_stage_records", "store_record"]

logger = get_logger(__name__)
R = TypeVar("R", bound=BaseModel)
_WARNED_LIMIT = 1024
_warned: "OrderedDict[tuple, None]" = OrderedDict()  # (key, reason) already logged, oldest first


async def store_record(dht: DHT, key: str, record: Optional[BaseModel], expiration_s: float,
                       timeout: float = 5.0) -> bool:
    """Store ``record`` (None withdraws it) under this node's owner subkey of ``key``.

    The record must carry this node's own peer id: readers drop any other as a forgery."""
    identity = identity_of(dht)
    if record is not None and record_id_of(record) != identity.peer_id:
        raise ValueError(f"a record stored by {identity.peer_id} must carry that id, not {record_id_of(record)!r}")
    value = None if record is None else record.model_dump(mode="json")  # msgpack in the DHT wants str map keys
    try:
        return bool(await asyncio.wait_for(dht.store(
            key, value, get_dht_time() + expiration_s, subkey=identity.owner_subkey, return_future=True), timeout))
    except (asyncio.TimeoutError, Exception) as e:
        logger.warning(f"DHT store of {key!r} failed: {type(e).__name__}: {e}")
        return False


async def fetch_records(dht: DHT, key: str, model: Type[R], timeout: float = 5.0,
                        strict: bool = False) -> Dict[str, R]:
    """All valid records under ``key``, keyed by their id (``peer_id`` or ``trainer_id``).

    A failed lookup gives an empty dict and a log line, or with ``strict`` raises ``LookupError``:
    callers that act on absences (a peer is missing, so it died) must not mistake a failed read
    for an empty swarm."""
    identity_of(dht)  # a DHT without the signature validator would return unverified values
    try:
        raw = await asyncio.wait_for(dht.get(key, latest=True, return_future=True), timeout)
    except (asyncio.TimeoutError, Exception) as e:
        return _failed(key, e, strict)
    return {record_id: record for record_id, (record, _) in _parse(key, raw, model).items()}


async def fetch_stage_records(dht: DHT, run_id: str, num_stages: int, timeout: float = 5.0,
                              strict: bool = False) -> Dict[str, PeerRecord]:
    """The peer records of every stage in one DHT traversal, merged; a record found under the key
    of a stage other than its own is dropped. Failure handling as in ``fetch_records``."""
    identity_of(dht)
    keys = [stage_key(run_id, stage) for stage in range(num_stages)]
    try:
        found = await asyncio.wait_for(dht.run_coroutine(
            partial(get_many_in_dht, keys=keys, timeout=timeout), return_future=True), timeout + 1.0)
    except (asyncio.TimeoutError, Exception) as e:
        return _failed(f"{run_id} stages", e, strict)
    merged: Dict[str, Tuple[PeerRecord, float]] = {}
    for stage, key in enumerate(keys):
        for peer_id, (record, expiration) in _parse(key, found.get(key), PeerRecord).items():
            if record.stage != stage:
                _warn_once(key, f"record of {peer_id} names stage {record.stage}, stored under stage {stage}")
            elif peer_id not in merged or expiration > merged[peer_id][1]:  # a peer that just moved: its newest
                merged[peer_id] = (record, expiration)
    address_book.learn({peer_id: record.addresses for peer_id, (record, _) in merged.items()})
    return {peer_id: record for peer_id, (record, _) in merged.items()}


def _parse(key: str, raw: Any, model: Type[R]) -> Dict[str, Tuple[R, float]]:
    entries, refused = parse_entries(getattr(raw, "value", None), model)
    for reason in refused:
        _warn_once(key, reason)
    return entries


def _failed(what: str, error: BaseException, strict: bool) -> Dict[str, Any]:
    logger.warning(f"DHT lookup of {what!r} failed: {type(error).__name__}: {error}")
    if strict:
        raise LookupError(f"DHT lookup of {what!r} failed") from error
    return {}


def _warn_once(key: str, reason: str) -> None:
    """One WARNING per (key, reason): a bad record is re-read on every poll and would flood the log."""
    if (key, reason) in _warned:
        logger.debug(f"ignoring a record under {key!r}: {reason}")
        return
    _warned[(key, reason)] = None
    if len(_warned) > _WARNED_LIMIT:
        _warned.popitem(last=False)
    logger.warning(f"ignoring a record under {key!r}: {reason}")
