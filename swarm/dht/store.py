"""Reading and writing the swarm's signed records in a hivemind DHT, every call bounded in time.

Writes go under the writer's own ``[owner:<public key>]`` subkey; the DHT process signs them
(its ``RSASignatureValidator`` holds the same key) and every node that stores or returns them
checks the signature. Reads keep only records whose id is the peer id of the key that signed
them (``swarm.dht.records.check_record``); everything else is dropped with a warning, once per culprit.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from functools import partial
from typing import Any, Dict, Optional, Tuple, Type, TypeVar

from hivemind import DHT
from hivemind.utils import get_dht_time, get_logger
from pydantic import BaseModel

from swarm.dht.node import identity_of, store_in_dht
from swarm.metrics import count_dht
from swarm.dht.records import parse_entries, record_id_of

__all__ = ["fetch_records", "store_record", "parse_value", "warn_once"]

logger = get_logger(__name__)
R = TypeVar("R", bound=BaseModel)
_WARNED_LIMIT = 1024
_warned: "OrderedDict[tuple, None]" = OrderedDict()  # (key, reason) already logged, oldest first


async def store_record(
    dht: DHT, key: str, record: Optional[BaseModel], expiration_s: float, timeout: float = 5.0
) -> bool:
    """Store ``record`` (None withdraws it) under this node's owner subkey of ``key``.

    The record must carry this node's own peer id: readers drop any other as a forgery."""
    identity = identity_of(dht)
    if record is not None and record_id_of(record) != identity.peer_id:
        raise ValueError(f"a record stored by {identity.peer_id} must carry that id, not {record_id_of(record)!r}")
    value = None if record is None else record.model_dump(mode="json")  # msgpack in the DHT wants str map keys
    try:
        stored = bool(
            await asyncio.wait_for(
                dht.run_coroutine(
                    partial(
                        store_in_dht,
                        key=key,
                        subkey=identity.owner_subkey,
                        value=value,
                        expiration_time=get_dht_time() + expiration_s,
                        timeout=timeout,
                    ),
                    return_future=True,
                ),
                timeout + 1.0,
            )
        )
    except (asyncio.TimeoutError, Exception) as e:
        logger.warning(f"DHT store of {key!r} failed: {type(e).__name__}: {e}")
        stored = False
    count_dht("store", stored)
    return stored


async def fetch_records(dht: DHT, key: str, model: Type[R], timeout: float = 5.0, strict: bool = False) -> Dict[str, R]:
    """All valid records under ``key``, keyed by their id (``peer_id`` or ``trainer_id``).

    A failed lookup gives an empty dict and a log line, or with ``strict`` raises ``LookupError``:
    callers that act on absences (a peer is missing, so it died) must not mistake a failed read
    for an empty swarm."""
    identity_of(dht)  # a DHT without the signature validator would return unverified values
    try:
        raw = await asyncio.wait_for(dht.get(key, latest=True, return_future=True), timeout)
    except (asyncio.TimeoutError, Exception) as e:
        count_dht("read", False)
        return _failed(key, e, strict)
    count_dht("read", True)
    return {record_id: record for record_id, (record, _) in parse_value(key, raw, model).items()}


def parse_value(key: str, raw: Any, model: Type[R]) -> Dict[str, Tuple[R, float]]:
    """The valid records of what a lookup of ``key`` returned (``raw``), each with its expiration time;
    every refused one is logged, once per reason."""
    entries, refused = parse_entries(getattr(raw, "value", None), model)
    for reason in refused:
        warn_once(key, reason)
    return entries


def _failed(what: str, error: BaseException, strict: bool) -> Dict[str, Any]:
    logger.warning(f"DHT lookup of {what!r} failed: {type(error).__name__}: {error}")
    if strict:
        raise LookupError(f"DHT lookup of {what!r} failed") from error
    return {}


def warn_once(key: str, reason: str) -> None:
    """One WARNING per (key, reason): a bad record is re-read on every poll and would flood the log."""
    if (key, reason) in _warned:
        logger.debug(f"ignoring a record under {key!r}: {reason}")
        return
    _warned[(key, reason)] = None
    if len(_warned) > _WARNED_LIMIT:
        _warned.popitem(last=False)
    logger.warning(f"ignoring a record under {key!r}: {reason}")
