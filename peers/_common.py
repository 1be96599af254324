"""What every runnable role shares: logging, signal handling, a machine-readable ready line, and
joining a run from the organiser's signed manifest (``--join ADDRESS``), and from the organiser too
the run's tokenizer, if it names one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import warnings
from typing import Any, Dict, Iterator, NoReturn, Optional, Sequence, Tuple, Type, TypeVar

T = TypeVar("T")


def setup_logging() -> None:
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    from hivemind.utils.logging import use_hivemind_log_handler

    use_hivemind_log_handler("in_root_logger")  # one format for hivemind's messages and ours
    logging.getLogger().setLevel(logging.INFO)


def emit(event: str, **fields: Any) -> None:
    """One JSON line on stdout, for launchers and tests that watch a role's progress."""
    print(json.dumps({"event": event, **fields}), flush=True)


def stop_event() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT, so a role can leave gracefully.

    Processes forked later (hivemind's DHT and averager) must not inherit these handlers: asyncio's
    handler only writes to a wakeup pipe that such a child shares with this process, so a child would
    ignore the SIGTERM its parent's shutdown sends it (the parent then waits for it forever at exit)."""
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, event.set)
    loop.set_exception_handler(_quiet_lost_daemon)
    global _fork_hook_installed
    if not _fork_hook_installed:
        os.register_at_fork(after_in_child=_forget_stop_handlers)
        _fork_hook_installed = True
    return event


_fork_hook_installed = False
_LOST_CONNECTION = (ConnectionError, asyncio.IncompleteReadError)


def _quiet_lost_daemon(loop: asyncio.AbstractEventLoop, context: Dict[str, Any]) -> None:
    """One line, not a traceback, for a background task that lost its connection to p2pd: a signal sent to
    the whole process group (Ctrl-C, ``kill -- -PGID``, systemd) stops p2pd before the role has left."""
    error = context.get("exception")
    if isinstance(error, _LOST_CONNECTION) and context.get("message") == "Task exception was never retrieved":
        logging.getLogger("swarm").info(
            f"a background task lost its connection to p2pd: {type(error).__name__}: {error}"
        )
        return
    loop.default_exception_handler(context)


def _forget_stop_handlers() -> None:
    """In a forked child: SIGTERM ends it again, and no signal of its own reaches the parent's loop.
    SIGINT keeps whatever the child had (hivemind's children ignore it: the parent decides how to stop)."""
    try:
        signal.set_wakeup_fd(-1)
        if signal.getsignal(signal.SIGTERM) not in (signal.SIG_IGN, signal.SIG_DFL):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except ValueError:  # not the main thread of the child: nothing was inherited there to undo
        pass


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return 1


# ---- joining a run with one address: the organiser's signed manifest ----

MANIFEST_FETCH_TIMEOUT_S = 30.0  # seconds to reach the organiser and get its manifest


def _add_join(parser) -> None:
    parser.add_argument(
        "--join",
        default=None,
        metavar="ADDRESS",
        help="join the run organised by the peer at ADDRESS (a multiaddr ending in /p2p/<peer id>): "
        "its signed manifest supplies every run setting, and ADDRESS becomes an initial peer",
    )


async def fetch_run_manifest(address: str, timeout: float = MANIFEST_FETCH_TIMEOUT_S):
    """The organiser's verified manifest, over a P2P node of its own that lives only for this call.

    The role's own DHT cannot fetch it: in a private run that DHT needs the allowlist (which
    is in the manifest) before it can start, and its peer id must be the joiner's identity,
    which a throwaway node does not need."""
    from hivemind.p2p import P2P

    from swarm.dht.manifest import fetch_manifest_from

    p2p = await P2P.create(initial_peers=[address], startup_timeout=timeout)
    try:
        return await fetch_manifest_from(p2p, address, timeout)
    finally:
        await p2p.shutdown()


def fetch_manifest_or_exit(address: str):
    """The verified run manifest that the peer at ``--join ADDRESS`` serves; exits with code 2 when the
    address names no peer, 1 when the manifest cannot be fetched or trusted."""
    from swarm.dht.manifest import ManifestError, peer_id_in_address

    try:
        peer_id_in_address(address)
    except ManifestError as e:
        _exit(2, f"--join: {e}")
    with _quiet_hivemind():
        try:
            return asyncio.run(fetch_run_manifest(address))
        except Exception as e:  # p2pd, the network and the manifest's checks each raise their own types
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            _exit(1, f"cannot get a trustworthy run manifest from {address}: {reason}")


TOKENIZER_FETCH_TIMEOUT_S = 120.0  # seconds to reach the organiser and download the run's tokenizer


async def fetch_run_tokenizer(address: str, sha256: str, timeout: float = TOKENIZER_FETCH_TIMEOUT_S) -> bytes:
    """The bytes of the run's tokenizer ``sha256`` from the organiser at ``address``, over a P2P node of its
    own that lives only for this call (as :func:`fetch_run_manifest`)."""
    from hivemind.p2p import P2P

    from swarm.dht.manifest import fetch_tokenizer_from

    p2p = await P2P.create(initial_peers=[address], startup_timeout=timeout)
    try:
        return await fetch_tokenizer_from(p2p, address, sha256, timeout)
    finally:
        await p2p.shutdown()


def fetch_tokenizer_or_exit(address: str, sha256: str, cache_dir: str) -> str:
    """The path of the run's tokenizer ``sha256`` in ``cache_dir``, fetched from the organiser at ``address``
    unless the cache holds it already; exits with code 1 when it cannot be fetched, is not the file the run
    names, or cannot be kept."""
    from swarm.training.tokenizer import TokenizerError, find_cached, store_cached, tokenizer_from_bytes

    cached = find_cached(sha256, cache_dir)
    if cached is not None:
        return str(cached)
    with _quiet_hivemind():
        try:
            data = asyncio.run(fetch_run_tokenizer(address, sha256))
        except TokenizerError as e:  # the organiser's file is not the one its manifest names
            _exit(1, str(e))
        except Exception as e:  # p2pd, the network and the reply's checks each raise their own types
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            _exit(1, f"cannot get the run's tokenizer {sha256} from {address}: {reason}")
    try:
        tokenizer_from_bytes(data, f"{sha256} from {address}")  # refuse garbage before it is kept
        return str(store_cached(data, sha256, cache_dir))
    except TokenizerError as e:
        _exit(1, str(e))


def _exit(code: int, message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def load_role_config(cls: Type[T], argv: Optional[Sequence[str]], prog: str, description: str) -> Tuple[T, Any]:
    """A role's config from YAML and flags, or with ``--join ADDRESS`` from the organiser's manifest.

    Returns (config, the verified manifest or None). Exits with code 2 and one line on stderr when
    a setting the user gave contradicts the manifest, and with code 1 when the manifest cannot be
    fetched or trusted, or the run is private and this peer is not on its allowlist."""
    from swarm.config.loading import ConfigError, config_from_dict, parse_role_args

    role = parse_role_args(cls, argv, prog, description, add_extras=_add_join)
    address = role.extras.join
    if address is None:
        try:
            return config_from_dict(cls, role.settings), None
        except ConfigError as e:
            role.parser.error(f"invalid configuration: {e}")
    from swarm.dht.manifest import join_settings

    manifest = fetch_manifest_or_exit(address)
    try:
        config = config_from_dict(cls, join_settings(role.settings, manifest, address))
    except ConfigError as e:
        _exit(2, str(e))
    _check_allowed(config, manifest)
    return config, manifest


def _check_allowed(config: Any, manifest: Any) -> None:
    """Refuse early, with the reason, to join a private run that would refuse this peer."""
    from swarm.dht.auth import Allowlist, check_membership

    allowlist = Allowlist.of(manifest.run.allowlist)
    own_peer_id = None
    if not allowlist.is_open and config.network.identity_path is not None:
        from swarm.dht.identity import load_or_create_identity

        try:
            own_peer_id = load_or_create_identity(config.network.identity_path).peer_id
        except (OSError, ValueError) as e:
            _exit(1, f"cannot load the identity {config.network.identity_path}: {e}")
    verdict = check_membership(allowlist, own_peer_id)
    if not verdict.ok:
        _exit(1, verdict.reason)


@contextlib.contextmanager
def _quiet_hivemind() -> Iterator[None]:
    """Keep hivemind's info lines off stderr while fetching, so that an error is the only line there."""
    hivemind_logger = logging.getLogger("hivemind")
    level = hivemind_logger.level
    hivemind_logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        hivemind_logger.setLevel(level)


def parameter_count(model: Any) -> int:
    """Parameters of the whole model of ``model`` (a ModelConfig), counted without allocating them."""
    from swarm.model.footprint import model_parameter_count

    return model_parameter_count(model)


def _human(count: int) -> str:
    for unit, size in (("billion", 1e9), ("million", 1e6), ("thousand", 1e3)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return str(count)


def _megabytes(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.0f} MB" if num_bytes >= 2**20 else f"{num_bytes / 2**20:.2f} MB"


def describe_join(
    role: str, run: Any, manifest: Any, device: str, stage: Any = None, forward_cache_mb: float = 0.0
) -> str:
    """What a role is about to do, in a few plain lines, before it starts: the run, the model, what this
    role will do on which device and, for a peer, the memory it expects to need."""
    from swarm.model.footprint import PROCESS_BASE_BYTES, expected_footprint

    access = "anyone may join" if not run.allowlist else f"private run, {len(run.allowlist)} allowed peers"
    lines = [
        f"Joining run {run.run_id!r} organised by {manifest.organiser} (manifest revision {manifest.revision}; "
        f"{access})",
        f"  model:  {_human(parameter_count(run.model))} parameters ({run.model.num_layers} layers, hidden size "
        f"{run.model.hidden_size}) cut into {run.num_stages} stages, {run.target_batch_size} samples per global step",
        f"  tokens: {'bytes' if not run.tokenizer_sha256 else f'the tokenizer {run.tokenizer_sha256}'} "
        f"(vocabulary {run.model.vocab_size})",
    ]
    if role != "peer":
        return "\n".join(lines + [f"  this {role} will push micro-batches through the pipeline on device {device}"])
    auto = stage == "auto"
    footprint = expected_footprint(run.model, run.num_stages, stage, forward_cache_mb, device)
    up_to = "up to " if auto else ""
    cache = f" + up to {_megabytes(footprint.cache_bytes)} of cached forwards" if footprint.cache_bytes else ""
    lines.append(
        f"  this peer will serve {'the stage that needs capacity most (auto)' if auto else f'stage {stage}'} "
        f"on device {device}: {up_to}{_human(footprint.parameters)} parameters"
    )
    state = "parameters and gradients" if footprint.host_bytes else "parameters, gradients and optimizer state"
    host = (
        f"{up_to or 'about '}{_megabytes(footprint.host_bytes)} of host memory for the optimizer's state and "
        if footprint.host_bytes
        else "about "
    )
    lines.append(
        f"  memory: {up_to or 'about '}{_megabytes(footprint.device_bytes)} on {device} "
        f"({_megabytes(footprint.state_bytes)} of {state}{cache}), "
        f"plus {host}{_megabytes(PROCESS_BASE_BYTES)} for the process itself"
    )
    return "\n".join(lines)
