"""``swarm export``: write a live run's model as one checkpoint (a Hugging Face ``LlamaForCausalLM`` directory for
a Llama run, this package's own format for a GPT run), plus the run's tokenizer files when it has a tokenizer.

Each stage's parameters come from its replicas and are kept only when they hash to the digest that most of the
stage's online replicas announce; all stages must be at one global step unless ``--allow_mixed_steps``
(see :mod:`swarm.client.export`)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import List, Optional, Sequence

from peers._common import emit, fail, fetch_tokenizer_or_exit, load_role_config, setup_logging
from swarm.client.export import ExportConfig, ExportError, StageState, collect_stage_states, write_export


def run_tokenizer_bytes(config: ExportConfig, joined: bool) -> Optional[bytes]:
    """The bytes of the run's tokenizer.json (fetched from the organiser with --join unless cached, checked
    against the run's hash), or None in a byte-token run."""
    from swarm.training.tokenizer import TokenizerError, load_run_tokenizer, read_tokenizer_file

    sha256 = config.run.tokenizer_sha256
    if not sha256:
        return None
    path = (
        fetch_tokenizer_or_exit(config.network.initial_peers[0], sha256, config.tokenizer_cache_dir) if joined else None
    )
    try:
        tokenizer = load_run_tokenizer(path, sha256, config.run.model.vocab_size, config.tokenizer_cache_dir)
    except TokenizerError as e:
        raise ExportError(str(e)) from None
    return read_tokenizer_file(tokenizer.source)


async def export(config: ExportConfig, tokenizer: Optional[bytes]) -> List[Path]:
    """Download every stage's checked parameters and write them; returns the files written."""
    from swarm.dht.node import start_run_dht, stop_dht

    dht = start_run_dht(config.network, config.run, client_mode=True)
    try:
        p2p = await dht.replicate_p2p()
        states = await collect_stage_states(dht, p2p, config)
        _describe(states)
        return await asyncio.get_running_loop().run_in_executor(None, write_export, config, states, tokenizer)
    finally:
        stop_dht(dht)


def _describe(states: Sequence[StageState]) -> None:
    for state in states:
        print(
            f"stage {state.stage}: step {state.step}, digest {state.digest}, {len(state.parameters)} tensors "
            f"from {state.peer_id}",
            flush=True,
        )


def main(argv: Optional[Sequence[str]] = None) -> int:
    config, manifest = load_role_config(
        ExportConfig, argv, "swarm export", "Write a live run's model as one checkpoint directory."
    )
    setup_logging()
    try:
        tokenizer = run_tokenizer_bytes(config, joined=manifest is not None)
        written = asyncio.run(export(config, tokenizer))
    except (RuntimeError, ValueError, OSError) as e:  # ExportError is a RuntimeError, CheckpointError a ValueError
        return fail(str(e))
    if tokenizer is None:
        print("byte-token run: no tokenizer files written (token ids are the text's UTF-8 bytes)", flush=True)
    print(f"wrote {len(written)} files to {config.out}", flush=True)
    emit("export_done", out=str(config.out), files=[path.name for path in written], tokenizer=tokenizer is not None)
    return 0
