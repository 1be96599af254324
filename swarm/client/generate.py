"""Generate text with a live run's model: each new token is one forward through every stage of the swarm.

For each token the client sends the current window (the last ``seq_len`` tokens of prompt and output) through
the stages with plain forwards, which no replica accumulates or keeps (no micro-batch id), and asks the last
stage for its logits at the window's last position only (``logits: true``, see :mod:`swarm.server.handlers`).
There is no KV cache across peers: every token recomputes the whole window on every stage, because the
replicas that serve consecutive tokens may differ, and a cache on one replica would bind the client to it.
Calls are routed and retried as a trainer's are (:class:`~swarm.client.pipeline.PipelineClient`: throughput
routing, bans with backoff, another replica after a failure).

Sampling (:func:`sample_token`) and decoding as text arrives (:class:`TextStream`) are pure and local.
"""

from __future__ import annotations

import codecs
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence

import torch
from hivemind.p2p import P2P

from swarm.client.ledger import Ledger, LedgerPolicy
from swarm.client.pipeline import PipelineClient
from swarm.config.settings import NetworkConfig, RunConfig
from swarm.policy.routing import Router
from swarm.policy.snapshot import PeerInfo
from swarm.training.tokenizer import DEFAULT_CACHE_DIR, RunTokenizer

__all__ = [
    "GenerateConfig",
    "GenerationResult",
    "sample_token",
    "context_window",
    "TextStream",
    "encode_prompt",
    "SwarmGenerator",
]


@dataclass
class GenerateConfig:
    """``swarm generate``: the prompt, how to sample, and how long calls may take."""

    prompt: str = ""  # text to continue
    max_new_tokens: int = 64  # tokens to generate
    temperature: float = 0.8  # softmax temperature; 0 = always the most likely token (greedy)
    top_k: int = 50  # sample among the k most likely tokens; 0 = the whole vocabulary
    sampling_seed: Optional[int] = None  # seeds the sampler, for repeatable output; None = a fresh seed
    forward_timeout_s: float = 30.0  # seconds one stage call may take
    max_retries: int = 8  # attempts per stage call before generation fails
    refresh_period_s: float = 2.0  # seconds between reads of the swarm's peers while generating
    tokenizer: Optional[str] = field(
        default=None,
        metadata={
            "help": (
                "the run's tokenizer.json (its SHA-256 must equal run.tokenizer_sha256); None = the cached copy, fetched "
                "from the organiser with --join"
            )
        },
    )
    tokenizer_cache_dir: str = DEFAULT_CACHE_DIR  # where tokenizers fetched from organisers are kept
    run: RunConfig = field(default_factory=RunConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("prompt must be a non-empty text to continue (--prompt TEXT)")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be 0 (greedy) or positive, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer (0 = no limit), got {self.top_k!r}")
        if self.max_retries < 1:
            raise ValueError(f"max_retries must be at least 1, got {self.max_retries}")
        for name in ("forward_timeout_s", "refresh_period_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.tokenizer is not None and not self.run.tokenizer_sha256:
            raise ValueError(f"tokenizer {self.tokenizer} is given, but the run uses byte tokens")


@dataclass(frozen=True)
class GenerationResult:
    """The new tokens and the seconds they took (from the first call to the last reply)."""

    tokens: List[int]
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


# ---- local decisions (pure) ----


def sample_token(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    """The next token from one row of logits [vocab]: the most likely with ``temperature`` 0, else a draw from
    the softmax of ``logits / temperature`` over the ``top_k`` most likely tokens (0: all of them)."""
    if logits.ndim != 1 or logits.numel() == 0:
        raise ValueError(f"logits must be one non-empty row, got shape {tuple(logits.shape)}")
    if temperature == 0:
        return int(torch.argmax(logits))
    scaled = logits.double() / temperature
    if 0 < top_k < scaled.numel():
        threshold = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
    return int(torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=generator))


def context_window(tokens: Sequence[int], seq_len: int) -> List[int]:
    """The last ``seq_len`` tokens: the most a stage takes, and all a model of that length can attend to."""
    return list(tokens[-seq_len:])


class TextStream:
    """Turns tokens into text as they arrive, holding back what is not a whole character yet (a byte token
    may be half of a UTF-8 character; a BPE token may be part of one)."""

    def __init__(self, tokenizer: Optional[RunTokenizer] = None):
        self.tokenizer = tokenizer
        self._bytes = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: List[int] = []
        self._shown = 0  # characters of the decoded ids already returned

    def push(self, token: int) -> str:
        """The text that ``token`` completes (possibly empty)."""
        if self.tokenizer is None:
            return self._bytes.decode(bytes([token]))
        self._ids.append(token)
        text = self.tokenizer.tokenizer.decode(self._ids, skip_special_tokens=False)
        if text.endswith("\ufffd"):  # part of a character: wait for the rest
            return ""
        new, self._shown = text[self._shown :], len(text)
        return new

    def flush(self) -> str:
        """Whatever is held back at the end."""
        if self.tokenizer is None:
            return self._bytes.decode(b"", final=True)
        text = self.tokenizer.tokenizer.decode(self._ids, skip_special_tokens=False)
        new, self._shown = text[self._shown :], len(text)
        return new


def encode_prompt(prompt: str, tokenizer: Optional[RunTokenizer], vocab_size: int) -> List[int]:
    """The prompt's token ids: its UTF-8 bytes in a byte-token run, else the run's tokenizer's ids."""
    ids = (
        list(prompt.encode("utf-8"))
        if tokenizer is None
        else tokenizer.tokenizer.encode(prompt, add_special_tokens=False).ids
    )
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    if max(ids) >= vocab_size:
        raise ValueError(f"the prompt has token ids up to {max(ids)}, outside the model's vocabulary of {vocab_size}")
    return ids


# ---- the swarm ----


class SwarmGenerator:
    """Runs in the caller's event loop: ``snapshot`` gives the run's peers now (refreshed by ``refresh``),
    and each token is a forward through every stage."""

    def __init__(
        self,
        p2p: P2P,
        config: GenerateConfig,
        refresh: Callable[[], Any],
        snapshot: Callable[[], Sequence[PeerInfo]],
        seed: int,
    ):
        run = config.run
        self.config, self.run, self.refresh = config, run, refresh
        self._stale = True
        self.client = PipelineClient(
            p2p,
            run.num_stages,
            snapshot,
            Router(seed=seed),
            Ledger(LedgerPolicy()),
            model=run.model,
            forward_timeout_s=config.forward_timeout_s,
            backward_timeout_s=config.forward_timeout_s,
            max_retries=config.max_retries,
            on_stale_snapshot=self._mark_stale,
            compression=run.compression,
            block_size=run.compression_block_size,
        )
        self._refreshed_at = float("-inf")

    def _mark_stale(self, stage: int) -> None:
        self._stale = True  # a generator reads every stage at once: which one failed does not narrow the read

    async def _maybe_refresh(self) -> None:
        now = time.monotonic()
        if self._stale or now - self._refreshed_at >= self.config.refresh_period_s:
            await self.refresh()
            self._stale, self._refreshed_at = False, now

    async def next_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        """The logits [vocab] of the token after ``tokens`` (their last ``seq_len``), computed by the swarm."""
        await self._maybe_refresh()
        x = torch.tensor([context_window(tokens, self.run.model.seq_len)], dtype=torch.long)
        for stage in range(self.run.num_stages - 1):
            reply, _ = await self.client.call_stage(stage, "forward", {"inputs": x}, self.config.forward_timeout_s)
            x = reply["outputs"]
        reply, _ = await self.client.call_stage(
            self.run.num_stages - 1, "forward", {"inputs": x, "logits": True}, self.config.forward_timeout_s
        )
        return reply["logits"][0]

    async def generate(
        self,
        prompt_ids: Sequence[int],
        generator: torch.Generator,
        on_token: Callable[[int], None] = lambda token: None,
    ) -> GenerationResult:
        """``max_new_tokens`` tokens after ``prompt_ids``; ``on_token`` sees each as it is sampled."""
        tokens, new = list(prompt_ids), []
        started = time.monotonic()
        for _ in range(self.config.max_new_tokens):
            logits = await self.next_logits(tokens)
            token = sample_token(logits, self.config.temperature, self.config.top_k, generator)
            tokens.append(token)
            new.append(token)
            on_token(token)
        return GenerationResult(new, time.monotonic() - started)
