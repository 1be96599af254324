"""A validator that remembers accepted records: an unchanged record is verified once, anything else in full."""

from __future__ import annotations

import dataclasses

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarm.dht.identity import load_or_create_identity
from swarm.dht.records import PeerRecord, run_schema_validator, stage_key
from swarm.dht.validator_cache import RememberingValidator

RUN_ID, NUM_STAGES = "cache_run", 2


class _Counting(RSASignatureValidator):
    """hivemind's signature check, counting the records it verifies."""

    def __init__(self, private_key):
        super().__init__(private_key)
        self.verified = 0

    def validate(self, record: DHTRecord) -> bool:
        self.verified += 1
        return super().validate(record)


def _setup():
    owner = load_or_create_identity(None)
    counting = _Counting(owner.private_key)
    validator = RememberingValidator([counting, run_schema_validator(RUN_ID, NUM_STAGES)], capacity=3)
    return owner, counting, validator


def _record(owner, step: int = 0, expiration: float = None) -> DHTRecord:
    value = PeerRecord(version=1, peer_id=owner.peer_id, stage=1, state="online", throughput=12.5, queue_length=1,
                       step=3, accum_step=3, samples_pending=8, samples_applied=96).model_dump(mode="json")
    return DHTRecord(DHTID.generate(source=stage_key(RUN_ID, 1)).to_bytes(), MSGPackSerializer.dumps(owner.owner_subkey),
                     MSGPackSerializer.dumps({**value, "step": step}), expiration or get_dht_time() + 30)


def _signed(validator, record: DHTRecord) -> DHTRecord:
    return dataclasses.replace(record, value=validator.sign_value(record))


def test_an_unchanged_record_is_verified_once():
    owner, counting, validator = _setup()
    record = _signed(validator, _record(owner))
    assert all(validator.validate(record) for _ in range(5))
    assert counting.verified == 1 and validator.checked == 1 and validator.remembered == 4


def test_a_record_that_differs_in_value_or_expiration_is_verified_in_full():
    owner, counting, validator = _setup()
    record = _signed(validator, _record(owner))
    assert validator.validate(record)
    assert validator.validate(_signed(validator, _record(owner, step=1, expiration=record.expiration_time)))
    later = _signed(validator, dataclasses.replace(_record(owner), expiration_time=record.expiration_time + 1))
    assert validator.validate(later)
    assert counting.verified == 3
    # the same value under the old signature with another expiration: the signature covers it, so refused
    assert not validator.validate(dataclasses.replace(record, expiration_time=record.expiration_time + 1))


def test_refused_records_are_refused_every_time_and_not_remembered():
    owner, counting, validator = _setup()
    other = load_or_create_identity(None)
    forged = _signed(CompositeValidator([RSASignatureValidator(other.private_key)]), _record(owner))  # other's key
    unsigned = _record(owner)
    plain = dataclasses.replace(unsigned, subkey=DHTProtocol.IS_REGULAR_VALUE)  # not under an owner subkey
    for record in (forged, unsigned, plain):
        assert not any(validator.validate(record) for _ in range(3))
    assert validator.remembered == 0 and validator.checked == 9


def test_the_least_recently_seen_record_is_forgotten_first():
    owner, counting, validator = _setup()  # capacity 3
    records = [_signed(validator, _record(owner, step=i)) for i in range(4)]
    for record in records[:3]:
        assert validator.validate(record)
    assert validator.validate(records[0])  # seen again: now the most recent
    assert validator.validate(records[3])  # evicts records[1]
    assert counting.verified == 4
    assert validator.validate(records[0]) and validator.validate(records[2]) and counting.verified == 4
    assert validator.validate(records[1]) and counting.verified == 5


def test_signing_and_stripping_are_those_of_the_combined_validators():
    owner, _, validator = _setup()
    combined = CompositeValidator([RSASignatureValidator(owner.private_key), run_schema_validator(RUN_ID, NUM_STAGES)])
    record = _record(owner)
    signed = _signed(validator, record)
    assert combined.validate(signed)
    assert validator.strip_value(signed) == combined.strip_value(signed) == record.value
    assert validator.priority == RSASignatureValidator(owner.private_key).priority
    with pytest.raises(ValueError, match="capacity"):
        RememberingValidator([], capacity=0)
