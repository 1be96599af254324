"""Do the participants agree on the run? Every peer announces a hash of its run settings.

A participant whose settings differ from the run's (another model shape, learning rate, number of
stages, target batch size, compression, protocol version) would compute garbage for everyone else, or
send what the others cannot read. So:
- on start, a peer or trainer compares its hash with those the run's peers announce; where they
  differ it asks one of them for its settings (the ``settings`` RPC) and refuses to start with a
  message naming the first field that differs;
- while running, records announcing another hash are left out of every decision (logged once each).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Set, Tuple, TypeVar

from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_logger

from swarm import PROTOCOL_VERSION
from swarm.config.settings import RunConfig
from swarm.config.loading import ConfigError, config_from_dict
from swarm.dht.manifest import run_differences, run_hash, run_settings
from swarm.net.rpc import call_peer

__all__ = ["settings_reply", "same_run", "check_run_agreement", "RunFilter"]

logger = get_logger(__name__)
R = TypeVar("R")


def settings_reply(run: RunConfig) -> Dict[str, Any]:
    """What the ``settings`` RPC answers: the run settings this peer serves, and its protocol version."""
    return {"run": run_settings(run), "protocol_version": PROTOCOL_VERSION, "run_hash": run_hash(run)}


def same_run(records: Mapping[str, R], own_hash: str) -> Dict[str, R]:
    """The records of participants that announce the same run settings as ours."""
    return {key: record for key, record in records.items() if getattr(record, "run_hash", "") == own_hash}


class RunFilter:
    """Leaves out records of other run settings, warning once per peer."""

    def __init__(self, run: RunConfig):
        self.run_hash = run_hash(run)
        self._warned: Set[str] = set()

    def __call__(self, records: Mapping[str, R]) -> Dict[str, R]:
        kept = same_run(records, self.run_hash)
        for peer_id in records.keys() - kept.keys():
            if peer_id not in self._warned and len(self._warned) < 10_000:
                self._warned.add(peer_id)
                logger.warning(
                    f"ignoring peer {peer_id}: it announces other run settings "
                    f"(hash {getattr(records[peer_id], 'run_hash', '')!r}, ours {self.run_hash!r})"
                )
        return kept


async def check_run_agreement(
    p2p: P2P, records: Mapping[str, Any], run: RunConfig, *, timeout: float = 10.0, max_asked: int = 3
) -> None:
    """Raise :class:`ConfigError` naming a field if the run's peers serve settings other than ``run``.

    Only peers that announce another hash are asked (at most ``max_asked``); an unreachable or
    unparsable answer is skipped, since a lying peer must not keep an honest one from starting."""
    own = run_hash(run)
    others = [record for record in records.values() if getattr(record, "run_hash", own) != own]
    if not others or len(others) * 2 <= len(records):
        return  # most of the run agrees with us: those that differ are the odd ones out, not us
    for record in others[:max_asked]:
        theirs = await _settings_of(p2p, record.peer_id, timeout)
        if theirs is None:
            continue
        version, their_run = theirs
        if version != PROTOCOL_VERSION:
            raise ConfigError(
                f"protocol_version: the run's peers speak protocol {version}, this one {PROTOCOL_VERSION}"
            )
        differences = run_differences(their_run, run)
        if differences:
            name, expected, actual = differences[0]
            raise ConfigError(
                f"run.{name}: the run's peers use {expected}, this one has {actual}: every run "
                f"setting must match the run's (use --join ADDRESS to take them from its manifest)"
            )


async def _settings_of(p2p: P2P, peer_id: str, timeout: float) -> Optional[Tuple[int, RunConfig]]:
    try:
        reply = await call_peer(p2p, PeerID.from_base58(peer_id), "settings", {}, timeout=timeout)
        return int(reply["protocol_version"]), config_from_dict(RunConfig, reply["run"], prefix="run.")
    except Exception as e:  # timeouts, dead peers, malformed answers: this peer's word is simply not taken
        logger.info(f"could not read the run settings of {peer_id}: {type(e).__name__}: {e}")
        return None
