"""Byte-level training data: the embedded stdlib corpus, local files, and batch sampling.

The default corpus is one every machine already has: the source of Python's own standard
library. Tokens are raw bytes (vocabulary 256), so there is no tokenizer to ship or agree
on. Documents are joined with a NUL byte, which never occurs in text and so acts as an
end-of-document token.

The train/validation split is by document: a stable hash of the document's name decides
membership, so the split does not depend on file order, on ``max_bytes``, or on the machine.

A run that names a tokenizer (:mod:`swarm.training.tokenizer`) reads the same documents as text and
trains on token ids instead (:mod:`swarm.training.tokenized`).
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence, Tuple, Union

import numpy as np
import torch

__all__ = [
    "DOCUMENT_SEPARATOR",
    "DEFAULT_VALIDATION_FRACTION",
    "TEXT_SUFFIXES",
    "JSONL_SUFFIXES",
    "stdlib_source_files",
    "Corpus",
    "load_corpus",
    "load_hf_dataset",
    "BatchSampler",
    "validation_batches",
    "text_documents",
]

DOCUMENT_SEPARATOR = b"\x00"
DEFAULT_VALIDATION_FRACTION = 0.05  # share of documents held out for validation
# Suffixes picked up when walking a directory; a file named explicitly is read whatever its suffix.
TEXT_SUFFIXES = frozenset({".txt", ".py", ".md", ".rst", ".c", ".h", ".cpp", ".rs", ".js", ".ts", ".html", ".tex"})
JSONL_SUFFIXES = frozenset({".jsonl", ".ndjson"})
# Directories of the stdlib that are not library source: third-party packages and the
# (large, partly deliberately malformed) test suites.
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})

PathLike = Union[str, Path]
_Document = tuple[str, bytes]  # (stable name used for the split, content)


def stdlib_source_files() -> list[Path]:
    """The ``.py`` files of this interpreter's standard library, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _STDLIB_SKIP_DIRS]
        files.extend(Path(directory) / name for name in names if name.endswith(".py"))
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


@dataclass
class Corpus:
    """Byte tokens of a train and a validation split, each one contiguous uint8 array."""

    train: np.ndarray  # uint8 byte tokens
    validation: np.ndarray  # uint8 byte tokens, disjoint documents from train

    def __post_init__(self) -> None:
        for name in ("train", "validation"):
            array = getattr(self, name)
            if not isinstance(array, np.ndarray) or array.dtype != np.uint8 or array.ndim != 1:
                raise ValueError(f"{name} must be a 1-D uint8 numpy array")
            if array.size == 0:
                raise ValueError(f"{name} must not be empty")

    def close(self) -> None:
        """Nothing to stop: a byte corpus holds no thread (:class:`TokenizedCorpus` does)."""


def load_corpus(
    paths: Optional[Sequence[PathLike]] = None,
    max_bytes: Optional[int] = None,
    validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
) -> Corpus:
    """Load the stdlib corpus (``paths=None``) or local text / JSONL files and directories.

    JSONL files hold one JSON object per line with a string ``"text"`` field; each line is
    one document. ``max_bytes`` caps the total bytes read, documents taken in order.
    """
    return _split_documents(_documents(paths), max_bytes, validation_fraction)


def _documents(paths: Optional[Sequence[PathLike]]) -> Iterable[_Document]:
    """The stdlib's sources (``paths=None``), or the documents of local files and directories."""
    if paths is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        return ((path.relative_to(root).as_posix(), path.read_bytes()) for path in stdlib_source_files())
    if isinstance(paths, (str, Path)):
        paths = [paths]  # a lone path is an easy mistake; a str is not a list of 1-char paths
    return _local_documents([Path(p) for p in paths])


def text_documents(paths: Optional[Sequence[PathLike]]) -> Iterator[Tuple[str, str]]:
    """(name, text) of each document :func:`load_corpus` would read from ``paths``; bytes that are not
    UTF-8 become U+FFFD, as a tokenizer needs text."""
    for name, content in _documents(paths):
        yield name, content.decode("utf-8", errors="replace")


def load_hf_dataset(
    name_or_path: str,
    split: str = "train",
    text_field: str = "text",
    max_bytes: Optional[int] = None,
) -> Corpus:
    """Load a Hugging Face dataset (a hub name, or a local .json/.jsonl/.txt/.csv/.parquet file).

    Needs the optional extra: ``pip install swarm[hf]``. Our own train/validation split is
    applied to the rows of ``split``, so validation is held out whatever the dataset offers.
    """
    return _split_documents(_hf_documents(name_or_path, split, text_field), max_bytes, DEFAULT_VALIDATION_FRACTION)


def _hf_documents(name_or_path: str, split: str, text_field: str) -> Iterator[_Document]:
    """The rows of a Hugging Face dataset as documents; the dataset is opened (and checked) at once."""
    try:
        import datasets
    except ImportError as error:
        raise ImportError("load_hf_dataset needs the Hugging Face `datasets` package: pip install swarm[hf]") from error
    builders = {".json": "json", ".jsonl": "json", ".txt": "text", ".csv": "csv", ".parquet": "parquet"}
    local = Path(name_or_path)
    if local.is_file():
        if local.suffix not in builders:
            raise ValueError(
                f"name_or_path: unsupported local file type {local.suffix!r}, use one of {sorted(builders)}"
            )
        dataset = datasets.load_dataset(builders[local.suffix], data_files={split: str(local)}, split=split)
    else:
        dataset = datasets.load_dataset(name_or_path, split=split)
    if text_field not in dataset.column_names:
        raise ValueError(
            f"text_field {text_field!r} is not a column of {name_or_path}; columns: {dataset.column_names}"
        )

    def documents() -> Iterator[_Document]:
        for row_index, text in enumerate(dataset[text_field]):
            if not isinstance(text, str):
                raise ValueError(f"{name_or_path}: row {row_index}: {text_field!r} is not a string")
            yield f"{name_or_path}#{row_index}", text.encode("utf-8")

    return documents()


def _local_documents(paths: Sequence[Path]) -> Iterator[_Document]:
    for path in paths:
        if path.is_dir():
            files = sorted(
                (p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES | JSONL_SUFFIXES),
                key=lambda p: p.relative_to(path).as_posix(),
            )
            for file in files:
                yield from _file_documents(file, file.relative_to(path).as_posix())
        elif path.is_file():
            yield from _file_documents(path, path.name)
        else:
            raise FileNotFoundError(f"data path does not exist: {path}")


def _file_documents(path: Path, name: str) -> Iterator[_Document]:
    if path.suffix not in JSONL_SUFFIXES:
        yield name, path.read_bytes()
        return
    with path.open("rb") as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as error:  # also catches undecodable bytes
                raise ValueError(f"{path}: line {line_number}: not valid JSON ({error})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f'{path}: line {line_number}: expected an object with a string "text" field')
            yield f"{name}#{line_number}", record["text"].encode("utf-8")


def _assign_documents(
    documents: Iterable[_Document], max_bytes: Optional[int], validation_fraction: float
) -> dict[bool, list[bytes]]:
    """Cap the documents at ``max_bytes`` and assign each to train (False) or validation (True) by name hash."""
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
        raise ValueError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must be in (0, 1), got {validation_fraction!r}")
    splits: dict[bool, list[bytes]] = {False: [], True: []}
    total = 0
    for name, content in documents:
        if max_bytes is not None:
            content = content[: max_bytes - total]
        if not content:
            continue
        splits[_in_validation(name, validation_fraction)].append(content)
        total += len(content)
        if max_bytes is not None and total >= max_bytes:
            break
    if not splits[False] and not splits[True]:
        raise ValueError("no data: the given paths hold no non-empty documents")
    return splits


def _split_documents(documents: Iterable[_Document], max_bytes: Optional[int], validation_fraction: float) -> Corpus:
    """Byte tokens of the documents, capped at ``max_bytes``, each one followed by the separator."""
    splits = _assign_documents(documents, max_bytes, validation_fraction)
    joined = {
        side: b"".join(part for content in contents for part in (content, DOCUMENT_SEPARATOR))
        for side, contents in splits.items()
    }
    if not splits[False] or not splits[True]:
        # Too few documents for a split by document: split the byte stream instead, so
        # neither side is empty (the last fraction of the stream becomes validation).
        stream = joined[False] or joined[True]
        # every document contributes at least one byte plus its separator, so len(stream) >= 2
        cut = min(len(stream) - 1, max(1, round(len(stream) * (1.0 - validation_fraction))))
        return Corpus(_to_tokens(stream[:cut]), _to_tokens(stream[cut:]))
    return Corpus(_to_tokens(joined[False]), _to_tokens(joined[True]))


def _in_validation(name: str, validation_fraction: float) -> bool:
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < validation_fraction


def _to_tokens(data: bytes) -> np.ndarray:
    # frombuffer over bytes is read-only; copy once so that callers own a writable array
    return np.frombuffer(data, dtype=np.uint8).copy()


def _check_windows(tokens: np.ndarray, seq_len: int, batch_size: int) -> None:
    if not isinstance(tokens, np.ndarray) or tokens.ndim != 1:
        raise ValueError("tokens must be a 1-D numpy array")
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if tokens.size < seq_len + 1:
        raise ValueError(f"tokens: need at least seq_len + 1 = {seq_len + 1} tokens, got {tokens.size}")


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    windows = tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int64)
    return torch.from_numpy(windows[:, :-1].copy()), torch.from_numpy(windows[:, 1:].copy())


class BatchSampler:
    """Draws random windows of seq_len+1 bytes from the train split; each trainer gets its own seed so different trainers draw different samples."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int):
        _check_windows(tokens, seq_len, batch_size)
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self._rng = np.random.default_rng(seed)  # local: never touches numpy's global state

    def sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-byte targets, both int64 [batch_size, seq_len]."""
        starts = self._rng.integers(0, self.tokens.size - self.seq_len, size=self.batch_size)
        return _windows(self.tokens, starts, self.seq_len)


def validation_batches(
    tokens: np.ndarray, seq_len: int, batch_size: int, num_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``num_batches`` fixed batches of windows spaced evenly over ``tokens``.

    Deterministic, so every process that evaluates (the single-process baseline, each
    trainer) measures the same validation loss for the same parameters.
    """
    _check_windows(tokens, seq_len, batch_size)
    if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 1:
        raise ValueError(f"num_batches must be a positive int, got {num_batches!r}")
    last_start = tokens.size - seq_len - 1
    starts = np.linspace(0, last_start, num=batch_size * num_batches).round().astype(np.int64)
    return [_windows(tokens, batch_starts, seq_len) for batch_starts in starts.reshape(num_batches, batch_size)]
