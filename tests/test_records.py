"""Signed, owner-bound DHT records: identities, the run schema, forged and junk records, record sizes."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import uuid
from types import SimpleNamespace

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa
from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPublicKey

from swarm.config.settings import NetworkConfig
from swarm.dht.node import start_dht
from swarm.dht.directory import fetch_stage_records
from swarm.dht.store import fetch_records, store_record
from swarm.dht.identity import load_or_create_identity, peer_id_of
from swarm.dht.records import (
    CONTRIBUTION_WINDOW, MAX_COUNT, PeerRecord, TrainerRecord, check_record, key_id, manifest_key, parse_records,
    run_key_kinds, run_schema_validator, rewind_contributed, stage_key, trainers_key, update_contributed,
)

RUN_ID = f"rec{uuid.uuid4().hex[:6]}"
NUM_STAGES = 5


def peer_record(peer_id: str, stage: int = 0, **fields) -> PeerRecord:
    base = dict(version=1, peer_id=peer_id, stage=stage, state="online", throughput=12.5, queue_length=1, step=3,
                accum_step=3, samples_pending=8, samples_applied=96)
    return PeerRecord(**{**base, **fields})


# ---- identities ----


def test_identity_round_trip(tmp_path):
    path = str(tmp_path / "peer.key")
    created = load_or_create_identity(path)
    assert created.fresh and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    loaded = load_or_create_identity(path)
    assert not loaded.fresh and loaded.peer_id == created.peer_id and loaded.public_key == created.public_key
    with open(path, "rb") as file:
        assert PeerID.from_identity(file.read()).to_base58() == created.peer_id
    assert peer_id_of(created.public_key) == created.peer_id
    signature = loaded.private_key.sign(b"data")
    assert RSAPublicKey.from_bytes(created.public_key).verify(b"data", signature)
    assert [name for name in os.listdir(tmp_path)] == ["peer.key"], "the temporary file must be gone"


def test_temporary_identities_are_distinct_and_private():
    first, second = load_or_create_identity(None), load_or_create_identity(None)
    assert first.fresh and first.peer_id != second.peer_id and first.path != second.path
    assert stat.S_IMODE(os.stat(first.path).st_mode) == 0o600


def _ed25519_identity() -> bytes:
    key = ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())
    return crypto_pb2.PrivateKey(key_type=crypto_pb2.Ed25519, data=key).SerializeToString()


@pytest.mark.parametrize("content, reason", [
    (b"\xff\xfe not a protobuf", "not a libp2p PrivateKey"),
    (_ed25519_identity(), "only RSA identities"),
    (crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=b"\x30\x03junk").SerializeToString(), "corrupt RSA key"),
])
def test_identity_refuses_bad_files(tmp_path, content, reason):
    path = tmp_path / "bad.key"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=reason) as error:
        load_or_create_identity(str(path))
    assert str(path) in str(error.value)


def test_identity_in_missing_directory_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_or_create_identity(str(tmp_path / "no" / "such.key"))


def _small_rsa_public_key() -> bytes:
    return rsa.generate_private_key(public_exponent=65537, key_size=1024).public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)


@pytest.mark.parametrize("garbage", [b"", b"garbage", b"ssh-rsa AAAA", "ssh-rsa text", _small_rsa_public_key(),
                                     ed25519.Ed25519PrivateKey.generate().public_key().public_bytes(
                                         serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)])
def test_peer_id_of_refuses_garbage(garbage):
    with pytest.raises(ValueError):
        peer_id_of(garbage)


# ---- contribution bits ----


def test_update_contributed_shifts_the_window():
    base, bits = update_contributed(0, 0, 0, True)
    assert (base, bits) == (0, 0b1)
    base, bits = update_contributed(base, bits, 1, False)
    assert (base, bits) == (1, 0b10)
    base, bits = update_contributed(base, bits, 4, True)
    assert (base, bits) == (4, 0b10001)
    assert update_contributed(base, bits, 4, False) == (4, 0b10000), "re-applying a step rewrites its bit"
    assert update_contributed(base, bits, 4 + CONTRIBUTION_WINDOW, True) == (4 + CONTRIBUTION_WINDOW, 1)
    shifted = update_contributed(base, bits, 4 + CONTRIBUTION_WINDOW - 1, False)[1]  # step 0 at bit 63, step 4 out
    assert shifted == 1 << (CONTRIBUTION_WINDOW - 1), "bits leaving the window are dropped"
    # step 3 applied again after a resync to an older state of another lineage: steps 3 and 4 of the old
    # lineage are forgotten, steps 0-2 kept
    assert update_contributed(base, bits, 3, False) == (3, 0b1000)
    assert update_contributed(base, bits, 3, True) == (3, 0b1001)
    with pytest.raises(ValueError):
        update_contributed(4, bits, -1, True)


def test_rewind_contributed_keeps_the_steps_below():
    base, bits = 0, 0
    for step in range(10):
        base, bits = update_contributed(base, bits, step, step % 2 == 0)
    assert rewind_contributed(base, bits, 12) == (base, bits), "nothing at or above step 12 to forget"
    kept_base, kept = rewind_contributed(base, bits, 6)
    record = peer_record("p", step=6, contributed_base=kept_base, contributed_bits=kept)
    assert [record.contributed_to(s) for s in range(6)] == [True, False, True, False, True, False]
    assert rewind_contributed(base, bits, 0) == (0, 0)


def test_tentative_steps_are_not_known_yet():
    base, bits = 0, 0
    for step, included in [(10, True), (11, True), (12, False)]:
        base, bits = update_contributed(base, bits, step, included)
    record = peer_record("p", step=13, contributed_base=base, contributed_bits=bits, tentative_bits=0b10)
    assert record.is_tentative(11) and not record.is_tentative(10) and not record.is_tentative(12)
    assert [record.contributed_to(s) for s in (10, 11, 12)] == [True, None, False]
    assert not record.is_tentative(13), "not applied yet"


def test_contributed_to():
    base, bits = 0, 0
    for step, included in [(10, True), (11, False), (12, True)]:
        base, bits = update_contributed(base, bits, step, included)
    record = peer_record("p", step=13, contributed_base=base, contributed_bits=bits)
    assert [record.contributed_to(s) for s in (10, 11, 12)] == [True, False, True]
    assert record.contributed_to(9) is False, "applied, inside the window, not included"
    assert record.contributed_to(13) is None, "not applied yet"
    assert record.contributed_to(12 - CONTRIBUTION_WINDOW) is None, "older than the window"
    assert record.contributed_to(-1) is None
    jumped = peer_record("p", step=40, contributed_base=12, contributed_bits=bits)  # steps 13..39 downloaded
    assert jumped.contributed_to(20) is None and jumped.contributed_to(12) is True


# ---- the record check and the schema, without a network ----


def test_check_record_binds_the_record_to_its_signer():
    owner, other = load_or_create_identity(None), load_or_create_identity(None)
    good = peer_record(owner.peer_id).model_dump(mode="json")
    assert check_record(owner.owner_subkey, good, PeerRecord).record.peer_id == owner.peer_id
    forged = check_record(other.owner_subkey, good, PeerRecord)
    assert forged.record is None and f"signed by {other.peer_id}" in forged.reason
    assert "not an [owner:" in check_record(owner.peer_id.encode(), good, PeerRecord).reason
    assert "not an [owner:" in check_record(b"x" + owner.owner_subkey, good, PeerRecord).reason
    assert "OpenSSH RSA" in check_record(b"[owner:ssh-rsa AAAA]", good, PeerRecord).reason
    assert "malformed" in check_record(owner.owner_subkey, {**good, "throughput": float("nan")}, PeerRecord).reason
    item = SimpleNamespace
    records, refused = parse_records({owner.owner_subkey: item(value=good), other.owner_subkey: item(value=good),
                                      b"junk": item(value=good), owner.owner_subkey + b" ": item(value=None)},
                                     PeerRecord)
    assert list(records) == [owner.peer_id] and len(refused) == 2
    assert parse_records(["a list"], PeerRecord) == ({}, ["expected a dictionary of owner subkeys, got list"])


def _dht_record(key: str, subkey, value) -> DHTRecord:
    subkey_bytes = DHTProtocol.IS_REGULAR_VALUE if subkey is None else MSGPackSerializer.dumps(subkey)
    return DHTRecord(DHTID.generate(source=key).to_bytes(), subkey_bytes, MSGPackSerializer.dumps(value),
                     get_dht_time() + 30)


def _signed(validator: CompositeValidator, record: DHTRecord) -> DHTRecord:
    """What DHTNode.store_many stores: the value with the signature appended."""
    return DHTRecord(record.key, record.subkey, validator.sign_value(record), record.expiration_time)


def _validators(identity) -> CompositeValidator:
    return CompositeValidator([RSASignatureValidator(identity.private_key), run_schema_validator(RUN_ID, NUM_STAGES)])


def test_run_schema_accepts_only_owned_bounded_records():
    owner, other = load_or_create_identity(None), load_or_create_identity(None)
    validator, key = _validators(owner), stage_key(RUN_ID, 1)
    value = peer_record(owner.peer_id, stage=1).model_dump(mode="json")
    assert validator.validate(_signed(validator, _dht_record(key, owner.owner_subkey, value)))
    assert validator.validate(_signed(validator, _dht_record(key, owner.owner_subkey, None))), "withdrawal"
    refused = {
        "plain value": _dht_record(key, None, value),
        "non-owner subkey": _dht_record(key, "someone", value),
        "unsigned": _dht_record(key, owner.owner_subkey, value),
        "another owner's subkey": _signed(_validators(other), _dht_record(key, owner.owner_subkey, value)),
        "extra field": _dht_record(key, owner.owner_subkey, {**value, "history": list(range(1000))}),
        "long id": _dht_record(key, owner.owner_subkey, {**value, "peer_id": "Q" * 65}),
        "float as int": _dht_record(key, owner.owner_subkey, {**value, "step": 3.0}),
        "huge int": _dht_record(key, owner.owner_subkey, {**value, "step": MAX_COUNT + 1}),
        "negative bits": _dht_record(key, owner.owner_subkey, {**value, "contributed_bits": -1}),
        "trainer under stage key": _dht_record(key, owner.owner_subkey, {"version": 1, "trainer_id": owner.peer_id}),
    }
    for name, record in refused.items():
        signed = record if name in ("unsigned", "another owner's subkey") else _signed(validator, record)
        assert not validator.validate(signed), name
    manifest = {"payload": b"settings", "signature": b"sig", "public_key": owner.public_key}
    assert validator.validate(_signed(validator, _dht_record(manifest_key(RUN_ID), owner.owner_subkey, manifest)))
    too_big = {**manifest, "payload": b"x" * 100_000}
    assert not validator.validate(_signed(validator, _dht_record(manifest_key(RUN_ID), owner.owner_subkey, too_big)))
    other_key = _dht_record(f"{RUN_ID}_averaging", None, "free")  # keys outside the schema (averaging) stay free
    assert validator.validate(other_key)


def test_an_unbounded_field_has_no_wire_form():
    from pydantic import Field

    from swarm.dht.records import _Record, _wire_model

    class Unbounded(_Record):
        count: int = Field(ge=0)

    class Unlimited(_Record):
        name: str

    for model in (Unbounded, Unlimited):
        with pytest.raises(TypeError, match="unbounded"):
            _wire_model(model)


@pytest.mark.parametrize("num_replicas", [2, 10])
def test_stored_record_size_is_bounded(num_replicas, capsys):
    """The largest value a peer can store (every field at its bound), as the DHT stores it: msgpack
    of the record with its signature appended, plus the owner subkey."""
    sizes = []
    for _ in range(num_replicas):
        identity = load_or_create_identity(None)
        record = peer_record(identity.peer_id, stage=NUM_STAGES - 1, state="leaving", throughput=1e12 - 0.5,
                             queue_length=MAX_COUNT, step=MAX_COUNT, accum_step=MAX_COUNT, samples_pending=MAX_COUNT,
                             samples_frozen=MAX_COUNT, samples_admitted=MAX_COUNT, samples_applied=MAX_COUNT,
                             digest="f" * 64, samples_processed=MAX_COUNT, contributed_base=MAX_COUNT,
                             contributed_bits=2**64 - 1, run_hash="h" * 16)
        validator = _validators(identity)
        stored = _signed(validator, _dht_record(stage_key(RUN_ID, NUM_STAGES - 1), identity.owner_subkey,
                                                record.model_dump(mode="json")))
        assert validator.validate(stored)
        sizes.append(len(stored.value) + len(stored.subkey))
    with capsys.disabled():
        print(f"\n{num_replicas} replicas: stored peer record sizes {sorted(set(sizes))} bytes")
    assert max(sizes) < 2048


def test_store_record_refuses_a_record_for_another_peer():
    dht = SimpleNamespace(identity=load_or_create_identity(None))
    with pytest.raises(ValueError, match="must carry that id"):
        asyncio.run(store_record(dht, stage_key(RUN_ID, 0), peer_record("QmSomeoneElse"), 30))


# ---- live: honest nodes, a forger and a node without validators ----


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """victim, reader, forger: honest nodes of the run; rogue: stores anything (no validators);
    naive: checks signatures but not the run's schema (the defence switched off)."""
    started = {}
    try:
        victim_key = str(tmp_path_factory.mktemp("identity") / "victim.key")
        started["victim"] = start_dht(NetworkConfig(identity_path=victim_key), run_id=RUN_ID, num_stages=NUM_STAGES)
        network = NetworkConfig(initial_peers=[str(addr) for addr in started["victim"].get_visible_maddrs()])
        for name in ("reader", "forger"):
            started[name] = start_dht(network, run_id=RUN_ID, num_stages=NUM_STAGES)
        started["naive"] = start_dht(network)
        started["rogue"] = DHT(initial_peers=network.initial_peers, start=True)
        yield SimpleNamespace(**started)
    finally:
        for dht in started.values():
            dht.shutdown()


def test_peer_id_is_the_one_p2pd_reports(swarm):
    identity = swarm.victim.identity
    assert str(swarm.victim.peer_id) == identity.peer_id == peer_id_of(identity.public_key)
    assert load_or_create_identity(identity.path).peer_id == identity.peer_id


def test_a_temporary_identity_leaves_no_key_file_once_its_daemon_started(swarm):
    """A role killed by SIGKILL runs no exit handler: its private key must not be left behind in /tmp."""
    assert swarm.reader.identity.temporary and not os.path.exists(swarm.reader.identity.path)
    identity = load_or_create_identity(None)
    network = NetworkConfig(initial_peers=[str(a) for a in swarm.victim.get_visible_maddrs()])
    for _ in range(2):  # the second time as a peer restarts its DHT with the identity it has
        dht = start_dht(network, run_id=RUN_ID, num_stages=NUM_STAGES, identity=identity)
        try:
            assert str(dht.peer_id) == identity.peer_id and not os.path.exists(identity.path)
        finally:
            dht.shutdown()


async def test_forged_record_is_refused(swarm, caplog):
    key, victim = stage_key(RUN_ID, 0), swarm.victim.identity.peer_id
    assert await store_record(swarm.victim, key, peer_record(victim, step=3), 30)
    forged = peer_record(victim, step=999).model_dump(mode="json")  # signed by the forger, under its own subkey
    assert swarm.forger.store(key, forged, get_dht_time() + 60, subkey=swarm.forger.identity.owner_subkey)
    raw = await swarm.reader.get(key, latest=True, return_future=True)
    assert len(raw.value) == 2, "the DHT alone accepts the forgery: it is properly signed by the forger"
    with caplog.at_level(logging.WARNING):
        records = await fetch_records(swarm.reader, key, PeerRecord, strict=True)
    assert list(records) == [victim] and records[victim].step == 3
    assert f"claims to be {victim!r}" in caplog.text


async def test_attacker_cannot_overwrite_the_victims_subkey(swarm):
    key, victim = stage_key(RUN_ID, 1), swarm.victim.identity
    assert await store_record(swarm.victim, key, peer_record(victim.peer_id, stage=1, step=3), 30)
    overwrite = peer_record(victim.peer_id, stage=1, step=999).model_dump(mode="json")
    # store() reports only the last replica's answer (the rogue says yes): what counts is what readers get
    swarm.forger.store(key, overwrite, get_dht_time() + 60, subkey=victim.owner_subkey)  # cannot sign it
    swarm.rogue.store(key, overwrite, get_dht_time() + 60, subkey=victim.owner_subkey)  # unsigned, kept by the rogue
    for reader in (swarm.reader, swarm.forger):
        records = await fetch_records(reader, key, PeerRecord, strict=True)
        assert records[victim.peer_id].step == 3


async def test_junk_under_a_run_key_changes_nothing(swarm):
    key, victim = stage_key(RUN_ID, 2), swarm.victim.identity.peer_id
    assert await store_record(swarm.victim, key, peer_record(victim, stage=2), 30)
    later = get_dht_time() + 120
    swarm.forger.store(key, {"plain": "value"}, later)
    swarm.forger.store(key, peer_record(victim, stage=2).model_dump(mode="json"), later, subkey="junk")
    swarm.rogue.store(key, "a plain value", later + 1)  # the rogue keeps it in its own storage and serves it
    swarm.rogue.store(trainers_key(RUN_ID), "a plain value", later)
    assert swarm.rogue.get(key, latest=True).value == "a plain value"
    records = await fetch_records(swarm.reader, key, PeerRecord, strict=True)
    assert list(records) == [victim]
    # the defence off: a node without the run's schema takes the rogue's later plain value instead
    assert await fetch_records(swarm.naive, key, PeerRecord) == {}


async def test_fetch_stage_records_merges_stages(swarm, caplog):
    victim, forger = swarm.victim.identity.peer_id, swarm.forger.identity.peer_id
    assert await store_record(swarm.victim, stage_key(RUN_ID, 3), peer_record(victim, stage=3), 30)
    assert await store_record(swarm.forger, stage_key(RUN_ID, 4), peer_record(forger, stage=3), 30)  # misfiled
    assert await store_record(swarm.forger, stage_key(RUN_ID, 3), peer_record(forger, stage=3, step=5), 30)
    with caplog.at_level(logging.WARNING):
        records = await fetch_stage_records(swarm.reader, RUN_ID, NUM_STAGES, strict=True)
    assert records[victim].stage == 3 and records[forger].step == 5
    assert "names stage 3, stored under stage 4" in caplog.text
    assert (await fetch_records(swarm.reader, trainers_key(RUN_ID), TrainerRecord, strict=True)) == {}


async def test_a_dht_without_identity_cannot_read(swarm):
    with pytest.raises(ValueError, match="start_dht"):
        await fetch_records(swarm.rogue, stage_key(RUN_ID, 0), PeerRecord)


def test_the_validator_hashes_keys_as_the_dht_does():
    keys = list(run_key_kinds("run", 3))
    assert len(keys) > 3 * 1000  # every shard of every level of every stage
    for key in keys[:: len(keys) // 50] + [trainers_key("run"), manifest_key("run")]:
        assert key_id(key) == DHTID.generate(source=key).to_bytes()
