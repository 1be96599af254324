"""A run that starts from a Hugging Face checkpoint: what the organiser signs, what a peer loads and refuses, and a
live run whose stages, loaded by their peers from their own copies, export back to the very same tensors.
Every checkpoint is made here by transformers; nothing is downloaded."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from peers.bootstrap import attach_checkpoint, load_run_manifest
from swarm.config.settings import RunConfig
from swarm.dht.manifest import run_hash, run_settings
from swarm.model.hf_checkpoint import CheckpointError, config_from_hf, load_stage_from_checkpoint, stage_digest
from swarm.model.initial_weights import CheckpointSignature, initial_stage_tensors
from swarm.server.runner import StageRunner, parameter_digest
from tests.utils.processes import FAST_PEER, REPO

transformers = pytest.importorskip("transformers")
NUM_STAGES = 2


def _save_tiny_llama(path) -> None:
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                      rope_theta=500.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():  # norms off 1, so that a norm left at its initial value shows
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(str(path), safe_serialization=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_llama")
    _save_tiny_llama(path)
    return path


def _signed_run(path) -> RunConfig:
    run = RunConfig(run_id="init_test", num_stages=NUM_STAGES, model=config_from_hf(path))
    return attach_checkpoint(run, str(path))


def test_the_signature_is_what_a_stage_loaded_from_the_checkpoint_hashes_to(checkpoint):
    run = _signed_run(checkpoint)
    assert run.starts_from_checkpoint and len(run.init_stage_digests) == NUM_STAGES
    assert len(set(run.init_stage_digests)) == NUM_STAGES  # each stage signs its own tensors
    for stage in range(NUM_STAGES):
        loaded = load_stage_from_checkpoint(checkpoint, run.model, stage, NUM_STAGES)
        assert stage_digest(loaded) == run.init_stage_digests[stage]
    # the settings, and so the run hash, carry the signature; a run without one hashes as before
    assert run_settings(run)["init_stage_digests"] == run.init_stage_digests
    plain = dataclasses.replace(run, init_config_sha256="", init_stage_digests=[])
    assert "init_stage_digests" not in run_settings(plain) and "init_config_sha256" not in run_settings(plain)
    assert run_hash(plain) != run_hash(run)


def test_a_runner_starts_from_the_checked_tensors_not_its_seed(checkpoint):
    run = _signed_run(checkpoint)
    signature = CheckpointSignature(run.init_config_sha256, run.init_stage_digests)
    for stage in range(NUM_STAGES):
        tensors = initial_stage_tensors(checkpoint, run.model, stage, NUM_STAGES, signature)
        runner = StageRunner(run, stage, initial=tensors)
        seeded = StageRunner(run, stage)
        assert stage_digest(runner.module) == run.init_stage_digests[stage]
        assert parameter_digest(runner.params) != parameter_digest(seeded.params)
        for name, value in runner.module.state_dict().items():
            assert torch.equal(value, tensors[name]), name


def test_a_copy_that_differs_from_the_signed_one_is_refused(checkpoint, tmp_path):
    run = _signed_run(checkpoint)
    signature = CheckpointSignature(run.init_config_sha256, run.init_stage_digests)
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "config.json").write_bytes((checkpoint / "config.json").read_bytes())
    tensors = load_file(str(checkpoint / "model.safetensors"))
    tensors["model.layers.2.mlp.up_proj.weight"][0, 0] += 1e-3  # one value in stage 1's part
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    # stage 0 holds none of the changed tensors: its copy is the organiser's; stage 1's is not
    assert stage_digest(load_stage_from_checkpoint(copy, run.model, 0, NUM_STAGES)) == run.init_stage_digests[0]
    initial_stage_tensors(copy, run.model, 0, NUM_STAGES, signature)
    with pytest.raises(CheckpointError, match=f"stage 1's tensors hash to .* signs {run.init_stage_digests[1]}"):
        initial_stage_tensors(copy, run.model, 1, NUM_STAGES, signature)
    # another config.json (same model, other bytes) is another checkpoint
    config = json.loads((checkpoint / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(config, indent=4))
    with pytest.raises(CheckpointError, match="config.json has SHA-256 .* signs"):
        initial_stage_tensors(copy, run.model, 0, NUM_STAGES, signature)
    # a manifest signing other digests than the directory's is refused by the organiser
    forged = dataclasses.replace(run, init_stage_digests=list(reversed(run.init_stage_digests)))
    with pytest.raises(ValueError, match="signs another checkpoint"):
        attach_checkpoint(forged, str(checkpoint))


def test_the_run_config_checks_the_signature_fields():
    digest = "ab" * 32
    with pytest.raises(ValueError, match="come together"):
        RunConfig(init_config_sha256=digest)
    with pytest.raises(ValueError, match="names 1 stages, the run has 2"):
        RunConfig(init_config_sha256=digest, init_stage_digests=[digest])
    with pytest.raises(ValueError, match="64-hex-character"):
        RunConfig(init_config_sha256=digest, init_stage_digests=[digest, "xyz"])
    run = RunConfig(init_config_sha256=digest.upper(), init_stage_digests=[digest.upper(), digest])
    assert run.init_config_sha256 == digest and run.init_stage_digests == [digest, digest]


def test_the_manifest_takes_model_settings_it_leaves_out_from_the_checkpoint(checkpoint, tmp_path):
    manifest = tmp_path / "run.yaml"
    manifest.write_text("run_id: init_test\nnum_stages: 2\nmodel: {seq_len: 8}\n")
    run = load_run_manifest(str(manifest), str(checkpoint))
    assert run.model.architecture == "llama" and run.model.hidden_size == 32 and run.model.kv_heads == 2
    assert run.model.seq_len == 8 and run.model.rope_theta == 500.0
    assert attach_checkpoint(run, str(checkpoint)).init_stage_digests == _signed_run(checkpoint).init_stage_digests


def _bootstrap(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "peers.cli", "bootstrap", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def test_the_organiser_refuses_a_checkpoint_the_manifest_contradicts(checkpoint, tmp_path):
    manifest = tmp_path / "run.yaml"
    manifest.write_text("run_id: init_test\nnum_stages: 2\nmodel: {hidden_size: 64}\n")
    result = _bootstrap("--manifest", str(manifest), "--init_from", str(checkpoint))
    assert result.returncode == 2 and "the checkpoint has hidden_size 32, the run's model 64" in result.stderr
    result = _bootstrap("--init_from", str(checkpoint))
    assert result.returncode == 2 and "init_from needs a manifest" in result.stderr
    manifest.write_text("run_id: init_test\nnum_stages: 2\n")
    result = _bootstrap("--manifest", str(manifest), "--init_from", str(tmp_path / "nowhere"))
    assert result.returncode == 2 and "config.json" in result.stderr


# ---- live: an organiser signs a checkpoint, peers load their stages from their copies ----


@pytest.mark.long
def test_a_live_run_starts_from_the_checkpoint_and_exports_it_back(launcher, checkpoint, tmp_path):
    manifest = tmp_path / "run.yaml"
    manifest.write_text(f"run_id: {launcher.run_id}\nnum_stages: {NUM_STAGES}\ntarget_batch_size: 16\n")
    boot = launcher.start("bootstrap", ["--manifest", str(manifest), "--init_from", str(checkpoint),
                                        "--identity_path", str(tmp_path / "organiser.key")], name="organiser")
    ready = boot.wait_event("bootstrap_ready", timeout=60)
    address = ready["join"]
    assert len(ready["init_stage_digests"]) == NUM_STAGES
    assert any("--init_from DIR" in line for line in boot.stdout_lines)
    # a peer without a copy cannot start a stage that has no replica yet: it says what to do, and exits
    lacking = launcher.start("peer", ["--join", address, "--stage", "0", *FAST_PEER], name="lacking")
    assert lacking.proc.wait(timeout=60) != 0
    assert "starts from a checkpoint: pass --init_from" in lacking.log_tail(), lacking.log_tail()
    peers = [launcher.start("peer", ["--join", address, "--stage", str(stage), "--init_from", str(checkpoint),
                                     *FAST_PEER], name=f"stage{stage}") for stage in range(NUM_STAGES)]
    events = launcher.wait_ready(peers)
    assert all(event["step"] == 0 for event in events)
    out = tmp_path / "exported"
    exporter = launcher.start("export", ["--join", address, "--out", str(out)], name="exporter")
    exporter.wait_event("export_done", timeout=60)
    original, exported = load_file(str(checkpoint / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor.float()), name
