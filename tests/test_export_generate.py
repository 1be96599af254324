"""``swarm export`` and ``swarm generate``: whom the exporter trusts, what it writes, how tokens are sampled, and a
live Llama run exported to a directory that transformers loads and that computes what the swarm computes."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from swarm.client.export import (ExportConfig, ExportError, StageState, choose_sources, expected_parameters,
                                 judge_parameters, mixed_steps_reason, write_export, write_tokenizer_files)
from swarm.client.generate import GenerateConfig, TextStream, context_window, encode_prompt, sample_token
from swarm.config.settings import RunConfig
from swarm.model.gpt import ModelConfig
from swarm.model.stages import build_stage
from swarm.policy.joining import StateClaim, StateSources
from swarm.server.compute import ComputeThread
from swarm.server.handlers import StageHandlers
from swarm.server.lifecycle import PeerState
from swarm.server.runner import StageRunner, parameter_digest
from swarm.training.tokenizer import train_tokenizer
from tests.utils.probe import Probe, online
from tests.utils.processes import FAST_PEER, REPO

LLAMA = ModelConfig(architecture="llama", num_layers=2, hidden_size=32, num_heads=2, seq_len=16)
RUN = RunConfig(run_id="export_test", num_stages=2, model=LLAMA)


def _reply(stage: int, step: int = 3, noise: float = 0.0):
    module = build_stage(LLAMA, stage, 2, seed=0)
    named = [(name, p.detach().clone()) for name, p in module.named_parameters()]
    parameters = [t + noise * torch.randn_like(t) for _, t in named]
    return {"step": step, "names": [name for name, _ in named], "parameters": parameters}


# ---- whom to trust (pure) ----

def test_the_majority_of_online_replicas_names_the_state_and_a_split_stage_is_refused():
    claims = [StateClaim("a", "online", 3, "good"), StateClaim("b", "online", 3, "good"),
              StateClaim("c", "online", 3, "other"), StateClaim("d", "joining", 0, "new")]
    sources = choose_sources(claims, distrusted=())
    assert sorted(sources.peer_ids) == ["a", "b"] and (sources.step, sources.digest) == (3, "good")
    split = choose_sources(claims[1:3], distrusted=())
    assert split.peer_ids == () and "no strict majority among 2 online replicas" in split.reason
    # a replica caught lying no longer votes: the other one is the stage's state
    assert choose_sources(claims[1:3], distrusted={"c"}).peer_ids == ("b",)


def test_a_reply_is_kept_only_if_it_hashes_to_the_announced_digest():
    reply = _reply(1)
    sources = StateSources(("a",), step=3, digest=parameter_digest(reply["parameters"]))
    expected = expected_parameters(LLAMA, 1, 2)
    verdict, parameters = judge_parameters(sources, reply, expected)
    assert verdict.accept and list(parameters) == [name for name, _ in expected]
    # serving other parameters than announced (as a poisoned replica does): refused, and the sender distrusted
    verdict, parameters = judge_parameters(sources, _reply(1, noise=1.0), expected)
    assert not verdict.accept and verdict.distrust and "not to the announced digest" in verdict.reason
    assert parameters is None
    # moved on to a later step since announcing: stale, not a lie
    verdict, _ = judge_parameters(sources, {**reply, "step": 4}, expected)
    assert not verdict.accept and verdict.moved_on and not verdict.distrust
    # incomplete (a stream cut short): retried, not held against the sender
    verdict, _ = judge_parameters(sources, {**reply, "parameters": reply["parameters"][:-1]}, expected)
    assert not verdict.accept and not verdict.distrust and "incomplete" in verdict.reason
    # the first stage's names are not the last stage's
    verdict, _ = judge_parameters(sources, reply, expected_parameters(LLAMA, 0, 2))
    assert not verdict.accept and "incomplete" in verdict.reason


def test_mixed_global_steps_are_named():
    assert mixed_steps_reason({0: 5, 1: 5}) is None
    reason = mixed_steps_reason({0: 5, 1: 4})
    assert "stage 0 at step 5" in reason and "stage 1 at step 4" in reason


# ---- writing (offline) ----

def test_an_export_loads_in_transformers_and_computes_the_stages_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    stages = [build_stage(LLAMA, stage, 2, seed=7) for stage in (0, 1)]
    states = [StageState(stage, 0, "", "peer", {name: p.detach() for name, p in module.named_parameters()})
              for stage, module in enumerate(stages)]
    config = ExportConfig(out=str(tmp_path / "model"), run=RUN)
    written = write_export(config, states, tokenizer=None)
    assert {path.name for path in written} == {"model.safetensors", "config.json"}  # byte tokens: no tokenizer files
    model = transformers.AutoModelForCausalLM.from_pretrained(config.out, torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = stages[1].logits(stages[0](tokens))
        theirs = model(tokens).logits
    assert (ours - theirs).abs().max() <= 1e-4
    with pytest.raises(ExportError, match="a run with a tokenizer needs its file"):
        write_export(ExportConfig(out=str(tmp_path / "other"), run=RUN), states, tokenizer=b"{}")
    with pytest.raises(ValueError, match="already holds a checkpoint"):
        write_export(config, states, tokenizer=None)
    half = ExportConfig(out=str(tmp_path / "half"), dtype="bfloat16", run=RUN)
    write_export(half, states, tokenizer=None)
    assert json.loads((tmp_path / "half" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_export_and_generate_configs_refuse_bad_input():
    with pytest.raises(ValueError, match="--out DIR"):
        ExportConfig(run=RUN)
    with pytest.raises(ValueError, match="dtype must be one of"):
        ExportConfig(out="x", dtype="int8", run=RUN)
    with pytest.raises(ValueError, match="--prompt TEXT"):
        GenerateConfig(run=RUN)
    with pytest.raises(ValueError, match="temperature"):
        GenerateConfig(prompt="a", temperature=-1.0, run=RUN)


# ---- the last stage's logits ----

def test_the_last_stage_returns_last_position_logits_and_keeps_nothing():
    runner = StageRunner(RUN, stage_index=1)
    hidden = torch.randn(2, 5, LLAMA.hidden_size)
    before = (runner.version, runner.samples_pending, len(runner.forward_cache))
    logits = runner.last_logits(hidden)
    assert logits.shape == (2, LLAMA.vocab_size)
    torch.testing.assert_close(logits, runner.module.logits(hidden)[:, -1].detach(), atol=0, rtol=0)
    assert (runner.version, runner.samples_pending, len(runner.forward_cache)) == before
    with pytest.raises(ValueError, match="hidden states must be"):
        runner.last_logits(torch.randn(2, 5, 7))
    with pytest.raises(ValueError, match="only the last stage computes logits"):
        StageRunner(RUN, stage_index=0).last_logits(torch.zeros(1, 3, dtype=torch.long))


# ---- sampling and text (pure) ----

def test_sampling_is_greedy_at_temperature_zero_and_stays_in_the_top_k():
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0, 1.0])
    generator = torch.Generator().manual_seed(0)
    assert sample_token(logits, 0.0, 0, generator) == 1
    assert sample_token(logits, 5.0, 1, generator) == 1
    draws = {sample_token(logits, 10.0, 2, generator) for _ in range(200)}
    assert draws == {1, 2}
    assert len({sample_token(logits, 10.0, 0, generator) for _ in range(500)}) == 5
    again = [sample_token(logits, 1.0, 0, torch.Generator().manual_seed(3)) for _ in range(2)]
    assert again[0] == again[1]


def test_the_window_and_the_byte_text_stream():
    assert context_window(list(range(20)), 16) == list(range(4, 20))
    assert encode_prompt("hé", None, 256) == [104, 195, 169]
    stream = TextStream()
    assert [stream.push(t) for t in (104, 195, 169)] == ["h", "", "é"] and stream.flush() == ""
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        encode_prompt("é", None, 128)


# ---- live: a Llama run trained a few steps, exported and generated from ----


@pytest.fixture
def llama_run(launcher, tmp_path):
    manifest = tmp_path / "run.yaml"
    manifest.write_text(f"run_id: {launcher.run_id}\nnum_stages: 2\ntarget_batch_size: 16\n"
                        "model: {architecture: llama, num_layers: 2, hidden_size: 32, num_heads: 2, seq_len: 16}\n")
    identity = str(tmp_path / "organiser.key")
    boot = launcher.start("bootstrap", ["--manifest", str(manifest), "--identity_path", identity], name="organiser")
    ready = boot.wait_event("bootstrap_ready", timeout=60)
    launcher.initial_peers = ready["maddrs"]
    address = ready["join"]
    peers = [launcher.start("peer", ["--join", address, "--stage", str(stage), *FAST_PEER], name=f"stage{stage}")
             for stage in (0, 1)]
    launcher.wait_ready(peers)
    trainer = launcher.start("train", ["--join", address, "--max_samples", "32", "--batch_size", "8",
                                       "--max_data_mb", "1", "--refresh_period_s", "0.5", "--log_period_s", "1"],
                             name="trainer")
    trainer.wait_event("trainer_done", timeout=90)
    return address


@pytest.mark.long
async def test_a_live_llama_run_exports_to_transformers_and_generates(launcher, llama_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    probe = Probe(launcher.initial_peers, launcher.run_id)
    try:
        records = await probe.wait_for(lambda r: all(online(r, s) and online(r, s)[0].step >= 1 for s in (0, 1))
                                       and len({online(r, s)[0].step for s in (0, 1)}) == 1, 30,
                                       "both stages at one step after training")
        step = online(records, 0)[0].step
        out = tmp_path / "exported"
        # side by side: each spends seconds starting; generating changes no parameter
        exporter = launcher.start("export", ["--join", llama_run, "--out", str(out)], name="exporter")
        generator = launcher.start("generate", ["--join", llama_run, "--prompt", "The", "--max_new_tokens", "6",
                                                "--temperature", "0"], name="generator")
        done = exporter.wait_event("export_done", timeout=60)
        assert set(done["files"]) == {"model.safetensors", "config.json"} and done["tokenizer"] is False
        assert any("byte-token run: no tokenizer files" in line for line in exporter.stdout_lines)
        assert any(f"stage 1: step {step}," in line for line in exporter.stdout_lines), exporter.stdout_lines

        model = transformers.AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
        first, last = online(records, 0)[0].peer_id, online(records, 1)[0].peer_id
        tokens = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(1))
        for length in (16, 5):  # each length puts another position last
            hidden = (await probe.call(first, "forward", {"stage": 0, "inputs": tokens[:, :length]}))["outputs"]
            reply = await probe.call(last, "forward", {"stage": 1, "inputs": hidden, "logits": True})
            assert reply["step"] == step and reply["logits"].shape == (3, 256)
            with torch.no_grad():
                expected = model(tokens[:, :length]).logits[:, -1]
            assert (reply["logits"] - expected).abs().max() <= 1e-4

        result = generator.wait_event("generate_done", timeout=60)
        assert len(result["tokens"]) == 6 and result["tokens_per_s"] > 0
        assert any("tokens/s" in line for line in generator.stdout_lines)
        window = list(b"The")
        for token in result["tokens"]:  # greedy: the exported model's argmax, unless two logits all but tie
            with torch.no_grad():
                logits = model(torch.tensor([window[-16:]])).logits[0, -1]
            top = torch.topk(logits, 2).values
            assert token == int(logits.argmax()) or float(top[0] - top[1]) < 1e-4
            window.append(token)
    finally:
        probe.shutdown()


def test_a_tokenizer_run_exports_files_that_transformers_loads_and_text_streams_whole_characters(tmp_path):
    transformers = pytest.importorskip("transformers")
    text = tmp_path / "text.txt"
    text.write_text("the swarm trains the model; the model generates text. café au lait, s'il vous plaît.\n" * 50)
    tokenizer = train_tokenizer([text], vocab_size=300, out_path=tmp_path / "tokenizer.json")
    out = tmp_path / "exported"
    out.mkdir()
    written = write_tokenizer_files(out, (tmp_path / "tokenizer.json").read_bytes(), seq_len=16)
    assert {path.name for path in written} == {"tokenizer.json", "tokenizer_config.json"}
    loaded = transformers.AutoTokenizer.from_pretrained(str(out))
    prompt = "the café generates"
    ids = encode_prompt(prompt, tokenizer, tokenizer.vocab_size)
    assert loaded(prompt, add_special_tokens=False)["input_ids"] == ids
    assert loaded.eos_token_id == tokenizer.separator_id

    stream = TextStream(tokenizer)
    pieces = [stream.push(token) for token in ids] + [stream.flush()]
    assert "".join(pieces) == prompt and "\ufffd" not in "".join(pieces)
    # byte-level BPE has a token per byte (bytes 0xC3 and 0xA9 spelled as the characters Ã and ©): half a character
    # waits for the rest
    byte_ids = [tokenizer.tokenizer.token_to_id(piece) for piece in ("Ã", "©")]
    halves = [stream.push(token) for token in byte_ids]
    assert halves == ["", "é"]


async def test_the_forward_handler_serves_logits_only_when_asked_and_only_without_training_fields():
    runner = StageRunner(RUN, stage_index=1)
    peer = SimpleNamespace(state=PeerState.ONLINE, stage=1, config=SimpleNamespace(max_batch_samples=64),
                           runner=runner, batcher=None, compute=ComputeThread())
    handlers = StageHandlers(peer)
    hidden = torch.randn(2, 4, LLAMA.hidden_size)
    reply = await handlers.forward({"stage": 1, "inputs": hidden, "logits": True}, "QmCaller")
    torch.testing.assert_close(reply["logits"], runner.last_logits(hidden), atol=0, rtol=0)
    assert (reply["step"], reply["digest"]) == runner.version and peer.compute.in_flight == 0
    targets = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="takes neither targets nor a micro_batch_id"):
        await handlers.forward({"stage": 1, "inputs": hidden, "targets": targets, "logits": True}, "QmCaller")
    with pytest.raises(ValueError, match="logits must be true or false"):
        await handlers.forward({"stage": 1, "inputs": hidden, "logits": "yes"}, "QmCaller")
    peer.compute.shutdown()


def test_the_commands_refuse_bad_input_before_starting_anything():
    # one command (each start imports torch and hivemind): the configs' other checks are tested above
    result = subprocess.run([sys.executable, "-m", "peers.cli", "export", "--dtype", "float32"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "out must name the directory" in result.stderr, result.stderr


def test_text_flags_stay_text_as_written():
    from swarm.config.loading import config_from_dict, parse_role_args

    def config(*argv: str) -> GenerateConfig:
        return config_from_dict(GenerateConfig, parse_role_args(GenerateConfig, list(argv), "generate", "").settings)

    assert config("--prompt", "1984").prompt == "1984" and config("--prompt", "yes").prompt == "yes"
    assert config("--prompt", "[a, b]").prompt == "[a, b]"
    made = config("--prompt", "x", "--sampling_seed", "5", "--temperature", "0", "--tokenizer", "null")
    assert made.sampling_seed == 5 and made.temperature == 0.0 and made.tokenizer is None
    assert config("--prompt", "x", "--tokenizer_sha256", "1" * 63 + "e").run.tokenizer_sha256 == "1" * 63 + "e"
