"""A run's tokenizer: training, loading and hashing it, the CLI, the tokenized corpus and its thread, and
the organiser serving the file to joining trainers (who refuse any other bytes)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List

import numpy as np
import pytest
import torch

from peers import tokenizer as tokenizer_cli
from peers._common import fetch_run_manifest, fetch_tokenizer_or_exit
from peers.bootstrap import attach_tokenizer
from peers.trainer import check_run_tokenizer, with_run_tokenizer
from swarm.client.trainer import load_trainer_corpus
from swarm.config.settings import BootstrapConfig, RunConfig, TrainerConfig
from swarm.dht.manifest import (TOKENIZER_METHOD, fetch_tokenizer_from, run_hash, run_settings, sign_manifest,
                                tokenizer_handler, verify_manifest)
from swarm.dht.identity import load_or_create_identity
from swarm.model.gpt import ModelConfig
from swarm.net.rpc import NAMESPACE, RemoteError, RPCServicer
from swarm.training.data import BatchSampler, load_corpus, validation_batches
from swarm.training.tokenized import TokenizedCorpus, TokenizedSampler, load_tokenized_corpus, make_sampler
from swarm.training.tokenizer import (DOCUMENT_SEPARATOR_TOKEN, MIN_VOCAB_SIZE, TokenizerError, file_sha256,
                                      find_cached, load_run_tokenizer, load_tokenizer, split_text, store_cached,
                                      train_tokenizer)
from tests.utils.processes import REPO

WORDS = ("the swarm trains a model over many peers while each stage holds a few layers and the trainer "
         "routes micro batches through replicas that average their gradients every step").split()
MODEL = dict(num_layers=2, hidden_size=32, num_heads=2, seq_len=16)


def make_texts(num_docs: int, lines: int = 12, seed: int = 0) -> List[str]:
    """Made-up documents of words, punctuation, indents and blank lines: a few KB of text in all."""
    rng = random.Random(seed)
    docs = []
    for _ in range(num_docs):
        body = []
        for _ in range(lines):
            indent = " " * rng.choice((0, 0, 4, 8))
            body.append(indent + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) + rng.choice(".,;:!?"))
            if rng.random() < 0.2:
                body.append(rng.choice(("", "  ", "\t")))
        docs.append("\n".join(body) + rng.choice(("", "\n", "\n\n")))
    return docs


def cuttable_text(num_lines: int, seed: int = 0) -> str:
    """Short lines, every other one indented, with blank lines and runs of spaces and tabs: any 100 characters
    hold a newline between two non-space characters, where :func:`split_text` may cut without changing ids."""
    rng = random.Random(seed)
    lines = []
    for index in range(num_lines):
        words = rng.choice((" ", "  ", " \t")).join(rng.choice(WORDS[:12]) for _ in range(rng.randint(1, 4)))
        lines.append(("    " * rng.randint(1, 2) if index % 2 else "") + words + rng.choice(".,;:!?"))
        if index % 2 == 0 and rng.random() < 0.3:
            lines.append(rng.choice(("", "  ", "\t ")))
    return "\n".join(lines)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("text")
    for index, text in enumerate(make_texts(24)):
        (root / f"doc{index:02d}.txt").write_text(text)
    return root


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    return train_tokenizer([data_dir], vocab_size=320, out_path=path), path


def encoded(tokenizer, texts: List[str]) -> np.ndarray:
    """Each text encoded on its own by the library, followed by the separator: what a corpus must yield."""
    ids = []
    for text in texts:
        ids += tokenizer.tokenizer.encode(text, add_special_tokens=False).ids + [tokenizer.separator_id]
    return np.array(ids, dtype=np.int64)


def stream_of(samples: List[np.ndarray]) -> np.ndarray:
    """The token stream that samples overlapping by one id were cut from."""
    return np.concatenate([samples[0]] + [sample[1:] for sample in samples[1:]]).astype(np.int64)


# ---- training, loading, hashing ----


def test_train_then_load_round_trips_text(trained):
    tokenizer, path = trained
    assert MIN_VOCAB_SIZE <= tokenizer.vocab_size <= 320 and path.is_file()
    loaded = load_tokenizer(path)
    assert (loaded.sha256, loaded.vocab_size, loaded.separator_id) == \
        (tokenizer.sha256, tokenizer.vocab_size, tokenizer.separator_id)
    text = "the swarm routes micro batches; ünïcode ☃ and bytes it never saw\n\tindented"
    ids = loaded.encode_batch([text])[0]
    assert ids.dtype == np.int32 and 0 <= ids.min() and ids.max() < loaded.vocab_size
    assert loaded.tokenizer.decode(ids.tolist()) == text  # byte-level: any text, no unknown token
    assert len(ids) < len(text.encode()), "merges learnt from the text should shorten it"
    # only the corpus inserts the separator: the text's own spelling of it stays text
    assert loaded.separator_id not in loaded.encode_batch([f"a {DOCUMENT_SEPARATOR_TOKEN} b"])[0]


def test_the_hash_is_the_sha256_of_the_file(trained, tmp_path):
    tokenizer, path = trained
    assert tokenizer.sha256 == file_sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()
    changed = tmp_path / "changed.json"
    changed.write_bytes(path.read_bytes().replace(b'"version"', b' "version"', 1))
    assert load_tokenizer(changed).vocab_size == tokenizer.vocab_size  # still a valid tokenizer...
    other = file_sha256(changed)
    assert other != tokenizer.sha256  # ...but not the same file
    with pytest.raises(TokenizerError, match=f"{other}.*{tokenizer.sha256}"):
        load_tokenizer(changed, expected_sha256=tokenizer.sha256)


def test_a_model_vocab_other_than_the_tokenizers_is_refused(trained):
    tokenizer, path = trained
    with pytest.raises(TokenizerError, match=f"vocab_size 256.*{tokenizer.vocab_size} tokens"):
        load_tokenizer(path, tokenizer.sha256, vocab_size=256)
    with pytest.raises(TokenizerError, match="set the run's vocab_size"):
        load_run_tokenizer(str(path), tokenizer.sha256, tokenizer.vocab_size + 1, "/nonexistent")
    assert load_run_tokenizer(str(path), tokenizer.sha256, tokenizer.vocab_size, "/nonexistent").sha256 == \
        tokenizer.sha256


def test_training_refuses_bad_input_before_it_starts(data_dir, tmp_path):
    out = tmp_path / "t.json"
    with pytest.raises(TokenizerError, match="does not exist"):
        train_tokenizer([data_dir / "missing.txt"], 300, out)
    with pytest.raises(TokenizerError, match=f"at least {MIN_VOCAB_SIZE}"):
        train_tokenizer([data_dir], 256, out)
    with pytest.raises(TokenizerError, match="directory .* does not exist"):
        train_tokenizer([data_dir], 300, tmp_path / "no" / "such" / "t.json")
    with pytest.raises(TokenizerError, match="is a directory"):
        train_tokenizer([data_dir], 300, tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="no text"):
        train_tokenizer([tmp_path / "empty"], 300, out)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{not json\n')
    with pytest.raises(TokenizerError, match="line 2"):
        train_tokenizer([bad], 300, out)
    assert not out.exists()
    with pytest.raises(TokenizerError, match="not a tokenizer.json"):
        load_tokenizer(bad)


def test_cli_writes_the_tokenizer_and_prints_its_size_and_hash(data_dir, tmp_path):
    out = tmp_path / "cli.json"
    result = subprocess.run([sys.executable, "-m", "peers.cli", "tokenizer", "--data", str(data_dir),
                             "--vocab_size", "300", "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    sha = hashlib.sha256(out.read_bytes()).hexdigest()
    vocab_size = load_tokenizer(out).vocab_size
    assert str(out) in result.stdout and sha in result.stdout and f"{vocab_size} tokens" in result.stdout


@pytest.mark.parametrize("args, message", [
    (["--data", "{data}/missing.txt"], "data path does not exist"),
    (["--data", "{data}", "--vocab_size", "100"], "vocab_size must be an integer of at least 257"),
    (["--data", "{data}", "--out", "{tmp}/no/such/dir/t.json"], "cannot write the tokenizer"),
])
def test_cli_refuses_bad_input_with_one_line(data_dir, tmp_path, capsys, args, message):
    argv = [arg.format(data=data_dir, tmp=tmp_path) for arg in args]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "t.json")]
    assert tokenizer_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


# ---- the tokenized corpus ----


def test_tokenized_corpus_samples_are_a_direct_encode_of_the_text(trained):
    tokenizer, _ = trained
    texts = make_texts(10, seed=1) + [cuttable_text(60, seed=1)]
    expected = encoded(tokenizer, texts)
    # small encoding batches and pieces: the batching and the cutting of long documents must not show
    with TokenizedCorpus(texts, texts[:2], tokenizer, seq_len=16, seed=0, shuffle=False, batch_chars=300,
                         piece_chars=max(map(len, texts[:-1]))) as corpus:
        count = (2 * len(expected) - 1) // 16  # two epochs at most: the stream wraps around to the first document
        samples = [corpus.next_sample() for _ in range(count)]
        assert all(sample.shape == (17,) and sample.dtype == np.int32 for sample in samples)
        stream = stream_of(samples)
        assert np.array_equal(stream[:len(expected)], expected)
        assert np.array_equal(stream[len(expected):], expected[:len(stream) - len(expected)])
        assert corpus.epoch >= 1
        assert np.array_equal(corpus.validation, encoded(tokenizer, texts[:2]))


def test_long_documents_cut_into_pieces_encode_like_the_whole(trained):
    tokenizer, _ = trained
    text = cuttable_text(200, seed=2)
    pieces = split_text(text, 100)
    assert len(pieces) > 20 and "".join(pieces) == text and max(map(len, pieces)) <= 100
    assert all(piece.endswith("\n") for piece in pieces[:-1])  # every cut where the ids cannot change
    whole = tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
    assert np.concatenate(list(tokenizer.encode_documents([text], piece_chars=100, batch_chars=250))).tolist() == \
        whole + [tokenizer.separator_id]
    # without such a newline a piece ends where it must
    assert split_text("x" * 250, 100) == ["x" * 100, "x" * 100, "x" * 50]


def test_the_sampler_gives_shifted_int64_batches_and_the_seed_picks_the_order(trained):
    tokenizer, _ = trained
    texts = make_texts(30, lines=3, seed=3)
    corpora = [TokenizedCorpus(texts, texts[:1], tokenizer, seq_len=16, seed=seed) for seed in (5, 5, 6)]
    try:
        samplers = [make_sampler(corpus, 16, 4, seed=0) for corpus in corpora]
        assert all(isinstance(sampler, TokenizedSampler) for sampler in samplers)
        (inputs, targets), (inputs_again, _), (other, _) = (sampler.sample() for sampler in samplers)
        assert inputs.shape == targets.shape == (4, 16) and inputs.dtype == targets.dtype == torch.int64
        assert torch.equal(inputs[:, 1:], targets[:, :-1]) and int(inputs.max()) < tokenizer.vocab_size
        assert torch.equal(inputs, inputs_again) and not torch.equal(inputs, other)
        with pytest.raises(ValueError, match="seq_len 16"):
            make_sampler(corpora[0], 32, 4, seed=0)
    finally:
        for corpus in corpora:
            corpus.close()
    assert isinstance(make_sampler(load_corpus(max_bytes=10_000), 16, 4, seed=0), BatchSampler)  # bytes: as before


def tokenizing_threads() -> List[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "tokenized-corpus"]


def test_closing_the_corpus_stops_its_thread(trained):
    tokenizer, _ = trained
    before = len(tokenizing_threads())
    corpus = TokenizedCorpus(make_texts(5), ["validation text"], tokenizer, seq_len=8, seed=0, queue_samples=4)
    deadline = time.monotonic() + 30
    while not corpus._queue.full() and time.monotonic() < deadline:  # then the thread waits to put the next one
        time.sleep(0.05)
    assert corpus._queue.full() and corpus.running and len(tokenizing_threads()) == before + 1
    corpus.close()
    assert not corpus.running and len(tokenizing_threads()) == before
    with pytest.raises(RuntimeError, match="closed"):
        corpus.next_sample()


def test_a_corpus_too_small_for_one_sample_fails_when_loaded(trained, tmp_path):
    tokenizer, _ = trained
    (tmp_path / "tiny.txt").write_text("the swarm trains")
    before = len(tokenizing_threads())
    with pytest.raises(RuntimeError, match="need at least seq_len \\+ 1 = 65"):
        load_tokenized_corpus(tokenizer, 64, 0, [tmp_path / "tiny.txt"])
    assert len(tokenizing_threads()) == before


def test_a_trainer_of_a_tokenized_run_reads_token_ids(trained, data_dir, tmp_path):
    tokenizer, path = trained
    run = RunConfig(model=ModelConfig(**MODEL, vocab_size=tokenizer.vocab_size), tokenizer_sha256=tokenizer.sha256)
    config = TrainerConfig(data=[str(data_dir)], tokenizer=str(path), tokenizer_cache_dir=str(tmp_path), run=run)
    corpus = load_trainer_corpus(config)
    try:
        inputs, targets = make_sampler(corpus, 16, 8, seed=config.trainer_seed).sample()
        assert inputs.shape == (8, 16) and torch.equal(inputs[:, 1:], targets[:, :-1])
        assert int(inputs.max()) < tokenizer.vocab_size
        (val_inputs, _), = validation_batches(corpus.validation, 16, 2, 1)
        assert val_inputs.shape == (2, 16)
    finally:
        corpus.close()
    assert not corpus.running
    with pytest.raises(TokenizerError, match="vocab_size 256"):
        load_trainer_corpus(dataclasses.replace(config, run=dataclasses.replace(run, model=ModelConfig(**MODEL))))
    byte_config = TrainerConfig(data=[str(data_dir)], run=RunConfig(model=ModelConfig(**MODEL)))
    assert np.array_equal(load_trainer_corpus(byte_config).train, load_corpus([str(data_dir)]).train)


# ---- the run names its tokenizer ----


def test_run_settings_name_the_tokenizer_by_hash(trained):
    tokenizer, _ = trained
    byte_run = RunConfig()
    assert "tokenizer_sha256" not in run_settings(byte_run)  # a byte-token run keeps its settings and hash
    run = RunConfig(model=ModelConfig(vocab_size=tokenizer.vocab_size), tokenizer_sha256=tokenizer.sha256.upper())
    assert run.tokenizer_sha256 == tokenizer.sha256 and run_settings(run)["tokenizer_sha256"] == tokenizer.sha256
    assert run_hash(run) != run_hash(dataclasses.replace(run, tokenizer_sha256=""))
    organiser = load_or_create_identity(None)
    assert verify_manifest(sign_manifest(run, organiser, revision=1), organiser.peer_id).run == run
    with pytest.raises(ValueError, match="tokenizer_sha256 must be 64 hex"):
        RunConfig(tokenizer_sha256="abc")
    with pytest.raises(ValueError, match="trains on byte tokens"):
        TrainerConfig(tokenizer="tokenizer.json")
    with pytest.raises(ValueError, match="needs a manifest"):
        BootstrapConfig(tokenizer="tokenizer.json")


def test_the_organiser_names_its_tokenizer_and_refuses_contradictions(trained, tmp_path):
    tokenizer, path = trained
    run = RunConfig(model=ModelConfig(vocab_size=tokenizer.vocab_size))
    named, data = attach_tokenizer(run, str(path))
    assert named.tokenizer_sha256 == tokenizer.sha256 and data == path.read_bytes()
    assert attach_tokenizer(named, str(path))[0] == named
    other = "0" * 64
    with pytest.raises(ValueError, match=f"{tokenizer.sha256}.*{other}"):
        attach_tokenizer(dataclasses.replace(run, tokenizer_sha256=other), str(path))
    with pytest.raises(ValueError, match="vocab_size 256"):
        attach_tokenizer(RunConfig(), str(path))
    with pytest.raises(ValueError, match="--tokenizer PATH"):
        attach_tokenizer(named, None)
    assert attach_tokenizer(RunConfig(), None) == (RunConfig(), None)


def test_the_cache_keeps_files_by_hash_and_ignores_damaged_ones(trained, tmp_path):
    tokenizer, path = trained
    data = path.read_bytes()
    assert find_cached(tokenizer.sha256, tmp_path) is None
    cached = store_cached(data, tokenizer.sha256, tmp_path / "cache")
    assert cached.name == f"{tokenizer.sha256}.json" and find_cached(tokenizer.sha256, tmp_path / "cache") == cached
    assert load_run_tokenizer(None, tokenizer.sha256, tokenizer.vocab_size, tmp_path / "cache").sha256 == \
        tokenizer.sha256
    cached.write_bytes(data[:-1])
    assert find_cached(tokenizer.sha256, tmp_path / "cache") is None
    with pytest.raises(TokenizerError, match="--tokenizer PATH, or join with --join"):
        load_run_tokenizer(None, tokenizer.sha256, tokenizer.vocab_size, tmp_path / "cache")
    with pytest.raises(TokenizerError, match="run names"):
        store_cached(data + b" ", tokenizer.sha256, tmp_path / "cache")


# ---- the organiser serves the file; a joiner fetches and checks it ----


async def serving(data: bytes):
    """A P2P node on loopback that serves ``data`` as the tokenizer RPC; returns (node, its address, set_data)."""
    from hivemind.p2p import P2P

    node = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    served = {"handler": tokenizer_handler(data)}

    async def handle(message, caller):
        return await served["handler"](message, caller)

    await RPCServicer({TOKENIZER_METHOD: handle}).add_p2p_handlers(node, namespace=NAMESPACE)
    address = str((await node.get_visible_maddrs())[0])
    return node, address, lambda new: served.update(handler=tokenizer_handler(new))


async def test_a_joiner_fetches_the_tokenizer_and_refuses_a_tampered_file(trained):
    from hivemind.p2p import P2P

    tokenizer, path = trained
    data = path.read_bytes()
    server, address, serve = await serving(data)
    client = None
    try:
        client = await P2P.create(initial_peers=[address])
        assert await fetch_tokenizer_from(client, address, tokenizer.sha256, timeout=30) == data
        tampered = data.replace(b'"merges"', b' "merges"', 1)
        serve(tampered)
        with pytest.raises(TokenizerError, match=f"{hashlib.sha256(tampered).hexdigest()}.*{tokenizer.sha256}"):
            await fetch_tokenizer_from(client, address, tokenizer.sha256, timeout=30)
        serve(data + b" " * 10_000)  # too large for the bound the joiner sets: refused before it is decoded
        with pytest.raises(RemoteError, match="exceeds"):
            await fetch_tokenizer_from(client, address, tokenizer.sha256, timeout=30, max_bytes=len(data))
    finally:
        if client is not None:
            await client.shutdown()
        await server.shutdown()


class ServingThread:
    """:func:`serving` in an event loop of its own thread, for code that runs ``asyncio.run`` itself."""

    def __init__(self, data: bytes):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.node, self.address, self.serve = self._run(serving(data))

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=60)

    def close(self) -> None:
        try:
            self._run(self.node.shutdown())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
            self.loop.close()


def test_a_joining_trainer_fetches_caches_and_checks_the_runs_tokenizer(trained, tmp_path, capsys):
    tokenizer, path = trained
    data = path.read_bytes()
    run = RunConfig(model=ModelConfig(**MODEL, vocab_size=tokenizer.vocab_size), tokenizer_sha256=tokenizer.sha256)
    cache = tmp_path / "cache"
    server = ServingThread(data)
    try:
        joined = TrainerConfig(run=run, tokenizer_cache_dir=str(cache))
        joined.network.initial_peers = [server.address]  # as join_settings leaves it: the organiser first
        config = with_run_tokenizer(joined, manifest=object())
        assert config.tokenizer == str(cache / f"{tokenizer.sha256}.json") and Path(config.tokenizer).read_bytes() == data
        check_run_tokenizer(config)
        server.serve(data.replace(b'"merges"', b' "merges"', 1))  # the cached copy is used: nothing is fetched
        assert fetch_tokenizer_or_exit(server.address, tokenizer.sha256, str(cache)) == config.tokenizer
        with pytest.raises(SystemExit) as exit_info:
            fetch_tokenizer_or_exit(server.address, tokenizer.sha256, str(tmp_path / "empty_cache"))
        assert exit_info.value.code == 1
        assert tokenizer.sha256 in capsys.readouterr().err and not (tmp_path / "empty_cache").exists()
    finally:
        server.close()
    assert with_run_tokenizer(TrainerConfig(), manifest=object()) == TrainerConfig()  # bytes: nothing to fetch
    with pytest.raises(TokenizerError, match="not in the cache"):
        check_run_tokenizer(TrainerConfig(run=run, tokenizer_cache_dir=str(tmp_path / "none")))


def test_the_organiser_serves_the_tokenizer_its_manifest_names(launcher, trained, tmp_path):
    tokenizer, path = trained
    manifest = tmp_path / "run.yaml"
    manifest.write_text(json.dumps({"run_id": launcher.run_id, "num_stages": 2, "target_batch_size": 64,
                                    "model": {**MODEL, "vocab_size": tokenizer.vocab_size}}))
    boot = launcher.start("bootstrap", ["--manifest", str(manifest), "--tokenizer", str(path)], name="organiser")
    ready = boot.wait_event("bootstrap_ready", timeout=60)
    assert ready["tokenizer_sha256"] == tokenizer.sha256

    async def fetch():
        from hivemind.p2p import P2P

        signed = await fetch_run_manifest(ready["join"])
        client = await P2P.create(initial_peers=[ready["join"]])
        try:
            return signed, await fetch_tokenizer_from(client, ready["join"], signed.run.tokenizer_sha256, timeout=30)
        finally:
            await client.shutdown()

    signed, data = asyncio.run(fetch())
    assert signed.run.tokenizer_sha256 == tokenizer.sha256 and data == path.read_bytes()
