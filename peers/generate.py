"""``swarm generate``: continue a prompt with a live run's model, one forward through every stage per token.

There is no KV cache across peers: each token recomputes the window of the last ``seq_len`` tokens on every
stage (see :mod:`swarm.client.generate`). Prints the text as it is generated, then the tokens per second."""

from __future__ import annotations

import asyncio
import secrets
from typing import Optional, Sequence, Tuple

import torch

from peers._common import emit, fail, fetch_tokenizer_or_exit, load_role_config, setup_logging
from swarm.client.generate import GenerateConfig, GenerationResult, SwarmGenerator, TextStream, encode_prompt
from swarm.training.tokenizer import RunTokenizer


def run_tokenizer(config: GenerateConfig, joined: bool) -> Optional[RunTokenizer]:
    """The run's tokenizer (``--tokenizer``, the cache, or with --join fetched from the organiser), or None in a
    byte-token run; ValueError if it is missing or not the run's."""
    from swarm.training.tokenizer import load_run_tokenizer

    sha256 = config.run.tokenizer_sha256
    if not sha256:
        return None
    path = config.tokenizer
    if path is None and joined:
        path = fetch_tokenizer_or_exit(config.network.initial_peers[0], sha256, config.tokenizer_cache_dir)
    return load_run_tokenizer(path, sha256, config.run.model.vocab_size, config.tokenizer_cache_dir)


async def generate(config: GenerateConfig, tokenizer: Optional[RunTokenizer]) -> Tuple[GenerationResult, str]:
    """Generate, printing text as it comes; returns the result and the whole generated text."""
    from swarm.client.export import read_run_records
    from swarm.dht.node import start_run_dht, stop_dht
    from swarm.dht.records import to_peer_infos

    run = config.run
    seed = config.sampling_seed if config.sampling_seed is not None else secrets.randbits(63)
    prompt_ids = encode_prompt(config.prompt, tokenizer, run.model.vocab_size)
    dht = start_run_dht(config.network, run, client_mode=True)
    snapshot: list = []

    async def refresh() -> None:
        try:
            records = await read_run_records(dht, run)
        except LookupError:  # keep the previous snapshot; the calls' retries cover a missed read
            return
        snapshot[:] = to_peer_infos(records, run.num_stages)

    try:
        p2p = await dht.replicate_p2p()
        generator = SwarmGenerator(p2p, config, refresh, lambda: snapshot, seed)
        stream, pieces = TextStream(tokenizer), []

        def show(token: int) -> None:
            text = stream.push(token)
            pieces.append(text)
            print(text, end="", flush=True)

        print(config.prompt, end="", flush=True)
        result = await generator.generate(prompt_ids, torch.Generator().manual_seed(seed), show)
        pieces.append(stream.flush())
        print(pieces[-1], flush=True)
        return result, "".join(pieces)
    finally:
        stop_dht(dht)


def main(argv: Optional[Sequence[str]] = None) -> int:
    config, manifest = load_role_config(
        GenerateConfig, argv, "swarm generate", "Continue a prompt with a live run's model."
    )
    try:
        tokenizer = run_tokenizer(config, joined=manifest is not None)
    except ValueError as e:
        return fail(str(e))
    setup_logging()
    try:
        result, text = asyncio.run(generate(config, tokenizer))
    except (RuntimeError, ValueError, OSError) as e:  # StageUnavailable is a RuntimeError
        return fail(str(e))
    print(
        f"{len(result.tokens)} tokens in {result.seconds:.2f} s: {result.tokens_per_s:.2f} tokens/s "
        "(no KV cache: each token recomputes the whole window on every stage)",
        flush=True,
    )
    emit(
        "generate_done",
        tokens=result.tokens,
        text=text,
        seconds=round(result.seconds, 3),
        tokens_per_s=round(result.tokens_per_s, 3),
    )
    return 0
