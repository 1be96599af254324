"""What the run has learned: every ``period_s`` the dashboard continues a prompt with the run's live model.

:class:`DashboardSampler` runs as its own task in the dashboard's asyncio loop, beside the poller, so that a
sample (seconds of forwards through every stage) never delays a DHT read. It samples with
:class:`~swarm.client.generate.SwarmGenerator`: plain forwards that no replica accumulates or keeps, so the
run is unchanged by being watched. It takes the run's peers from the poller's latest records instead of
reading the DHT itself, and keeps only the latest :class:`~swarm.dashboard.state.Sample`, a failure
included (a dead stage, a timeout): the next period tries again.

When to sample is a pure decision (:func:`sample_wait_reason`), tested without a network. Every wait is
bounded: each stage call by ``GenerateConfig.forward_timeout_s``, the whole sample by ``timeout_s``, fetching
the tokenizer by :data:`TOKENIZER_FETCH_TIMEOUT_S`.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, List, Mapping, Optional

import torch
from hivemind.p2p import P2P
from hivemind.utils import get_logger

from swarm.client.generate import GenerateConfig, GenerationResult, SwarmGenerator, TextStream, encode_prompt
from swarm.config.settings import RunConfig
from swarm.dashboard.join import JoinInfo
from swarm.dashboard.state import Sample, global_step
from swarm.dht.agreement import same_run
from swarm.dht.manifest import fetch_tokenizer_from, run_hash
from swarm.dht.records import PeerRecord, to_peer_infos
from swarm.training.tokenizer import (
    DEFAULT_CACHE_DIR,
    RunTokenizer,
    TokenizerError,
    find_cached,
    load_run_tokenizer,
    store_cached,
    tokenizer_from_bytes,
)

__all__ = [
    "SampleSettings",
    "DashboardSampler",
    "sample_wait_reason",
    "stages_without_replica",
    "TOKENIZER_FETCH_TIMEOUT_S",
]

logger = get_logger(__name__)
TOKENIZER_FETCH_TIMEOUT_S = 60.0  # seconds to get the run's tokenizer from its organiser (a 10 MB file takes ~1 s)


@dataclass(frozen=True)
class SampleSettings:
    """What to sample and how often: the dashboard's ``sample_*`` and tokenizer options."""

    period_s: float = 180.0  # seconds from the end of one sample to the start of the next; 0 = never sample
    prompt: str = "The"  # the text each sample continues
    num_tokens: int = 48  # tokens each sample generates
    timeout_s: float = 120.0  # seconds one whole sample may take
    temperature: float = 0.8  # softmax temperature of each token's draw
    tokenizer: Optional[str] = None  # the run's tokenizer.json; None = the cache, or the organiser's copy
    tokenizer_cache_dir: str = DEFAULT_CACHE_DIR  # where tokenizers fetched from organisers are kept

    def __post_init__(self) -> None:
        if not 0 <= self.period_s < math.inf:
            raise ValueError(
                f"the sample period must be 0 (off) or a positive number of seconds, got {self.period_s!r}"
            )
        if not self.prompt:
            raise ValueError("the sample prompt must be a non-empty text to continue")
        if isinstance(self.num_tokens, bool) or not isinstance(self.num_tokens, int) or self.num_tokens < 1:
            raise ValueError(f"a sample must generate at least one token, got {self.num_tokens!r}")
        if not 0 < self.timeout_s < math.inf:
            raise ValueError(f"the sample timeout must be a positive number of seconds, got {self.timeout_s!r}")


# ---- when to sample (pure) ----


def stages_without_replica(peers: Mapping[str, PeerRecord], num_stages: int) -> List[int]:
    """The stages of ``0..num_stages-1`` that no online peer serves: a sample would wait for them in vain."""
    served = {p.stage for p in peers.values() if p.state == "online"}
    return [stage for stage in range(num_stages) if stage not in served]


def sample_wait_reason(
    period_s: float,
    run: Optional[RunConfig],
    peers: Mapping[str, PeerRecord],
    last_sample_end: Optional[float],
    now: float,
) -> Optional[str]:
    """Why no sample should start at ``now`` (monotonic seconds), or None when one is due.

    ``peers`` are the records of peers that serve ``run``'s settings; ``last_sample_end`` is when the last
    sample (taken or failed) ended, None before the first: the first is due as soon as it can be taken."""
    if period_s == 0:
        return "sampling is off"
    if run is None:
        return "the run's settings are not known yet"
    if last_sample_end is not None and now - last_sample_end < period_s:
        return f"the next sample is due in {period_s - (now - last_sample_end):.1f} s"
    missing = stages_without_replica(peers, run.num_stages)
    if missing:
        return f"stage {missing[0]} has no online replica"
    return None


# ---- the sampler ----


class DashboardSampler:
    """Samples text from the run's model every ``settings.period_s``; runs in the dashboard's event loop.

    ``join()`` and ``peers()`` give what the poller knows now (the run's settings, its latest peer records);
    ``on_sample`` is called with each new sample, so the page shows it before the next poll. ``p2p()`` gives
    the dashboard's own P2P node (``DHT.replicate_p2p``), used only when a sample is taken."""

    def __init__(
        self,
        settings: SampleSettings,
        p2p: Callable[[], Awaitable[P2P]],
        join: Callable[[], JoinInfo],
        peers: Callable[[], Mapping[str, PeerRecord]],
        on_sample: Callable[[Sample], None] = lambda s: None,
        check_period_s: float = 2.0,
    ):
        self.settings, self.p2p, self.join, self.peers, self.on_sample = settings, p2p, join, peers, on_sample
        self.check_period_s = check_period_s
        self.latest: Optional[Sample] = None
        self.last_sample_end: Optional[float] = None  # monotonic
        self._tokenizer: Optional[RunTokenizer] = None  # loaded once per run tokenizer

    async def step(self) -> Optional[Sample]:
        """Take a sample if one is due; returns it (or None when none was due)."""
        join = self.join()
        run = join.run
        peers = same_run(self.peers(), run_hash(run)) if run is not None else {}
        reason = sample_wait_reason(self.settings.period_s, run, peers, self.last_sample_end, time.monotonic())
        if reason is not None or run is None:
            logger.debug(f"no sample now: {reason}")
            return None
        sample = await self.take(run, peers, join.manifest_address)
        self.latest, self.last_sample_end = sample, time.monotonic()
        if sample.error is None:
            logger.info(
                f"sampled {sample.num_tokens} tokens at step {sample.step} "
                f"({sample.tokens_per_s:.2f} tokens/s): {sample.prompt + sample.text!r}"
            )
        else:
            logger.warning(f"could not sample the run's model: {sample.error}")
        self.on_sample(sample)
        return sample

    async def take(self, run: RunConfig, peers: Mapping[str, PeerRecord], manifest_address: Optional[str]) -> Sample:
        """One sample from the prompt; any failure is in its ``error``, with the text generated before it."""
        step = global_step(peers, run.num_stages)
        pieces: List[str] = []
        try:
            tokenizer = await self._run_tokenizer(run, manifest_address)
            result = await asyncio.wait_for(self._generate(run, tokenizer, pieces), self.settings.timeout_s)
        except asyncio.TimeoutError:
            error = f"no sample within {self.settings.timeout_s:g} s (sample_timeout_s)"
        except TokenizerError as e:
            error = str(e)
        except Exception as e:  # StageUnavailable, p2pd's and the network's own types, a prompt the run cannot encode
            error = f"{type(e).__name__}: {e}"
        else:
            return Sample(
                self.settings.prompt, "".join(pieces), len(result.tokens), step, result.tokens_per_s, time.time()
            )
        return Sample(self.settings.prompt, "".join(pieces), len(pieces), step, None, time.time(), error)

    async def _generate(self, run: RunConfig, tokenizer: Optional[RunTokenizer], pieces: List[str]) -> GenerationResult:
        """Generate into ``pieces`` (one string per token, so that a failure keeps what came before it)."""
        seed = secrets.randbits(63)
        config = GenerateConfig(
            prompt=self.settings.prompt,
            max_new_tokens=self.settings.num_tokens,
            temperature=self.settings.temperature,
            sampling_seed=seed,
            run=run,
        )
        prompt_ids = encode_prompt(config.prompt, tokenizer, run.model.vocab_size)
        snapshot: list = []

        async def refresh() -> None:  # the poller reads the DHT: take its latest records
            snapshot[:] = to_peer_infos(same_run(self.peers(), run_hash(run)), run.num_stages)

        generator = SwarmGenerator(await self.p2p(), config, refresh, lambda: snapshot, seed)
        stream = TextStream(tokenizer)
        result = await generator.generate(
            prompt_ids, torch.Generator().manual_seed(seed), lambda token: pieces.append(stream.push(token))
        )
        if pieces:
            pieces[-1] += stream.flush()
        return result

    async def _run_tokenizer(self, run: RunConfig, manifest_address: Optional[str]) -> Optional[RunTokenizer]:
        """None in a byte-token run; else the run's tokenizer from ``--tokenizer``, the cache, or the organiser
        (then kept in the cache); :class:`TokenizerError` says why there is none."""
        sha256, settings = run.tokenizer_sha256, self.settings
        if not sha256:
            return None
        if self._tokenizer is not None and self._tokenizer.sha256 == sha256:
            return self._tokenizer
        if (
            settings.tokenizer is None
            and manifest_address is not None
            and find_cached(sha256, settings.tokenizer_cache_dir) is None
        ):
            tokenizer = await self._fetch_tokenizer(sha256, manifest_address)
            tokenizer.check_vocab_size(run.model.vocab_size)
        else:  # without a file or a cached copy this raises, saying what to pass
            tokenizer = await asyncio.to_thread(
                load_run_tokenizer, settings.tokenizer, sha256, run.model.vocab_size, settings.tokenizer_cache_dir
            )
        self._tokenizer = tokenizer
        return tokenizer

    async def _fetch_tokenizer(self, sha256: str, address: str) -> RunTokenizer:
        try:
            data = await fetch_tokenizer_from(await self.p2p(), address, sha256, TOKENIZER_FETCH_TIMEOUT_S)
        except TokenizerError:  # the organiser's file is not the one its manifest names
            raise
        except Exception as e:  # p2pd, the network and the reply's checks each raise their own types
            raise TokenizerError(
                f"cannot get the run's tokenizer {sha256} from {address}: {type(e).__name__}: {e}"
            ) from None
        tokenizer = await asyncio.to_thread(tokenizer_from_bytes, data, f"{sha256} from {address}")
        try:
            store_cached(data, sha256, self.settings.tokenizer_cache_dir)
        except TokenizerError as e:  # a read-only cache: the dashboard keeps its copy in memory
            logger.warning(f"{e}; the dashboard keeps the tokenizer in memory only")
        return tokenizer

    async def run(self, stop: asyncio.Event) -> None:
        """Sample whenever one is due, until ``stop`` is set; checks every ``check_period_s``."""
        if self.settings.period_s == 0:
            return
        while not stop.is_set():
            await self.step()
            try:
                await asyncio.wait_for(stop.wait(), self.check_period_s)
            except asyncio.TimeoutError:
                pass
