"""The organiser's signed run manifest: signing, checking, comparing settings, and joining with one address."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from peers._common import describe_join, parameter_count
from swarm import PROTOCOL_VERSION
from swarm.config.settings import RunConfig
from swarm.config.loading import ConfigError
from swarm.dht.identity import load_or_create_identity
from swarm.dht.manifest import (ManifestError, SignedManifest, check_against_manifest, join_settings, peer_id_in_address,
                            run_differences, run_hash, sign_manifest, verify_manifest)
from swarm.model.gpt import ModelConfig
from swarm.model.stages import FullModel
from swarm.training.optimizer import OptimizerConfig
from tests.utils.processes import FAST_PEER, REPO, wait_for_log_lines

TINY_RUN = dict(num_layers=2, hidden_size=32, num_heads=2, seq_len=16)


@pytest.fixture(scope="module")
def organiser():
    return load_or_create_identity(None)


@pytest.fixture(scope="module")
def stranger():
    return load_or_create_identity(None)


def tiny_run(**changes) -> RunConfig:
    return RunConfig(run_id="manifest_test", num_stages=2, target_batch_size=64, model=ModelConfig(**TINY_RUN),
                     optimizer=OptimizerConfig(lr=0.002), **changes)


def resigned(signed: SignedManifest, identity, **payload_changes) -> SignedManifest:
    """The same manifest with some payload fields changed, properly signed by ``identity``."""
    data = {**json.loads(signed.payload), **payload_changes}
    payload = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return SignedManifest(payload, identity.private_key.sign(payload), identity.public_key)


def test_sign_verify_round_trip(organiser):
    run = tiny_run(allowlist=[organiser.peer_id])
    signed = sign_manifest(run, organiser, revision=3, issued_at=1234.5)
    manifest = verify_manifest(signed, organiser.peer_id)
    assert manifest.run == run and manifest.organiser == organiser.peer_id
    assert (manifest.revision, manifest.issued_at, manifest.protocol_version) == (3, 1234.5, PROTOCOL_VERSION)
    again = sign_manifest(run, organiser, revision=3, issued_at=1234.5)
    assert again.payload == signed.payload, "the payload must be canonical: equal settings, equal bytes"
    assert verify_manifest(SignedManifest.from_dict(signed.to_dict()), organiser.peer_id) == manifest


def test_tampered_payload_is_refused(organiser):
    signed = sign_manifest(tiny_run(), organiser, revision=1)
    tampered = signed.payload.replace(b'"hidden_size":32', b'"hidden_size":64')
    assert tampered != signed.payload
    with pytest.raises(ManifestError, match="signature does not match"):
        verify_manifest(dataclasses.replace(signed, payload=tampered), organiser.peer_id)
    with pytest.raises(ManifestError, match="signature does not match"):
        verify_manifest(dataclasses.replace(signed, signature=signed.signature[:-8] + b"AAAAAAA="), organiser.peer_id)


def test_wrong_organiser_is_refused(organiser, stranger):
    signed = sign_manifest(tiny_run(), organiser, revision=1)
    with pytest.raises(ManifestError, match=f"signed by {organiser.peer_id}, not by the organiser {stranger.peer_id}"):
        verify_manifest(signed, stranger.peer_id)
    # a stranger who re-signs the organiser's settings with its own key is not the organiser either
    forged = resigned(signed, stranger)
    with pytest.raises(ManifestError, match="not by the organiser"):
        verify_manifest(forged, organiser.peer_id)
    # nor is a manifest signed by the right key that names someone else as organiser
    misnamed = resigned(signed, organiser, organiser=stranger.peer_id)
    with pytest.raises(ManifestError, match="names"):
        verify_manifest(misnamed, organiser.peer_id)
    with pytest.raises(ManifestError, match="not an RSA public key"):
        verify_manifest(dataclasses.replace(signed, public_key=b"ssh-rsa garbage"), organiser.peer_id)


def test_other_protocol_version_and_bad_settings_are_refused(organiser):
    signed = sign_manifest(tiny_run(), organiser, revision=1)
    with pytest.raises(ManifestError, match=f"protocol version {PROTOCOL_VERSION + 1}"):
        verify_manifest(resigned(signed, organiser, protocol_version=PROTOCOL_VERSION + 1), organiser.peer_id)
    bad_run = {**json.loads(signed.payload)["run"], "num_stages": 5}
    with pytest.raises(ManifestError, match="num_stages"):
        verify_manifest(resigned(signed, organiser, run=bad_run), organiser.peer_id)
    with pytest.raises(ManifestError, match="revision"):
        verify_manifest(resigned(signed, organiser, revision=-1), organiser.peer_id)
    with pytest.raises(ManifestError, match="non-empty bytes in 'payload'"):
        SignedManifest.from_dict({"payload": "text", "signature": b"x", "public_key": b"y"})


def test_private_run_must_list_its_organiser(organiser, stranger):
    with pytest.raises(ValueError, match="organiser's own peer id"):
        sign_manifest(tiny_run(allowlist=[stranger.peer_id]), organiser, revision=1)
    signed = sign_manifest(tiny_run(allowlist=[organiser.peer_id]), organiser, revision=1)
    unlisted = {**json.loads(signed.payload)["run"], "allowlist": [stranger.peer_id]}
    with pytest.raises(ManifestError, match="leaves out its own organiser"):
        verify_manifest(resigned(signed, organiser, run=unlisted), organiser.peer_id)
    with pytest.raises(ValueError, match=r"allowlist\[0\] must be a base58 peer id"):
        tiny_run(allowlist=["not a peer id"])


def test_run_differences_name_nested_fields():
    base = tiny_run()
    other = dataclasses.replace(base, seed=7, model=dataclasses.replace(base.model, hidden_size=64),
                                optimizer=OptimizerConfig(lr=0.002, betas=(0.9, 0.99)))
    assert run_differences(base, base) == []
    assert run_differences(base, other) == [("seed", 0, 7), ("model.hidden_size", 32, 64),
                                            ("optimizer.betas", (0.9, 0.95), (0.9, 0.99))]
    assert run_hash(base) == run_hash(tiny_run()) and len(run_hash(base)) == 16
    assert run_hash(base) != run_hash(other)
    assert run_hash(base) != run_hash(tiny_run(allowlist=["QmTNt6JBYk8n4F1TNzRzBtUcFdoMN3Qd8kk3eFcE9ceH2F"]))


def test_check_against_manifest_names_the_first_difference(organiser):
    manifest = verify_manifest(sign_manifest(tiny_run(), organiser, revision=1), organiser.peer_id)
    check_against_manifest(manifest, tiny_run())
    with pytest.raises(ConfigError, match="model.hidden_size: the run's manifest says 32, this peer has 64"):
        check_against_manifest(manifest, dataclasses.replace(tiny_run(), model=ModelConfig(**{**TINY_RUN,
                                                                                                "hidden_size": 64})))


def test_join_settings_take_the_manifest_and_refuse_contradictions(organiser):
    manifest = verify_manifest(sign_manifest(tiny_run(), organiser, revision=1), organiser.peer_id)
    address = f"/ip4/127.0.0.1/tcp/4001/p2p/{organiser.peer_id}"
    settings = {"stage": 1, "run": {"model": {"num_layers": 2}}, "network": {"initial_peers": ["/ip4/10.0.0.1/tcp/1"]}}
    joined = join_settings(settings, manifest, address)
    assert joined["stage"] == 1 and joined["run"]["model"]["hidden_size"] == 32 and joined["run"]["run_id"] == "manifest_test"
    assert joined["network"]["initial_peers"] == [address, "/ip4/10.0.0.1/tcp/1"]
    with pytest.raises(ConfigError, match="target_batch_size: the run's manifest says 64, this peer has 128"):
        join_settings({"run": {"target_batch_size": 128}}, manifest, address)
    with pytest.raises(ConfigError, match="divisible by num_heads"):
        join_settings({"run": {"model": {"hidden_size": 31}}}, manifest, address)
    assert peer_id_in_address(address) == organiser.peer_id
    with pytest.raises(ManifestError, match="/p2p/<peer id>"):
        peer_id_in_address("/ip4/127.0.0.1/tcp/4001")


def test_parameter_count_matches_the_model():
    config = ModelConfig(**TINY_RUN)
    assert parameter_count(config) == sum(p.numel() for p in FullModel(config, num_stages=2, seed=0).parameters())


def test_the_plan_is_described_in_plain_words(organiser):
    run = tiny_run(allowlist=[organiser.peer_id])
    manifest = verify_manifest(sign_manifest(run, organiser, revision=1), organiser.peer_id)
    peer = describe_join("peer", run, manifest, "cuda:0", "auto")
    assert all(part in peer for part in ("'manifest_test'", organiser.peer_id, "42.4 thousand parameters", "2 stages",
                                         "the stage that needs capacity most", "cuda:0", "private run, 1 allowed"))
    trainer = describe_join("trainer", tiny_run(), manifest, "cpu")
    assert "push micro-batches" in trainer and "anyone may join" in trainer


def test_join_needs_an_address_with_a_peer_id():
    result = subprocess.run([sys.executable, "-m", "peers.cli", "peer", "--join", "/ip4/127.0.0.1/tcp/9"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "/p2p/<peer id>" in result.stderr and "Traceback" not in result.stderr, result.stderr


# ---- live: an organiser serves its manifest, volunteers join with its address ----


@pytest.fixture
def organised_run(launcher, tmp_path):
    manifest = tmp_path / "run.yaml"
    manifest.write_text(f"run_id: {launcher.run_id}\nnum_stages: 2\ntarget_batch_size: 64\n"
                        "model: {num_layers: 2, hidden_size: 32, num_heads: 2, seq_len: 16}\nallowlist: []\n")
    boot = launcher.start("bootstrap", ["--manifest", str(manifest), "--identity_path", str(tmp_path / "organiser.key")],
                          name="organiser")
    ready = boot.wait_event("bootstrap_ready", timeout=60)
    launcher.initial_peers = ready["maddrs"]
    return ready


def test_join_refuses_a_setting_that_contradicts_the_manifest(launcher, organised_run):
    address = organised_run["join"]
    result = subprocess.run([sys.executable, "-m", "peers.cli", "peer", "--join", address, "--hidden_size", "64"],
                            cwd=REPO, capture_output=True, text=True, timeout=90)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "hidden_size" in lines[0] and "32" in lines[0] and "64" in lines[0], result.stderr


def test_volunteer_joins_with_only_the_address(launcher, organised_run):
    address = organised_run["join"]
    assert address.endswith(f"/p2p/{organised_run['peer_id']}")
    assert organised_run["organiser"] == organised_run["peer_id"]
    peer = launcher.start("peer", ["--join", address, *FAST_PEER, "--log_period_s", "1"], name="volunteer")
    ready = peer.wait_event("peer_ready", timeout=90)
    assert ready["run_id"] == launcher.run_id and ready["stage"] in (0, 1)
    summary = "".join(peer.stdout_lines)
    assert launcher.run_id in summary and organised_run["peer_id"] in summary and "parameters" in summary
    assert "(auto)" in summary and "memory:" in summary and "MB on cpu" in summary, summary
    wait_for_log_lines(peer, lambda line: f"online stage {ready['stage']} | step " in line and "samples/s" in line, 15,
                       "a progress line")
