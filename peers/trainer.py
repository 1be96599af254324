"""``swarm train``: push micro-batches through the swarm, report loss and speed as it goes.

A run that names a tokenizer (``tokenizer_sha256``) needs its file: ``--tokenizer PATH``, the copy cached
by an earlier join, or, with ``--join ADDRESS``, one fetched from the organiser and cached. Whichever it
is must have the hash the run names."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import time
from typing import Any, Optional, Sequence

from peers._common import (
    describe_join,
    emit,
    fail,
    fetch_tokenizer_or_exit,
    load_role_config,
    setup_logging,
    stop_event,
)
from swarm.config.settings import TrainerConfig
from swarm.config.loading import ConfigError
from swarm.metrics import MetricsPortError

logger = logging.getLogger("swarm.trainer")


def _progress_line(trainer) -> str:
    m = trainer.metrics
    loss = m.recent_loss()
    return (
        f"samples {m.samples_sent:>8}  loss {loss if loss is None else f'{loss:.4f}'}  "
        f"{m.samples_per_s:7.1f} samples/s  {m.samples_per_s * trainer.run.model.seq_len:9.0f} tokens/s  "
        f"failed {m.micro_batches_failed}  resent {trainer.ledger.num_resent}"
    )


def report(trainer) -> None:
    """A progress bar on a terminal, plain log lines otherwise."""
    if sys.stderr.isatty():
        print("\r" + _progress_line(trainer), end="", file=sys.stderr, flush=True)
    else:
        logger.info(_progress_line(trainer))


async def drain_unless_stopped_again(trainer, stop: asyncio.Event, timeout_s: float = 60.0) -> bool:
    """Wait (at most ``timeout_s``) until every sample sent is applied, or held by a live replica in a step the
    swarm has not closed yet, so that leaving loses none; a second SIGTERM or Ctrl-C leaves at once. Whether
    everything was so when it returned."""
    stop.clear()
    draining = asyncio.create_task(trainer.drain(timeout_s=timeout_s))
    again = asyncio.create_task(stop.wait())
    await asyncio.wait({draining, again}, return_when=asyncio.FIRST_COMPLETED)
    again.cancel()
    if draining.done():
        return draining.result()
    draining.cancel()
    logger.warning("stopped again: leaving without waiting for the replicas to hold every sample sent")
    return False


async def train(config: TrainerConfig) -> int:
    from swarm.client.trainer import Trainer

    stop = stop_event()
    trainer = Trainer(config)
    try:
        await trainer.start()
        emit(
            "trainer_ready",
            trainer_id=trainer.trainer_id,
            metrics=trainer.metrics_server.url if trainer.metrics_server else None,
        )
        started = time.monotonic()
        training = asyncio.create_task(trainer.train(on_progress=report))
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({training, stopping}, return_when=asyncio.FIRST_COMPLETED)
        train_s = time.monotonic() - started  # the time spent training, without the drain below
        if not training.done():
            training.cancel()
        drained = await drain_unless_stopped_again(trainer, stop)
        m = trainer.metrics
        emit(
            "trainer_done",
            trainer_id=trainer.trainer_id,
            samples_sent=m.samples_sent,
            loss=m.recent_loss(),
            failed=m.micro_batches_failed,
            resent=trainer.ledger.num_resent,
            drained=drained,
            train_s=round(train_s, 3),
        )
        return 0
    finally:
        trainer.shutdown()


def with_run_tokenizer(config: TrainerConfig, manifest: Any) -> TrainerConfig:
    """``config`` with ``tokenizer`` naming a file of the run's tokenizer, fetched from the organiser into the
    cache when the trainer joined and has none; unchanged for a byte-token run or a file given locally.
    The file is checked against the run's hash and vocabulary where it is loaded."""
    if not config.run.tokenizer_sha256 or config.tokenizer is not None or manifest is None:
        return config
    # join_settings puts the organiser's address first among the initial peers
    address = config.network.initial_peers[0]
    path = fetch_tokenizer_or_exit(address, config.run.tokenizer_sha256, config.tokenizer_cache_dir)
    return dataclasses.replace(config, tokenizer=path)


def check_run_tokenizer(config: TrainerConfig) -> None:
    """Load the run's tokenizer once before anything starts, so that a missing, different or mismatched
    file is refused with its reason at once (ValueError), not after the DHT is up."""
    if config.run.tokenizer_sha256:
        from swarm.training.tokenizer import load_run_tokenizer

        load_run_tokenizer(
            config.tokenizer, config.run.tokenizer_sha256, config.run.model.vocab_size, config.tokenizer_cache_dir
        )


def main(argv: Optional[Sequence[str]] = None) -> int:
    config, manifest = load_role_config(TrainerConfig, argv, "swarm train", "Train a model on a swarm of stage peers.")
    config = with_run_tokenizer(config, manifest)
    try:
        check_run_tokenizer(config)
    except ValueError as e:
        return fail(str(e))
    if manifest is not None:
        # the trainer holds no stage: its own compute is sampling data and relaying activations
        print(describe_join("trainer", config.run, manifest, "cpu"), flush=True)
    setup_logging()
    try:
        return asyncio.run(train(config))
    except ConfigError as e:  # settings that differ from the run's peers
        fail(f"invalid configuration: {e}")
        return 2
    except MetricsPortError as e:  # a setting to change, like the one above
        fail(f"{e} (choose another --metrics_port)")
        return 2
    except (RuntimeError, OSError, ValueError) as e:
        return fail(str(e))
