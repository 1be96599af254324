"""2 stages x 2 replicas with 2 trainers train the model: every sample the trainers send ends up in an
applied global step or in the step still open (none lost; one counted twice only where its micro-batch was
re-sent or failed half-way), the validation loss falls clearly below where it started, and it ends near where
single-process training of the same model from the same initialisation ends after as many samples in as many
steps. Four swarms: the byte-level GPT; the same with activations, their gradients and the stage all-reduce
compressed to int8; the same with ternary gradients in the all-reduce (17x fewer bytes than float32); and a Llama (RMSNorm, rotary positions, SwiGLU, one key/value head for two query heads) on
the tokens of a byte-level BPE tokenizer of 512 tokens trained here, in int8.

The bounds are set from measured run-to-run noise. How close a swarm comes to one process is a benchmark's
figure; a test that asserts it tightly fails on noise. Measured on this project's 2-core machine, shared with
other jobs (load average 10 to 28), the excess of the swarm's validation loss over its single-process baseline
was, in 8 runs of each GPT swarm and 6 of the Llama one:
  GPT uncompressed: -0.19% to +0.74% (+0.06, +0.13, +0.20, +0.21, +0.32, +0.67, +0.74, -0.19; earlier, +1.87%);
  GPT int8:         -0.26% to +0.58% (+0.11, +0.14, +0.19, +0.37, +0.43, +0.43, +0.58, -0.26; earlier, +0.51%);
  Llama BPE int8:   +0.81% to +1.27% (+0.81, +0.81, +0.90, +0.97, +1.19, +1.27);
  GPT ternary:      -0.34% to +0.07% (+0.07, -0.29, -0.34; 3 runs; ``benchmarks/compression.py`` measures the
                    codec at more steps and seeds).
Every GPT swarm's loss fell by 1.60 to 1.84 nats from 5.53 (each baseline's by 1.63 to 1.86); the Llama swarm's
by 0.80 to 0.85 nats from 6.23 (its baseline's by 0.86 to 0.90). ``max_excess`` (5%) is 2.7 times the largest GPT excess
seen (3.9 times the Llama's), MIN_FALL under two thirds of the smallest GPT fall and LLAMA_MIN_FALL under two
thirds of the smallest Llama fall. In one run of the 16 GPT runs a stage held a re-sent micro-batch twice (8
samples), which the bound on samples allows. The ternary swarm has the GPT swarms' bound.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Union

import pytest
import torch

from swarm.dht.records import PeerRecord
from swarm.model.gpt import ModelConfig
from swarm.model.stages import FullModel
from swarm.training.data import Corpus, load_corpus, stdlib_source_files, validation_batches
from swarm.training.tokenized import TokenizedCorpus, load_tokenized_corpus
from swarm.training.tokenizer import RunTokenizer, train_tokenizer
from swarm.training.optimizer import OptimizerConfig
from swarm.training.single_process import evaluate, train_single_process
from tests.utils.probe import online

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_heads=2, seq_len=16)
LLAMA_ARGS = ["--architecture", "llama", "--num_kv_heads", "1"]
TARGET, PER_TRAINER, BATCH, LR = 64, 640, 8, 0.003
TOKENIZER_VOCAB, TOKENIZER_TEXT_BYTES, DATA_BYTES = 512, 2**20, 2 * 2**20
MIN_FALL = 1.0  # nats of validation loss a byte-level swarm must shed from its initial value
LLAMA_MIN_FALL = 0.5  # the same for the Llama swarm on BPE tokens
# the same with a narrow boundary, whose early steps follow the order of the samples more: the swarm's trainers and the
# baseline draw different ones, which put the swarm 2.6-4.2% below its baseline in 4 runs
MAX_BOUNDARY_EXCESS = 0.08
# the same with overlapped averaging, whose gradients are one step stale: +2.5% to +5.3% in 4 runs of these 16-17 steps
MAX_OVERLAP_EXCESS = 0.10


@dataclass(frozen=True)
class Case:
    """One swarm the test trains: the model it runs and what its roles are given besides the common flags."""

    name: str
    model: ModelConfig
    run_args: Sequence[str]  # for every role
    min_fall: float  # nats of validation loss the swarm and its baseline must shed from their initial value
    trainer_args: Sequence[str] = ()
    peer_args: Sequence[str] = ()
    max_excess: float = 0.05  # relative excess of the swarm's validation loss over its single-process baseline


@dataclass
class SwarmRun:
    """What a trained swarm leaves once its last global step settled."""

    sent: int  # samples the trainers sent, each counted once (when its micro-batch went through)
    repeatable: int  # samples a stage may hold twice: those of re-sent micro-batches and of failed ones
    last_stage: List[PeerRecord]  # the records of the last stage's replicas
    model: FullModel  # the swarm's parameters


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> RunTokenizer:
    """A byte-level BPE tokenizer trained here on the first MiB of the text the trainers read."""
    text_dir = tmp_path_factory.mktemp("bpe_text")
    taken = 0
    for index, path in enumerate(stdlib_source_files()):
        if taken >= TOKENIZER_TEXT_BYTES:
            break
        data = path.read_bytes()
        (text_dir / f"{index}.txt").write_bytes(data)
        taken += len(data)
    return train_tokenizer([text_dir], TOKENIZER_VOCAB, text_dir.parent / "tokenizer.json")


def make_case(name: str, bpe: RunTokenizer) -> Case:
    if name in ("gpt", "gpt_int8"):
        return Case(name, MODEL, [] if name == "gpt" else ["--compression", "int8"], MIN_FALL)
    if name == "gpt_overlap":  # replicas accumulate the next step while one is averaged: gradients one step stale
        return Case(name, MODEL, [], MIN_FALL, peer_args=["--overlap_averaging", "true"], max_excess=MAX_OVERLAP_EXCESS)
    if name == "gpt_int4":  # activations and their gradients in 4 bits, the stage all-reduce in int8
        return Case(name, MODEL, ["--compression", "int4"], MIN_FALL)
    if name == "gpt_int8_boundary":  # stage 0 sends 8 of its 32 values a token, in int8: 16x fewer bytes than float32
        return Case(name, dataclasses.replace(MODEL, boundary_dim=8), ["--compression", "int8", "--boundary_dim", "8"],
                    MIN_FALL, max_excess=MAX_BOUNDARY_EXCESS)
    if name == "gpt_ternary":  # the stage all-reduce sends every gradient value as 0 or ±its block's scale
        return Case(name, MODEL, ["--gradient_compression", "ternary"], MIN_FALL)
    # Llama blocks, a BPE tokenizer, and activations, their gradients and the stage all-reduce in int8
    model = dataclasses.replace(MODEL, architecture="llama", num_kv_heads=1, vocab_size=bpe.vocab_size)
    return Case(name, model, [*LLAMA_ARGS, "--vocab_size", str(bpe.vocab_size), "--tokenizer_sha256", bpe.sha256,
                              "--compression", "int8"], LLAMA_MIN_FALL, ["--tokenizer", bpe.source])


async def train(launcher, probe, case: Case) -> SwarmRun:
    """Train the swarm of ``case`` and wait until its last global step settles."""
    args = ["--lr", str(LR), *case.run_args]
    launcher.wait_ready([launcher.peer(stage, target_batch_size=TARGET, extra=[*args, *case.peer_args], wait=False)
                         for stage in (0, 0, 1, 1)])
    await probe.wait_for(lambda r: all(len(online(r, s)) == 2 for s in (0, 1)), 30, "2 replicas per stage")
    trainers = [launcher.trainer(target_batch_size=TARGET, extra=[*args, *case.trainer_args, "--max_samples",
                                                                   str(PER_TRAINER), "--batch_size", str(BATCH),
                                                                   "--trainer_seed", str(i), "--max_in_flight", "2"])
                for i in (1, 2)]
    done = [t.wait_event("trainer_done", timeout=240) for t in trainers]

    def settled(r) -> bool:
        return (len(r) == 4 and len({x.step for x in r.values()}) == 1 and not any(x.samples_frozen for x in r.values())
                and sum(x.samples_pending for x in online(r, 1)) < TARGET)

    announced = await probe.wait_for(settled, 60, "the swarm to finish its last global step")
    # an announced record is up to one announce period old: one stored just before a micro-batch's backward
    # landed undercounts what that replica holds, so the counts are taken from the peers themselves
    records = await live_records(probe, announced, settled, 30)
    model = FullModel(case.model, num_stages=2, seed=0)
    for stage in (0, 1):
        exported = await probe.call(online(records, stage)[0].peer_id, "parameters", {})
        with torch.no_grad():
            for param, value in zip(model.stages[stage].parameters(), exported["parameters"]):
                param.copy_(value)
    return SwarmRun(sent=sum(d["samples_sent"] for d in done),
                    repeatable=BATCH * sum(d["resent"] + d["failed"] for d in done),
                    last_stage=online(records, 1), model=model)


async def live_records(probe, announced: Dict[str, PeerRecord], settled: Callable[[Dict[str, PeerRecord]], bool],
                       timeout: float) -> Dict[str, PeerRecord]:
    """The peers' records as each peer holds them now (its ``info``), once ``settled`` holds for them."""
    deadline, records = time.monotonic() + timeout, announced
    while time.monotonic() < deadline:
        replies = [await probe.call(peer_id, "info", {}, timeout=10) for peer_id in announced]
        records = {reply["peer_id"]: PeerRecord.model_validate(reply) for reply in replies}
        if settled(records):
            return records
        await asyncio.sleep(0.3)
    raise TimeoutError(f"the peers' own records did not settle within {timeout}s: "
                       f"{[(r.stage, r.step, r.samples_pending, r.samples_frozen) for r in records.values()]}")


def baseline_corpus(case: Case, bpe: RunTokenizer) -> Union[Corpus, TokenizedCorpus]:
    """The documents the trainers read (2 MiB of them), as bytes or as the run's tokens."""
    if case.model.architecture == "gpt":
        return load_corpus(None, max_bytes=DATA_BYTES)
    return load_tokenized_corpus(bpe, case.model.seq_len, seed=7, max_bytes=DATA_BYTES)


# a live swarm of six roles: on a 2-core machine that other jobs share it can outlast the suite's 300 s bound
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["gpt", "gpt_overlap", "gpt_int8", "gpt_int4", "gpt_int8_boundary",
                                  "gpt_ternary", "llama_bpe_int8"])
@pytest.mark.long
async def test_swarm_trains_and_ends_near_single_process(launcher, probe, bpe, name):
    case = make_case(name, bpe)
    swarm = await train(launcher, probe, case)
    launcher.close()  # the swarm's processes: the baseline below gets the cores to itself
    steps = swarm.last_stage[0].step
    applied = max(r.samples_applied for r in swarm.last_stage)
    held = applied + sum(r.samples_pending for r in swarm.last_stage)

    corpus = baseline_corpus(case, bpe)
    try:
        batches = validation_batches(corpus.validation, case.model.seq_len, batch_size=32, num_batches=8)
        initial = evaluate(FullModel(case.model, num_stages=2, seed=0), batches)
        swarm_loss = evaluate(swarm.model, batches)
        # a global step closes once the stage holds *at least* TARGET samples, so with micro-batches in
        # flight steps run a little larger; the baseline takes the same samples in the same number of steps
        local, _ = train_single_process(case.model, 2, 0, OptimizerConfig(lr=LR), batch_size=round(applied / steps),
                                        num_steps=steps, sampler_seed=7, corpus=corpus)
    finally:
        corpus.close()
    local_loss = evaluate(local, batches)
    excess = (swarm_loss - local_loss) / local_loss
    print(f"validation loss {name}: initial {initial:.4f}, swarm {swarm_loss:.4f}, single process "
          f"{local_loss:.4f} ({excess:+.2%}); {steps} global steps of {applied / steps:.1f} samples on average "
          f"(target {TARGET}); sent {swarm.sent}, held {held} (applied {applied}), up to {swarm.repeatable} twice")

    assert swarm.sent == 2 * PER_TRAINER
    assert steps * TARGET <= applied, "a global step closed short of the target"
    assert swarm.sent <= held, "samples sent are in no step"
    assert held <= swarm.sent + swarm.repeatable, "samples counted twice without a re-send"
    assert initial - local_loss > case.min_fall, "the baseline must learn something for the comparison to mean anything"
    assert initial - swarm_loss > case.min_fall, f"the swarm did not train: {initial:.4f} -> {swarm_loss:.4f}"
    assert abs(excess) <= case.max_excess, f"{excess:+.2%} from single-process training"
