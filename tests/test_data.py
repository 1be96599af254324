import importlib.util
import json
import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from swarm.training.data import (
    DOCUMENT_SEPARATOR,
    BatchSampler,
    Corpus,
    load_corpus,
    load_hf_dataset,
    stdlib_source_files,
    validation_batches,
)


def _documents(tokens: np.ndarray) -> set[bytes]:
    return {doc for doc in tokens.tobytes().split(DOCUMENT_SEPARATOR) if doc}


def test_stdlib_source_files_are_deterministic_library_sources():
    files = stdlib_source_files()
    assert len(files) > 100
    assert files == stdlib_source_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    relative = [f.relative_to(root).as_posix() for f in files]
    assert relative == sorted(relative)
    assert "os.py" in relative
    assert not any("site-packages" in r or "/test/" in f"/{r}" for r in relative)


def test_stdlib_corpus_loads_fast_and_deterministically():
    start = time.perf_counter()
    corpus = load_corpus()
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0, f"loading the stdlib corpus took {elapsed:.2f}s"
    assert corpus.train.dtype == np.uint8 and corpus.train.size > 1_000_000
    assert 0 < corpus.validation.size < corpus.train.size
    again = load_corpus()
    assert np.array_equal(corpus.train, again.train) and np.array_equal(corpus.validation, again.validation)
    # whole files go to one side, so no document appears in both splits
    assert not _documents(corpus.train) & _documents(corpus.validation)


def test_max_bytes_caps_the_corpus():
    corpus = load_corpus(max_bytes=100_000)
    content = corpus.train.size + corpus.validation.size - np.count_nonzero(
        np.concatenate([corpus.train, corpus.validation]) == DOCUMENT_SEPARATOR[0]
    )
    assert content == 100_000
    assert corpus.validation.size > 0


def _write_text_tree(root: Path, num_files: int = 40) -> None:
    (root / "sub").mkdir(parents=True)
    for i in range(num_files):
        folder = root / "sub" if i % 2 else root
        (folder / f"doc{i:02d}.txt").write_text(f"document number {i}\n" * 5)
    (root / "image.bin").write_bytes(b"\xff\xfe binary, not picked up from a directory")


def test_text_directory_split_is_deterministic_and_disjoint(tmp_path):
    _write_text_tree(tmp_path)
    corpus = load_corpus([tmp_path], validation_fraction=0.25)
    again = load_corpus([str(tmp_path)], validation_fraction=0.25)
    assert np.array_equal(corpus.train, again.train) and np.array_equal(corpus.validation, again.validation)
    train_docs, validation_docs = _documents(corpus.train), _documents(corpus.validation)
    assert len(train_docs) + len(validation_docs) == 40
    assert validation_docs and not train_docs & validation_docs
    assert b"binary" not in corpus.train.tobytes() + corpus.validation.tobytes()


def test_single_small_file_still_gets_a_validation_split(tmp_path):
    path = tmp_path / "one.md"
    path.write_text("hello world " * 100)
    corpus = load_corpus([path])
    assert corpus.train.size > 0 and corpus.validation.size > 0
    joined = corpus.train.tobytes() + corpus.validation.tobytes()
    assert joined == path.read_bytes() + DOCUMENT_SEPARATOR


def test_jsonl_loading(tmp_path):
    path = tmp_path / "data.jsonl"
    records = [{"text": f"record {i} — ünïcode", "id": i} for i in range(30)]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n", encoding="utf-8")
    corpus = load_corpus([path], validation_fraction=0.3)
    docs = _documents(corpus.train) | _documents(corpus.validation)
    assert docs == {r["text"].encode("utf-8") for r in records}
    assert _documents(corpus.validation) and not _documents(corpus.train) & _documents(corpus.validation)


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ("{not json", "not valid JSON"),
        ('{"body": "no text field"}', '"text"'),
        ('{"text": 5}', '"text"'),
        ('["text"]', '"text"'),
    ],
)
def test_malformed_jsonl_names_file_and_line(tmp_path, bad_line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(f'{{"text": "fine"}}\n\n{bad_line}\n{{"text": "fine"}}\n')
    with pytest.raises(ValueError, match=message) as error:
        load_corpus([path])
    assert "bad.jsonl" in str(error.value) and "line 3" in str(error.value)


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_corpus([tmp_path / "missing.txt"])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no data"):
        load_corpus([empty])
    with pytest.raises(ValueError, match="validation_fraction"):
        load_corpus(max_bytes=10, validation_fraction=0.0)
    with pytest.raises(ValueError, match="max_bytes"):
        load_corpus(max_bytes=0)
    with pytest.raises(ValueError, match="validation"):
        Corpus(train=np.zeros(4, dtype=np.uint8), validation=np.zeros(0, dtype=np.uint8))


def test_sampler_windows_are_shifted_by_one():
    tokens = np.arange(200, dtype=np.uint8)
    inputs, targets = BatchSampler(tokens, seq_len=8, batch_size=5, seed=0).sample()
    assert inputs.shape == targets.shape == (5, 8)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert torch.equal(targets - inputs, torch.ones_like(inputs))  # consecutive bytes of arange


def test_samplers_differ_by_seed_and_repeat_with_same_seed():
    tokens = load_corpus(max_bytes=50_000).train
    a, b, c = (BatchSampler(tokens, 32, 4, seed) for seed in (1, 1, 2))
    for _ in range(3):
        batch_a, batch_b, batch_c = a.sample(), b.sample(), c.sample()
        assert torch.equal(batch_a[0], batch_b[0]) and torch.equal(batch_a[1], batch_b[1])
        assert not torch.equal(batch_a[0], batch_c[0])


def test_sampler_reaches_the_last_window():
    tokens = np.arange(10, dtype=np.uint8)  # exactly one window choice besides start 0
    sampler = BatchSampler(tokens, seq_len=8, batch_size=64, seed=0)
    starts = {int(start) for start in sampler.sample()[0][:, 0]}
    assert starts == {0, 1}
    with pytest.raises(ValueError, match="seq_len"):
        BatchSampler(tokens, seq_len=10, batch_size=1, seed=0)


def test_validation_batches_are_deterministic_and_span_the_split():
    tokens = np.arange(250, dtype=np.uint8)
    batches = validation_batches(tokens, seq_len=9, batch_size=4, num_batches=3)
    assert len(batches) == 3
    assert all(x.shape == y.shape == (4, 9) for x, y in batches)
    starts = [int(x[i, 0]) for x, _ in batches for i in range(4)]
    assert starts[0] == 0 and starts[-1] == 250 - 10
    assert starts == sorted(starts)
    again = validation_batches(tokens, seq_len=9, batch_size=4, num_batches=3)
    assert all(torch.equal(x, x2) and torch.equal(y, y2) for (x, y), (x2, y2) in zip(batches, again))


def test_hf_loader_missing_package_message(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("No module named 'datasets'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(ImportError, match=r"pip install swarm\[hf\]"):
        load_hf_dataset("anything.jsonl")


@pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="optional extra `datasets` is not installed")
def test_hf_loader_on_local_jsonl(tmp_path, monkeypatch):
    # nothing may download, nor write to the user's cache (effective when datasets is first imported here)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    # a fixed relative path: documents are assigned to validation by a hash of their name, which
    # holds the path, so under a changing temporary directory some runs would hold out no row at all
    monkeypatch.chdir(tmp_path)
    path = Path("rows.jsonl")
    texts = [f"row {i}: some text" for i in range(50)]
    path.write_text("\n".join(json.dumps({"content": t, "n": i}) for i, t in enumerate(texts)) + "\n")
    corpus = load_hf_dataset(str(path), text_field="content")
    assert _documents(corpus.train) | _documents(corpus.validation) == {t.encode() for t in texts}
    assert corpus.validation.size > 0 and not _documents(corpus.train) & _documents(corpus.validation)
    capped = load_hf_dataset(str(path), text_field="content", max_bytes=40)
    assert capped.train.size + capped.validation.size == 40 + 3  # 40 bytes of text over 3 documents
    with pytest.raises(ValueError, match="text_field"):
        load_hf_dataset(str(path), text_field="missing")
