"""Churn: when peers join and when they are preempted, generated from rates or read from a trace.

Generated churn models preemptible instances: every peer (the initial ones at t=0 and the
newcomers, a Poisson stream) lives an exponential time with mean ``mean_lifetime_h``, and
is then preempted, with a notice (graceful leave) or, with probability ``crash_fraction``,
without one (a crash). The churn is drawn once per seed and shared by the runs compared
(with and without rebalancing), so they see the very same peers come and go.

Trace file format (CSV, ``#`` comments allowed): ``time_s,event,peer_id[,compute]`` with
event one of ``join``, ``preempt``, ``crash``; a missing compute is drawn from the config.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from swarm.config.simulation import SimConfig
from swarm.simulate.network import Hardware, draw_hardware

__all__ = ["ChurnEvent", "generate_churn", "load_trace", "churn_for"]

CHURN_KINDS = ("join", "preempt", "crash")


@dataclass(frozen=True)
class ChurnEvent:
    """A peer arriving (with its hardware) or being preempted, at ``time_s``."""

    time_s: float
    kind: str  # "join" | "preempt" | "crash"
    peer_id: str
    hardware: Optional[Hardware] = None  # for joins

    def joining_hardware(self) -> Hardware:
        """The hardware of the peer this event brings in: a join without it is a malformed trace."""
        if self.hardware is None:
            raise ValueError(f"the {self.kind} event of {self.peer_id} at {self.time_s}s names no hardware")
        return self.hardware


def generate_churn(config: SimConfig) -> List[ChurnEvent]:
    """Joins and preemptions over the configured horizon, sorted by time (then by peer id)."""
    rng = np.random.default_rng([config.seed, 1])
    horizon_s, lifetime_s = config.duration_s, config.mean_lifetime_h * 3600.0
    starts = [0.0] * config.num_peers
    rate_per_s = config.effective_join_rate_per_h / 3600.0
    if rate_per_s > 0:
        expected = int(rate_per_s * horizon_s * 1.5) + 20
        arrivals = np.cumsum(rng.exponential(1.0 / rate_per_s, size=expected))
        starts += [float(t) for t in arrivals if t < horizon_s]
    events: List[ChurnEvent] = []
    for index, start_s in enumerate(starts):
        peer_id = f"peer{index:06d}"
        events.append(ChurnEvent(start_s, "join", peer_id, draw_hardware(config, rng, index)))
        end_s = start_s + float(rng.exponential(lifetime_s))
        crash = bool(rng.random() < config.crash_fraction)
        if end_s < horizon_s:
            events.append(ChurnEvent(end_s, "crash" if crash else "preempt", peer_id))
    events.sort(key=lambda e: (e.time_s, e.peer_id, e.kind != "join"))
    return events


def load_trace(path: str, config: SimConfig) -> List[ChurnEvent]:
    """Read a churn trace; validates every row and names the offending line."""
    rng = np.random.default_rng([config.seed, 2])
    events: List[ChurnEvent] = []
    joined, left = set(), set()
    with open(path, newline="") as file:
        rows = [row for row in csv.reader(line for line in file if line.strip() and not line.lstrip().startswith("#"))]
    for number, row in enumerate(rows, start=1):
        if row and row[0].strip() == "time_s":
            continue  # header
        if len(row) not in (3, 4):
            raise ValueError(f"{path}: row {number}: expected time_s,event,peer_id[,compute], got {row}")
        time_s, kind, peer_id = float(row[0]), row[1].strip(), row[2].strip()
        if kind not in CHURN_KINDS or time_s < 0 or not peer_id:
            raise ValueError(f"{path}: row {number}: bad event {row}")
        if kind == "join":
            if peer_id in joined:
                raise ValueError(f"{path}: row {number}: {peer_id} joins twice (use a new id to rejoin)")
            joined.add(peer_id)
            hardware = draw_hardware(config, rng, len(joined) - 1)
            if len(row) == 4 and row[3].strip():
                hardware = Hardware(float(row[3]), hardware.bandwidth_mbps, hardware.latency_s)
            events.append(ChurnEvent(time_s, kind, peer_id, hardware))
        else:
            if peer_id not in joined or peer_id in left:
                raise ValueError(f"{path}: row {number}: {peer_id} leaves without being present")
            left.add(peer_id)
            events.append(ChurnEvent(time_s, kind, peer_id))
    events.sort(key=lambda e: (e.time_s, e.kind != "join"))
    return [e for e in events if e.time_s < config.duration_s]


def churn_for(config: SimConfig) -> List[ChurnEvent]:
    """The churn of a run: the trace if configured, else generated from the rates."""
    return load_trace(config.trace_path, config) if config.trace_path else generate_churn(config)
