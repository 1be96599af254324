"""Reading and writing the swarm's typed records in a hivemind DHT, every call bounded in time."""

from __future__ import annotations

import asyncio
from typing import Dict, Optional, Type, TypeVar

from hivemind import DHT
from hivemind.utils import get_dht_time, get_logger
from pydantic import BaseModel

from swarm.records import parse_records

__all__ = ["fetch_records", "store_record"]

logger = get_logger(__name__)
R = TypeVar("R", bound=BaseModel)


async def fetch_records(dht: DHT, key: str, model: Type[R], timeout: float = 5.0,
                        strict: bool = False) -> Dict[str, R]:
    """All valid records under ``key`` (subkey -> record).

    A failed lookup gives an empty dict and a log line, or with ``strict`` raises ``LookupError``:
    callers that act on absences (a peer is missing, so it died) must not mistake a failed read
    for an empty swarm."""
    try:
        raw = await asyncio.wait_for(dht.get(key, latest=True, return_future=True), timeout)
    except (asyncio.TimeoutError, Exception) as e:
        logger.warning(f"DHT lookup of {key!r} failed: {type(e).__name__}: {e}")
        if strict:
            raise LookupError(f"DHT lookup of {key!r} failed") from e
        return {}
    return parse_records(raw, model, key=key)


async def store_record(dht: DHT, key: str, subkey: str, record: Optional[BaseModel], expiration_s: float,
                       timeout: float = 5.0) -> bool:
    value = None if record is None else record.model_dump(mode="json")  # msgpack in the DHT wants str map keys
    try:
        return bool(await asyncio.wait_for(
            dht.store(key, value, get_dht_time() + expiration_s, subkey=subkey, return_future=True), timeout))
    except (asyncio.TimeoutError, Exception) as e:
        logger.warning(f"DHT store of {key!r} failed: {type(e).__name__}: {e}")
        return False
