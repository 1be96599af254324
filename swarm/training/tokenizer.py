"""A run's tokenizer: byte-level BPE from Hugging Face ``tokenizers``, named by the SHA-256 of its file.

A run that sets ``tokenizer_sha256`` trains on the token ids of one ``tokenizer.json``. The hash of
the file's bytes names it in the organiser's signed manifest, so every copy a trainer uses (fetched
from the organiser, cached on disk, or given locally) is checked byte for byte before it encodes a
word, and the run's model must have exactly as many embedding rows as the tokenizer has tokens.
A run without one trains on raw bytes (:mod:`swarm.training.data`), as before.

Documents are joined with the special token :data:`DOCUMENT_SEPARATOR_TOKEN`, the counterpart of the
byte corpus's NUL byte. Text that happens to spell that token is encoded as ordinary text, so only
the corpus ever inserts the separator.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from swarm.training.data import text_documents

__all__ = [
    "DOCUMENT_SEPARATOR_TOKEN",
    "SPECIAL_TOKENS",
    "MIN_VOCAB_SIZE",
    "MAX_TOKENIZER_BYTES",
    "DEFAULT_CACHE_DIR",
    "ENCODE_BATCH_CHARS",
    "PIECE_CHARS",
    "TokenizerError",
    "RunTokenizer",
    "split_text",
    "is_sha256",
    "sha256_of_bytes",
    "file_sha256",
    "check_sha256",
    "read_tokenizer_file",
    "tokenizer_from_bytes",
    "load_tokenizer",
    "train_tokenizer",
    "cached_path",
    "find_cached",
    "store_cached",
    "load_run_tokenizer",
]

DOCUMENT_SEPARATOR_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (DOCUMENT_SEPARATOR_TOKEN,)
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # every byte has a token, plus the special tokens
MAX_TOKENIZER_BYTES = 64 * 2**20  # largest tokenizer.json accepted (bytes); a 128k-token BPE takes about 10 MB
MIN_MERGE_FREQUENCY = 2  # occurrences a pair needs to become a merge: a pair seen once is noise
DEFAULT_CACHE_DIR = "~/.cache/swarm/tokenizers"
ENCODE_BATCH_CHARS = 2**18  # characters of text handed to the library per encoding call: a fraction of a second
PIECE_CHARS = 2**20  # a longer document is encoded in pieces of about this many characters
_SHA256 = re.compile(r"^[0-9a-f]{64}$")

PathLike = Union[str, Path]


class TokenizerError(ValueError):
    """A tokenizer that cannot be used for this run; the message says why and names the file."""


@dataclass(frozen=True)
class RunTokenizer:
    """A loaded tokenizer and what a run checks about it.

    :meth:`encode_batch` may be called from any thread, and from several at once: the library
    releases the GIL while it encodes, so a background thread tokenizing does not stall the trainer."""

    tokenizer: Tokenizer
    sha256: str  # of the tokenizer.json bytes it was loaded from
    vocab_size: int  # token ids run over 0..vocab_size-1
    separator_id: int  # id of DOCUMENT_SEPARATOR_TOKEN
    source: str  # where it came from, for messages

    def encode_batch(self, texts: Sequence[str]) -> List[np.ndarray]:
        """The int32 token ids of each text, with no special tokens added."""
        encodings = self.tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.asarray(encoding.ids, dtype=np.int32) for encoding in encodings]

    def encode_documents(
        self,
        texts: Sequence[str],
        order: Optional[Iterable[int]] = None,
        *,
        batch_chars: int = ENCODE_BATCH_CHARS,
        piece_chars: int = PIECE_CHARS,
    ) -> Iterator[np.ndarray]:
        """The ids of ``texts`` (in ``order``, by default as given), each document followed by the separator:
        one int32 array per encoding call of about ``batch_chars`` characters, so that a caller can use the
        first ids before the last document is read. Long documents go in pieces (:func:`split_text`)."""
        separator = np.array([self.separator_id], dtype=np.int32)
        for batch in _batches(texts, range(len(texts)) if order is None else order, batch_chars, piece_chars):
            parts: List[np.ndarray] = []
            for (_, ends_document), ids in zip(batch, self.encode_batch([piece for piece, _ in batch])):
                parts.append(ids)
                if ends_document:
                    parts.append(separator)
            yield np.concatenate(parts)

    def check_vocab_size(self, model_vocab_size: int) -> None:
        """Raise :class:`TokenizerError` unless the model has exactly one embedding row per token."""
        if model_vocab_size != self.vocab_size:
            raise TokenizerError(
                f"the run's model has vocab_size {model_vocab_size}, but the tokenizer {self.source} "
                f"(SHA-256 {self.sha256}) has {self.vocab_size} tokens: set the run's vocab_size to "
                f"{self.vocab_size}"
            )


def split_text(text: str, piece_chars: int = PIECE_CHARS) -> List[str]:
    """``text`` in pieces of at most ``piece_chars`` characters, cut where the encoding does not change.

    A cut goes just after a newline with a non-space character on either side: byte-level BPE's
    pre-tokenizer never joins the two sides of such a newline, so the pieces encode to the ids of the
    whole text. A stretch of ``piece_chars`` without one is cut where it ends (the ids near that cut
    may then differ from the whole text's)."""
    if isinstance(piece_chars, bool) or not isinstance(piece_chars, int) or piece_chars < 1:
        raise ValueError(f"piece_chars must be a positive int, got {piece_chars!r}")
    pieces, start = [], 0
    while len(text) - start > piece_chars:
        end = cut = start + piece_chars
        while True:
            newline = text.rfind("\n", start + 1, cut)
            if newline < 0:
                cut = end
                break
            if not text[newline - 1].isspace() and not text[newline + 1].isspace():
                cut = newline + 1
                break
            cut = newline
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def _batches(
    texts: Sequence[str], order: Iterable[int], batch_chars: int, piece_chars: int
) -> Iterator[List[Tuple[str, bool]]]:
    """The texts in ``order`` as batches of (piece, whether it ends its document) of at most
    ``batch_chars`` characters (a longer piece goes alone)."""
    if isinstance(batch_chars, bool) or not isinstance(batch_chars, int) or batch_chars < 1:
        raise ValueError(f"batch_chars must be a positive int, got {batch_chars!r}")
    batch: List[Tuple[str, bool]] = []
    size = 0
    for index in order:
        pieces = split_text(texts[index], piece_chars)
        for number, piece in enumerate(pieces):
            if batch and size + len(piece) > batch_chars:
                yield batch
                batch, size = [], 0
            batch.append((piece, number == len(pieces) - 1))
            size += len(piece)
    if batch:
        yield batch


def is_sha256(value: object) -> bool:
    """Whether ``value`` is a SHA-256 digest as this module writes them: 64 lowercase hex characters."""
    return isinstance(value, str) and bool(_SHA256.match(value))


def sha256_of_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: PathLike) -> str:
    """The SHA-256 of the bytes of the file at ``path`` (the name a run gives its tokenizer)."""
    return sha256_of_bytes(read_tokenizer_file(path))


def check_sha256(actual: str, expected: str, source: str) -> None:
    """Raise :class:`TokenizerError` naming both hashes if a tokenizer is not the one the run names."""
    if actual != expected:
        raise TokenizerError(
            f"the tokenizer {source} has SHA-256 {actual}, but the run names {expected}: "
            f"refusing it (another file, or a changed or damaged copy)"
        )


def read_tokenizer_file(path: PathLike) -> bytes:
    """The bytes of a tokenizer.json, refusing a missing file and one above :data:`MAX_TOKENIZER_BYTES`."""
    path = Path(path).expanduser()
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise TokenizerError(f"the tokenizer {path} is not a file")
        if size > MAX_TOKENIZER_BYTES:
            raise TokenizerError(f"the tokenizer {path} has {size} bytes, more than the {MAX_TOKENIZER_BYTES} accepted")
        return path.read_bytes()
    except FileNotFoundError:
        raise TokenizerError(f"the tokenizer file {path} does not exist") from None
    except OSError as e:
        raise TokenizerError(f"cannot read the tokenizer {path}: {e}") from None


def tokenizer_from_bytes(data: bytes, source: str) -> RunTokenizer:
    """Parse the bytes of a tokenizer.json; :class:`TokenizerError` if they are no tokenizer a run can use."""
    if len(data) > MAX_TOKENIZER_BYTES:
        raise TokenizerError(
            f"the tokenizer {source} has {len(data)} bytes, more than the {MAX_TOKENIZER_BYTES} accepted"
        )
    try:
        tokenizer = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # UnicodeDecodeError, and the library's own untyped Exception for a bad file
        raise TokenizerError(f"{source} is not a tokenizer.json: {e}") from None
    separator_id = tokenizer.token_to_id(DOCUMENT_SEPARATOR_TOKEN)
    if separator_id is None:
        raise TokenizerError(
            f"the tokenizer {source} has no {DOCUMENT_SEPARATOR_TOKEN} token to separate documents with"
        )
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    if max(tokenizer.get_vocab(with_added_tokens=True).values()) != vocab_size - 1:
        raise TokenizerError(
            f"the tokenizer {source} leaves gaps in its token ids: a model needs ids 0..{vocab_size - 1}"
        )
    # the text's own spelling of a special token stays text: only the corpus inserts separators
    tokenizer.encode_special_tokens = True
    return RunTokenizer(tokenizer, sha256_of_bytes(data), vocab_size, separator_id, source)


def load_tokenizer(
    path: PathLike, expected_sha256: Optional[str] = None, vocab_size: Optional[int] = None
) -> RunTokenizer:
    """The tokenizer in the file at ``path``, checked against the run's hash and model vocabulary when given."""
    tokenizer = tokenizer_from_bytes(read_tokenizer_file(path), str(path))
    if expected_sha256 is not None:
        check_sha256(tokenizer.sha256, expected_sha256, str(path))
    if vocab_size is not None:
        tokenizer.check_vocab_size(vocab_size)
    return tokenizer


# ---- training ----


def _check_training_args(paths: Sequence[PathLike], vocab_size: int, out_path: Path) -> None:
    """Refuse bad input before spending minutes on training."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
        raise TokenizerError(
            f"vocab_size must be an integer of at least {MIN_VOCAB_SIZE} (256 bytes + "
            f"{len(SPECIAL_TOKENS)} special token), got {vocab_size!r}"
        )
    if not paths:
        raise TokenizerError("no data to train on: name at least one text file or directory")
    for path in paths:
        if not Path(path).exists():
            raise TokenizerError(f"data path does not exist: {path}")
    if out_path.is_dir():
        raise TokenizerError(f"cannot write the tokenizer to {out_path}: it is a directory")
    parent = out_path.parent
    if not parent.is_dir():
        raise TokenizerError(f"cannot write the tokenizer to {out_path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise TokenizerError(f"cannot write the tokenizer to {out_path}: the directory {parent} is not writable")


class _Texts:
    """The documents' texts for the trainer: counts what it hands out, and keeps any error for the caller
    (the library runs the iterator from its own code, which would blur the reason)."""

    def __init__(self, paths: Sequence[PathLike]):
        self.paths, self.num_chars = paths, 0
        self.error: Optional[Exception] = None  # why reading the documents stopped, if it did

    def __iter__(self) -> Iterator[str]:
        try:
            for _, text in text_documents(self.paths):
                self.num_chars += len(text)
                yield text
        except (OSError, ValueError) as e:
            self.error = e


def _new_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    # no prefix space: a document's first word encodes as the text says, and pieces of it encode alike
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_tokenizer(files: Iterable[PathLike], vocab_size: int, out_path: PathLike) -> RunTokenizer:
    """Train a byte-level BPE of at most ``vocab_size`` tokens on local text/JSONL files or directories
    (read as :func:`swarm.training.data.text_documents` reads a trainer's ``--data``), write it to
    ``out_path`` (atomically: readers never see half a file) and return it as loaded from there.

    The vocabulary comes out smaller than ``vocab_size`` when the text holds too few pairs seen at
    least :data:`MIN_MERGE_FREQUENCY` times; the returned tokenizer's ``vocab_size`` is the real one."""
    paths = [Path(p) for p in ([files] if isinstance(files, (str, Path)) else files)]
    out = Path(out_path).expanduser()
    _check_training_args(paths, vocab_size, out)
    tokenizer = _new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=MIN_MERGE_FREQUENCY,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = _Texts(paths)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if texts.error is not None:
        raise TokenizerError(f"cannot read the data: {texts.error}") from texts.error
    if texts.num_chars == 0:
        raise TokenizerError(f"no text to train on in {', '.join(map(str, paths))}")
    data = tokenizer.to_str().encode("utf-8")
    _write_atomically(out, data)
    return tokenizer_from_bytes(data, str(out))


def _write_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_bytes(data)
        os.replace(temporary, path)
    except OSError as e:
        temporary.unlink(missing_ok=True)
        raise TokenizerError(f"cannot write the tokenizer to {path}: {e}") from None


# ---- the cache of fetched tokenizers, one file per hash ----


def cached_path(sha256: str, cache_dir: PathLike) -> Path:
    if not is_sha256(sha256):
        raise TokenizerError(f"a tokenizer hash must be 64 lowercase hex characters, got {sha256!r}")
    return Path(cache_dir).expanduser() / f"{sha256}.json"


def find_cached(sha256: str, cache_dir: PathLike) -> Optional[Path]:
    """The cached file of the tokenizer ``sha256``, if there is one whose bytes still have that hash."""
    path = cached_path(sha256, cache_dir)
    try:
        return path if path.is_file() and file_sha256(path) == sha256 else None
    except TokenizerError:  # unreadable or oversized: as good as absent, and overwritten by the next fetch
        return None


def store_cached(data: bytes, sha256: str, cache_dir: PathLike) -> Path:
    """Keep ``data`` (the tokenizer ``sha256``, checked here again) in the cache; returns its path."""
    check_sha256(sha256_of_bytes(data), sha256, "to cache")
    path = cached_path(sha256, cache_dir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TokenizerError(f"cannot create the tokenizer cache {path.parent}: {e}") from None
    _write_atomically(path, data)
    return path


def load_run_tokenizer(path: Optional[PathLike], sha256: str, vocab_size: int, cache_dir: PathLike) -> RunTokenizer:
    """The run's tokenizer ``sha256`` from ``path``, or else from the cache, checked against the hash and the
    model's ``vocab_size``; :class:`TokenizerError` says what to do when there is none."""
    if path is None:
        path = find_cached(sha256, cache_dir)
        if path is None:
            raise TokenizerError(
                f"the run uses the tokenizer {sha256}, which is not in the cache {cache_dir}: "
                f"give its file with --tokenizer PATH, or join with --join ADDRESS to fetch it "
                f"from the organiser"
            )
    return load_tokenizer(path, sha256, vocab_size)
