"""``swarm bootstrap``: a DHT node that others join through; holds no stage.

With ``--manifest run.yaml`` it is also the run's organiser: it signs the run's settings with
its identity key, serves them as the ``manifest`` RPC, keeps them published in the DHT, and
prints the one-address command volunteers join with (``swarm peer --join ADDRESS``).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

import yaml

from peers._common import emit, setup_logging, stop_event
from swarm.config.settings import BootstrapConfig, RunConfig
from swarm.config.loading import ConfigError, config_from_dict, parse_role_config

logger = logging.getLogger("swarm.bootstrap")
MANIFEST_EXPIRATION_S = 600.0  # seconds a published manifest lives in the DHT without being re-published
MANIFEST_REPUBLISH_S = 60.0  # seconds between re-publications of the manifest
MANIFEST_RETRY_S = 5.0  # seconds before retrying a failed publication


def load_run_manifest(path: str) -> RunConfig:
    """The run settings of a manifest file (a YAML mapping of RunConfig's fields)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read the manifest file {path}: {e}") from None
    return config_from_dict(RunConfig, data if data is not None else {})


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


async def _serve_rpcs(dht, run: Optional[RunConfig]) -> List[asyncio.Task]:
    """Dial joiners back (their reachability check); as the organiser also sign the manifest, serve it as an
    RPC and keep it published. Returns the publishing task, if any."""
    from swarm.dht.node import identity_of
    from swarm.dht.manifest import MANIFEST_METHOD, manifest_handler, sign_manifest
    from swarm.net.reachability import DIAL_BACK_METHOD, dial_back_handler
    from swarm.net.rpc import NAMESPACE, RPCServicer

    handlers = {DIAL_BACK_METHOD: dial_back_handler()}
    if run is not None:
        # seconds since the epoch: a restarted organiser's manifest supersedes its earlier one
        signed = sign_manifest(run, identity_of(dht), revision=int(time.time()))
        handlers[MANIFEST_METHOD] = manifest_handler(signed)
    await RPCServicer(handlers).add_p2p_handlers(await dht.replicate_p2p(), namespace=NAMESPACE)
    return [] if run is None else [asyncio.create_task(_keep_published(dht, signed))]


async def serve(config: BootstrapConfig, run: Optional[RunConfig] = None) -> int:
    from swarm.dht.node import start_dht, start_run_dht
    from swarm.net.reachability import RELAY_SERVICE_OPTIONS

    stop = stop_event()
    # an entry point is also the relay of the run's peers that others cannot reach
    if run is None:  # a plain entry point; with run_id its storage refuses anything but the run's signed records
        dht = start_dht(config.network, run_id=config.run_id, num_stages=config.num_stages if config.run_id else None,
                        p2p_options=RELAY_SERVICE_OPTIONS)
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
        tasks = await _serve_rpcs(dht, run)
        if run is None:
            emit("bootstrap_ready", peer_id=str(dht.peer_id), maddrs=maddrs)
        else:
            address = join_address(maddrs, str(dht.peer_id))
            if config.network.identity_path is None:
                logger.warning("no --identity_path: this organiser's peer id, and so the join address, "
                               "changes on every restart")
            print(f"Run {run.run_id!r} is organised here. Volunteers join with:\n  swarm peer --join {address}\n"
                  f"Trainers with:\n  swarm train --join {address}", flush=True)
            emit("bootstrap_ready", peer_id=str(dht.peer_id), maddrs=maddrs, run_id=run.run_id, join=address,
                 organiser=dht.identity.peer_id)
        await stop.wait()
        return 0
    finally:
        for task in tasks:
            task.cancel()
        dht.shutdown()


def main(argv: Optional[Sequence[str]] = None) -> int:
    config = parse_role_config(BootstrapConfig, argv, "swarm bootstrap", "Run a DHT entry point for a swarm.")
    run = None
    if config.manifest is not None:
        try:
            run = load_run_manifest(config.manifest)
        except ConfigError as e:
            print(f"error: {config.manifest}: {e}", file=sys.stderr, flush=True)
            return 2
    setup_logging()
    return asyncio.run(serve(config, run))
