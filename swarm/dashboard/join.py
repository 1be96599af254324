"""The exact command a volunteer pastes to join the run a dashboard shows.

A run with a manifest is joined with one address (``swarm peer --join ADDRESS``: the organiser's signed
manifest supplies every run setting). Without one, a joiner must repeat every run setting on its command
line; those come from a peer's ``settings`` RPC (see :mod:`swarm.dht.agreement`) and only the settings that
differ from the defaults are written out. Pure functions, no I/O.
"""

from __future__ import annotations

import dataclasses
import shlex
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from swarm.config.settings import RunConfig
from swarm.dht.manifest import run_settings

__all__ = ["JoinInfo", "join_commands", "run_flags", "majority_run_hash"]


@dataclasses.dataclass(frozen=True)
class JoinInfo:
    """What the dashboard knows about joining its run."""

    run_id: str
    num_stages: int
    initial_peers: Tuple[str, ...] = ()  # the multiaddrs the dashboard itself joined through
    manifest_address: Optional[str] = None  # the organiser's address, when the run has a manifest
    run: Optional[RunConfig] = None  # the run's settings as its peers serve them, when learned


def _leaves(settings: Mapping[str, Any], path: Tuple[str, ...] = ()) -> Iterator[Tuple[Tuple[str, ...], Any]]:
    for name, value in settings.items():
        if isinstance(value, Mapping):
            yield from _leaves(value, path + (name,))
        else:
            yield path + (name,), value


def _flag_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(_flag_value(item) for item in value)
    return str(value)


def run_flags(run: RunConfig) -> List[str]:
    """``--run_id`` and ``--num_stages`` and every run setting that differs from its default, as flags
    (every leaf of a config is a flag of the same name, see :mod:`swarm.config.loading`)."""
    defaults = dict(_leaves(run_settings(RunConfig())))
    flags: List[str] = ["--run_id", run.run_id, "--num_stages", str(run.num_stages)]
    for path, value in _leaves(run_settings(run)):
        if path[-1] in ("run_id", "num_stages") or defaults.get(path) == value or value is None:
            continue
        if isinstance(value, (list, tuple)) and not value and not defaults.get(path):
            continue
        flags += [f"--{path[-1]}", _flag_value(value)]
    return flags


def _command(role: str, args: Sequence[str]) -> str:
    return " ".join(["swarm", role, *(shlex.quote(arg) for arg in args)])


def join_commands(info: JoinInfo) -> Dict[str, Any]:
    """The ``join`` object of ``/api/state``: ``peer`` and ``trainer`` commands, ``via`` ("manifest" or
    "initial_peers") and ``complete`` (False while the run's settings are unknown, so that the command
    holds only ``--run_id`` and ``--num_stages`` and a joiner must add the model and optimizer settings)."""
    if info.manifest_address is not None:
        args = ["--join", info.manifest_address]
        return {
            "via": "manifest",
            "complete": True,
            "address": info.manifest_address,
            "peer": _command("peer", args),
            "trainer": _command("train", args),
        }
    run_args = (
        run_flags(info.run) if info.run is not None else ["--run_id", info.run_id, "--num_stages", str(info.num_stages)]
    )
    args = ["--initial_peers", ",".join(info.initial_peers), *run_args] if info.initial_peers else run_args
    return {
        "via": "initial_peers",
        "complete": info.run is not None,
        "address": None,
        "peer": _command("peer", args),
        "trainer": _command("train", args),
    }


def majority_run_hash(records: Mapping[str, Any]) -> Optional[str]:
    """The run-settings hash that most online peers announce (ties broken by the hash, so every reader
    agrees), or None when no online peer announces one: whose settings the join command should repeat."""
    counts: Dict[str, int] = {}
    for record in records.values():
        run_hash = getattr(record, "run_hash", "")
        if getattr(record, "state", None) == "online" and run_hash:
            counts[run_hash] = counts.get(run_hash, 0) + 1
    return max(counts, key=lambda h: (counts[h], h)) if counts else None
