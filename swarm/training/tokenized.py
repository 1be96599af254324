"""Token ids of a run's tokenizer, encoded ahead of the trainer.

A run that names a tokenizer (:mod:`swarm.training.tokenizer`) reads the documents :mod:`swarm.training.data`
reads, as text, and trains on token ids: a :class:`TokenizedCorpus` encodes them in batches in a background
thread (the tokenizers library releases the GIL while it encodes), ahead of the trainer, into a bounded queue
of samples, so that a trainer never waits for text while its pipeline idles. :func:`make_sampler` picks the
sampler for either kind of corpus.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple, TypedDict, Union

import numpy as np
import torch

from swarm.training.data import (
    DEFAULT_VALIDATION_FRACTION,
    BatchSampler,
    Corpus,
    PathLike,
    _assign_documents,
    _documents,
    _hf_documents,
)

if TYPE_CHECKING:
    from swarm.training.tokenizer import RunTokenizer

__all__ = ["TokenizedCorpus", "TokenizedSampler", "make_sampler", "load_tokenized_corpus"]

QUEUE_SAMPLES = 1024  # samples a TokenizedCorpus encodes ahead of the trainer, at most
SAMPLE_TIMEOUT_S = 60.0  # seconds next_sample() waits for the tokenizing thread before it gives up
_POLL_S = 0.1  # seconds between the tokenizing thread's checks of whether it is asked to stop


def _positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class _Encoding(TypedDict, total=False):
    """How a :class:`RunTokenizer` batches and cuts the text (``encode_documents``); a key left out takes its default."""

    batch_chars: int
    piece_chars: int


class TokenizedCorpus:
    """Token-id samples of a run's tokenizer, encoded ahead of the trainer by a background thread.

    The thread (a daemon named ``tokenized-corpus``) walks the train documents in a new seeded order
    each epoch, encodes them a batch at a time (:meth:`RunTokenizer.encode_documents`: the library
    releases the GIL meanwhile), ends each document with the tokenizer's separator token, cuts the stream into
    samples of ``seq_len + 1`` ids (inputs and their next-token targets, as the byte sampler draws them)
    that overlap by one id, so that each token is a target once per epoch. Samples wait in a queue of at
    most ``queue_samples``: the thread stays that far ahead and no further, and :meth:`next_sample` blocks
    only when the trainer outruns it. :meth:`close` stops the thread.

    ``validation`` holds the validation documents' ids as one array, encoded on first use, which
    :func:`validation_batches` reads as it reads a byte corpus's.
    """

    def __init__(
        self,
        train_texts: Sequence[str],
        validation_texts: Sequence[str],
        tokenizer: "RunTokenizer",
        seq_len: int,
        seed: int,
        *,
        shuffle: bool = True,
        queue_samples: int = QUEUE_SAMPLES,
        sample_timeout_s: float = SAMPLE_TIMEOUT_S,
        batch_chars: Optional[int] = None,
        piece_chars: Optional[int] = None,
    ):
        _positive_int("seq_len", seq_len)
        _positive_int("queue_samples", queue_samples)
        if not sample_timeout_s > 0:
            raise ValueError(f"sample_timeout_s must be positive, got {sample_timeout_s!r}")
        self._train = [text for text in train_texts if text]
        if not self._train:
            raise ValueError("train_texts: need at least one non-empty document")
        self._validation_texts = [text for text in validation_texts if text]
        self.tokenizer, self.seq_len, self.seed, self.shuffle = tokenizer, seq_len, seed, shuffle
        self.sample_timeout_s = sample_timeout_s
        # how the tokenizer batches and cuts the text (None: its defaults)
        self._encoding = _Encoding()
        if batch_chars is not None:
            self._encoding["batch_chars"] = batch_chars
        if piece_chars is not None:
            self._encoding["piece_chars"] = piece_chars
        self.epoch = 0  # epochs of the train documents the thread has finished
        self._validation: Optional[np.ndarray] = None
        self._validation_lock = threading.Lock()
        self._queue: "queue.Queue[np.ndarray]" = queue.Queue(maxsize=queue_samples)
        self._stop = threading.Event()
        self._ready = threading.Event()  # set by the first queued sample, or by the thread's end
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="tokenized-corpus", daemon=True)
        self._thread.start()

    # ---- the tokenizing thread ----

    def _run(self) -> None:
        try:
            self._produce()
        except BaseException as e:  # kept for the trainer's thread, which raises it with the reason
            self._error = e
        finally:
            self._ready.set()

    def _produce(self) -> None:
        rng = np.random.default_rng(self.seed)  # local: never touches numpy's global state
        carry: Optional[np.ndarray] = np.empty(0, dtype=np.int32)  # the stream's tail, not yet a whole sample
        while not self._stop.is_set():
            order = rng.permutation(len(self._train)) if self.shuffle else range(len(self._train))
            epoch_tokens = 0
            for ids in self.tokenizer.encode_documents(self._train, order, **self._encoding):
                if self._stop.is_set():
                    return
                epoch_tokens += ids.size
                carry = self._emit(np.concatenate([carry, ids]))
                if carry is None:
                    return
            if epoch_tokens < self.seq_len + 1:
                raise ValueError(
                    f"the train documents hold {epoch_tokens} tokens: need at least seq_len + 1 = {self.seq_len + 1}"
                )
            self.epoch += 1

    def _emit(self, stream: np.ndarray) -> Optional[np.ndarray]:
        """Queue every whole sample of ``stream``; returns the rest (None once asked to stop)."""
        count = max(0, (stream.size - 1) // self.seq_len)
        for index in range(count):
            start = index * self.seq_len
            if not self._put(stream[start : start + self.seq_len + 1].copy()):
                return None
        return stream[count * self.seq_len :]

    def _put(self, sample: np.ndarray) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(sample, timeout=_POLL_S)
            except queue.Full:
                continue
            self._ready.set()
            return True
        return False

    # ---- the trainer's side ----

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(
                f"tokenizing the corpus failed: {type(self._error).__name__}: {self._error}"
            ) from self._error
        if self._stop.is_set():
            raise RuntimeError("the tokenized corpus is closed")

    def wait_ready(self, timeout: float) -> None:
        """Wait until the first sample is queued; raises the thread's error, or TimeoutError after ``timeout`` s."""
        if not self._ready.wait(timeout):
            raise TimeoutError(f"no sample tokenized within {timeout} s")
        if self._queue.empty():
            self._raise_if_failed()

    def next_sample(self) -> np.ndarray:
        """The next sample, int32 [seq_len + 1]. Blocks only while the thread is behind, at most
        ``sample_timeout_s``; raises if the thread failed or the corpus is closed."""
        deadline = time.monotonic() + self.sample_timeout_s
        while True:
            try:
                return self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                pass
            self._raise_if_failed()
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the tokenizing thread produced no sample within {self.sample_timeout_s} s")

    @property
    def validation(self) -> np.ndarray:
        """The validation documents' ids, each document followed by the separator (int32)."""
        with self._validation_lock:
            if self._validation is None:
                self._validation = np.concatenate(
                    [
                        np.empty(0, dtype=np.int32),
                        *self.tokenizer.encode_documents(self._validation_texts, **self._encoding),
                    ]
                )
            return self._validation

    @property
    def running(self) -> bool:
        """Whether the tokenizing thread is alive."""
        return self._thread.is_alive()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the tokenizing thread (it ends the encoding call it is in) and drop the queued samples."""
        self._stop.set()
        self._thread.join(timeout)
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break

    def __enter__(self) -> "TokenizedCorpus":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class TokenizedSampler:
    """Batches of a :class:`TokenizedCorpus`'s samples, in the form :class:`BatchSampler` gives them.
    Which samples come is seeded when the corpus is made; called from one thread."""

    def __init__(self, corpus: TokenizedCorpus, batch_size: int):
        _positive_int("batch_size", batch_size)
        self.corpus, self.seq_len, self.batch_size = corpus, corpus.seq_len, batch_size

    def sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, both int64 [batch_size, seq_len]."""
        windows = np.stack([self.corpus.next_sample() for _ in range(self.batch_size)]).astype(np.int64)
        return torch.from_numpy(windows[:, :-1].copy()), torch.from_numpy(windows[:, 1:].copy())


def make_sampler(
    corpus: Union[Corpus, TokenizedCorpus], seq_len: int, batch_size: int, seed: int
) -> Union[BatchSampler, TokenizedSampler]:
    """The sampler a trainer draws micro-batches from: random byte windows of a :class:`Corpus` (seeded by
    ``seed``), or the queued samples of a :class:`TokenizedCorpus` (seeded when it was made)."""
    if isinstance(corpus, TokenizedCorpus):
        if corpus.seq_len != seq_len:
            raise ValueError(
                f"the tokenized corpus cuts samples of seq_len {corpus.seq_len}, the model needs {seq_len}"
            )
        return TokenizedSampler(corpus, batch_size)
    return BatchSampler(corpus.train, seq_len, batch_size, seed)


def _cut_texts(texts: Sequence[str], validation_fraction: float) -> Tuple[List[str], List[str]]:
    """Too few documents for a split by document: the last fraction of the text becomes validation."""
    total = sum(len(text) for text in texts)
    if total < 2:
        raise ValueError(f"no data: {total} character(s) of text cannot make a train and a validation split")
    cut = min(total - 1, max(1, round(total * (1.0 - validation_fraction))))
    train: List[str] = []
    validation: List[str] = []
    seen = 0
    for text in texts:
        if seen + len(text) <= cut:
            train.append(text)
        elif seen >= cut:
            validation.append(text)
        else:
            train.append(text[: cut - seen])
            validation.append(text[cut - seen :])
        seen += len(text)
    return train, validation


def load_tokenized_corpus(
    tokenizer: "RunTokenizer",
    seq_len: int,
    seed: int,
    paths: Optional[Sequence[PathLike]] = None,
    *,
    hf_dataset: Optional[str] = None,
    max_bytes: Optional[int] = None,
    validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
    **options: object,
) -> TokenizedCorpus:
    """The documents :func:`load_corpus` (or, with ``hf_dataset``, :func:`load_hf_dataset`) would read, split
    the same way, as a started :class:`TokenizedCorpus` (``options`` go to it) that has queued its first
    sample: a corpus too small for one sample fails here, not in the trainer's first step."""
    documents = _hf_documents(hf_dataset, "train", "text") if hf_dataset else _documents(paths)
    splits = _assign_documents(documents, max_bytes, validation_fraction)
    texts = {
        side: [content.decode("utf-8", errors="replace") for content in contents] for side, contents in splits.items()
    }
    del splits
    if not texts[False] or not texts[True]:
        texts[False], texts[True] = _cut_texts(texts[False] or texts[True], validation_fraction)
    corpus = TokenizedCorpus(texts[False], texts[True], tokenizer, seq_len, seed, **options)  # type: ignore[arg-type]
    try:
        corpus.wait_ready(corpus.sample_timeout_s)
    except BaseException:
        corpus.close()
        raise
    return corpus
