"""``swarm bootstrap``: a DHT node that others join through; holds no stage.

With ``--manifest run.yaml`` it is also the run's organiser: it signs the run's settings with
its identity key, serves them as the ``manifest`` RPC, keeps them published in the DHT, and
prints the one-address command volunteers join with (``swarm peer --join ADDRESS``).
With ``--tokenizer tokenizer.json`` as well, the manifest names that file by its SHA-256 and the
organiser serves its bytes as the ``tokenizer`` RPC, from which joining trainers fetch it.
With ``--init_from DIR`` (a Hugging Face checkpoint), the run starts from those weights: the manifest signs
the hash of its config.json and of each stage's tensors, and peers load their stage from their own copy.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import yaml

from peers._common import emit, setup_logging, stop_event
from swarm.config.settings import BootstrapConfig, RunConfig
from swarm.config.loading import ConfigError, config_from_dict, parse_role_config

logger = logging.getLogger("swarm.bootstrap")
MANIFEST_EXPIRATION_S = 600.0  # seconds a published manifest lives in the DHT without being re-published
MANIFEST_REPUBLISH_S = 60.0  # seconds between re-publications of the manifest
MANIFEST_RETRY_S = 5.0  # seconds before retrying a failed publication


def load_run_manifest(path: str, init_from: Optional[str] = None) -> RunConfig:
    """The run settings of a manifest file (a YAML mapping of RunConfig's fields). With ``init_from`` (a
    checkpoint directory), model settings the file leaves out are the checkpoint's."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read the manifest file {path}: {e}") from None
    data = data if data is not None else {}
    if init_from is not None and isinstance(data, dict):
        data = {**data, "model": _model_from_checkpoint(init_from, data.get("model"))}
    return config_from_dict(RunConfig, data)


def _model_from_checkpoint(path: str, given: object) -> object:
    """The manifest's model settings over the checkpoint's (a malformed section is left for the loader to name)."""
    from swarm.model.hf_checkpoint import config_from_hf

    if given is not None and not isinstance(given, dict):
        return given
    given = given or {}
    seq_len = given.get("seq_len")
    found = dataclasses.asdict(config_from_hf(path, seq_len=seq_len if isinstance(seq_len, int) else None))
    return {**found, **given}


def attach_checkpoint(run: RunConfig, path: Optional[str]) -> RunConfig:
    """The run signing the checkpoint at ``path`` (its config.json's hash and each stage's tensor digest).

    Raises :class:`ValueError` (``CheckpointError``) when the checkpoint is unusable or its config differs from
    the run's model, or when the manifest signs another checkpoint."""
    from swarm.model.initial_weights import sign_checkpoint

    if path is None:
        if run.starts_from_checkpoint:
            raise ValueError(
                "the manifest signs a checkpoint (init_stage_digests): give its directory with "
                "--init_from DIR, so that its hashes are checked against it"
            )
        return run
    signature = sign_checkpoint(path, run.model, run.num_stages)
    if run.starts_from_checkpoint and (run.init_config_sha256, run.init_stage_digests) != (
        signature.config_sha256,
        list(signature.stage_digests),
    ):
        raise ValueError(
            f"the manifest signs another checkpoint than {path} (its init_config_sha256 or "
            f"init_stage_digests differ from the directory's)"
        )
    return dataclasses.replace(
        run, init_config_sha256=signature.config_sha256, init_stage_digests=list(signature.stage_digests)
    )


def attach_tokenizer(run: RunConfig, path: Optional[str]) -> Tuple[RunConfig, Optional[bytes]]:
    """The run naming the tokenizer at ``path`` by its SHA-256, and the file's bytes to serve.

    Raises :class:`ValueError` (the tokenizer module's ``TokenizerError``) when the file is unusable, when the
    manifest names another hash, when the model's vocab_size differs from the tokenizer's, or when the
    manifest names a tokenizer that no ``path`` supplies (joiners could not get it)."""
    from swarm.training.tokenizer import check_sha256, read_tokenizer_file, tokenizer_from_bytes

    if path is None:
        if run.tokenizer_sha256:
            raise ValueError(
                f"the manifest names the tokenizer {run.tokenizer_sha256}: give its file with "
                f"--tokenizer PATH so that joining trainers can fetch it"
            )
        return run, None
    data = read_tokenizer_file(path)
    tokenizer = tokenizer_from_bytes(data, path)
    if run.tokenizer_sha256:
        check_sha256(tokenizer.sha256, run.tokenizer_sha256, path)
    tokenizer.check_vocab_size(run.model.vocab_size)
    return dataclasses.replace(run, tokenizer_sha256=tokenizer.sha256), data


def join_address(maddrs: Sequence[str], peer_id: str) -> str:
    """The address volunteers should join through: a public one if this node has any, else the first."""
    own = [a if "/p2p/" in a else f"{a}/p2p/{peer_id}" for a in maddrs]
    public = [a for a in own if not a.startswith(("/ip4/127.", "/ip6/::1/"))]
    return (public or own)[0]


async def _keep_published(dht, signed) -> None:
    from swarm.dht.manifest import publish_manifest

    while True:
        try:
            ok = await publish_manifest(dht, signed, MANIFEST_EXPIRATION_S)
        except (asyncio.TimeoutError, Exception) as e:  # a failed store must not end the organiser
            logger.warning(f"publishing the run manifest failed: {type(e).__name__}: {e}")
            ok = False
        await asyncio.sleep(MANIFEST_REPUBLISH_S if ok else MANIFEST_RETRY_S)


async def _serve_rpcs(dht, run: Optional[RunConfig], tokenizer: Optional[bytes] = None) -> List[asyncio.Task]:
    """Dial joiners back (their reachability check); as the organiser also sign the manifest, serve it (and the
    run's tokenizer, if any) as an RPC and keep it published. Returns the publishing task, if any."""
    from swarm.dht.node import identity_of
    from swarm.dht.manifest import MANIFEST_METHOD, TOKENIZER_METHOD, manifest_handler, sign_manifest, tokenizer_handler
    from swarm.net.reachability import DIAL_BACK_METHOD, dial_back_handler
    from swarm.net.rpc import NAMESPACE, RPCServicer

    handlers = {DIAL_BACK_METHOD: dial_back_handler()}
    if run is not None:
        # seconds since the epoch: a restarted organiser's manifest supersedes its earlier one
        signed = sign_manifest(run, identity_of(dht), revision=int(time.time()))
        handlers[MANIFEST_METHOD] = manifest_handler(signed)
        if tokenizer is not None:
            handlers[TOKENIZER_METHOD] = tokenizer_handler(tokenizer)
    await RPCServicer(handlers).add_p2p_handlers(await dht.replicate_p2p(), namespace=NAMESPACE)
    return [] if run is None else [asyncio.create_task(_keep_published(dht, signed))]


async def serve(config: BootstrapConfig, run: Optional[RunConfig] = None, tokenizer: Optional[bytes] = None) -> int:
    from swarm.dht.node import start_dht, start_run_dht, stop_dht
    from swarm.net.reachability import RELAY_SERVICE_OPTIONS

    stop = stop_event()
    # an entry point is also the relay of the run's peers that others cannot reach
    if run is None:  # a plain entry point; with run_id its storage refuses anything but the run's signed records
        dht = start_dht(
            config.network,
            run_id=config.run_id,
            num_stages=config.num_stages if config.run_id else None,
            p2p_options=RELAY_SERVICE_OPTIONS,
        )
    else:
        dht = start_run_dht(config.network, run, p2p_options=RELAY_SERVICE_OPTIONS)
    tasks: List[asyncio.Task] = []
    try:
        maddrs = [str(a) for a in dht.get_visible_maddrs()]
        if config.maddrs_file:
            path = Path(config.maddrs_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.with_suffix(".tmp").write_text("\n".join(maddrs) + "\n")
            path.with_suffix(".tmp").replace(path)  # atomic: readers never see half a file
        tasks = await _serve_rpcs(dht, run, tokenizer)
        if run is None:
            emit("bootstrap_ready", peer_id=str(dht.peer_id), maddrs=maddrs)
        else:
            address = join_address(maddrs, str(dht.peer_id))
            if config.network.identity_path is None:
                logger.warning(
                    "no --identity_path: this organiser's peer id, and so the join address, changes on every restart"
                )
            print(
                f"Run {run.run_id!r} is organised here. Volunteers join with:\n  swarm peer --join {address}\n"
                f"Trainers with:\n  swarm train --join {address}",
                flush=True,
            )
            if run.starts_from_checkpoint:
                print(
                    f"The run starts from the checkpoint {config.init_from}: the first peer of each stage needs a "
                    f"copy of it (swarm peer --join {address} --init_from DIR); the manifest signs its config "
                    f"{run.init_config_sha256[:16]}... and each stage's tensors.",
                    flush=True,
                )
            if tokenizer is not None:
                print(
                    f"Trainers that join fetch its tokenizer {run.tokenizer_sha256} ({len(tokenizer)} bytes, "
                    f"vocabulary {run.model.vocab_size}) from here.",
                    flush=True,
                )
            emit(
                "bootstrap_ready",
                peer_id=str(dht.peer_id),
                maddrs=maddrs,
                run_id=run.run_id,
                join=address,
                organiser=dht.identity.peer_id,
                tokenizer_sha256=run.tokenizer_sha256,
                init_stage_digests=run.init_stage_digests,
            )
        await stop.wait()
        return 0
    finally:
        for task in tasks:
            task.cancel()
        stop_dht(dht)


def main(argv: Optional[Sequence[str]] = None) -> int:
    config = parse_role_config(BootstrapConfig, argv, "swarm bootstrap", "Run a DHT entry point for a swarm.")
    run, tokenizer = None, None
    if config.manifest is not None:
        try:
            run = load_run_manifest(config.manifest, config.init_from)
        except ConfigError as e:
            print(f"error: {config.manifest}: {e}", file=sys.stderr, flush=True)
            return 2
        except ValueError as e:  # an unusable checkpoint config.json
            print(f"error: {e}", file=sys.stderr, flush=True)
            return 2
        try:
            run, tokenizer = attach_tokenizer(run, config.tokenizer)
            run = attach_checkpoint(run, config.init_from)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return 2
    setup_logging()
    return asyncio.run(serve(config, run, tokenizer))
