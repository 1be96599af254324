"""Record validators that remember which records they accepted, so that an unchanged record is checked once.

A node checks every record it is asked to store and every record a lookup returns (see :mod:`swarm.dht.node`):
an RSA signature and the run's schema (a pydantic model) per subkey, about 0.25 ms of CPU a record. A
replica reads its stage up to several times a second near a step, each read asks several DHT nodes, and
each answer holds a whole shard of the stage's directory, so the same records, which change about once
an announce period, would be verified again and again.

Whether a record is valid depends only on the record (key, subkey, value with its signature, expiration
time) and on the validators, which do not change once the node runs. So a record exactly equal to one
accepted before is accepted again without checking; anything that differs in one byte or in its
expiration time is checked in full. Only acceptances are remembered (a refused record is checked again
each time it comes), each as the SHA-256 of the whole record (32 bytes, however large the record), at
most ``capacity`` of them, the least recently seen dropped first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Iterable

from hivemind.dht.validation import CompositeValidator, DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer

__all__ = ["RememberingValidator", "ACCEPTED_CAPACITY"]

# accepted records remembered per node: records change about once an announce period, so what comes again is
# what changed in the last seconds (a few shards of about swarm.policy.directory.SHARD_CAPACITY records each) and
# what this node keeps for others
ACCEPTED_CAPACITY = 4096


class RememberingValidator(RecordValidatorBase):
    """``validators`` combined as hivemind combines them (:class:`CompositeValidator`), with the records they
    accepted remembered. Signing and stripping are those of the combination, unchanged."""

    def __init__(self, validators: Iterable[RecordValidatorBase], capacity: int = ACCEPTED_CAPACITY):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        validators = list(validators)
        self._priority = max((validator.priority for validator in validators), default=0)
        self._combined = CompositeValidator(validators)
        self._accepted: "OrderedDict[bytes, None]" = OrderedDict()  # SHA-256 of each accepted record
        self.capacity = capacity
        self.checked = 0  # records checked in full
        self.remembered = 0  # records accepted without checking

    def validate(self, record: DHTRecord) -> bool:
        seen = hashlib.sha256(
            MSGPackSerializer.dumps((record.key, record.subkey, record.value, float(record.expiration_time)))
        ).digest()
        if seen in self._accepted:
            self._accepted.move_to_end(seen)
            self.remembered += 1
            return True
        self.checked += 1
        if not self._combined.validate(record):
            return False
        self._accepted[seen] = None
        if len(self._accepted) > self.capacity:
            self._accepted.popitem(last=False)
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        return self._combined.sign_value(record)

    def strip_value(self, record: DHTRecord) -> bytes:
        return self._combined.strip_value(record)

    @property
    def priority(self) -> int:
        """The highest of the combined validators': as early among other validators as the earliest of them."""
        return self._priority
