"""The dashboard's Prometheus metrics: what it knows of the run, read from its latest state at scrape time.

:func:`dashboard_families` turns a ``/api/state`` dict (fields in :mod:`swarm.dashboard.state`) into metric
families named ``swarm_dashboard_*`` (pure); :func:`dashboard_registry` serves them, with the process-wide
metrics of :func:`swarm.metrics.new_registry`, from the :class:`~swarm.dashboard.server.StateBox` the poller
fills. A scrape runs on prometheus_client's HTTP thread and only reads the box's latest state, which the
poller replaces whole and never changes after publishing it.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Iterable, List, Mapping, Optional

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from swarm.dashboard.server import StateBox
from swarm.metrics import new_registry

__all__ = ["PEER_STATES", "dashboard_families", "dashboard_registry"]

PEER_STATES = ("joining", "online", "leaving")


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _finite(value: Any) -> Optional[float]:
    """``value`` as a float, or None when it is unknown (null) or not a finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _stage_families(stages: Iterable[Mapping[str, Any]]) -> List[Metric]:
    peers = GaugeMetricFamily(
        "swarm_dashboard_peers",
        "Peers that announce a stage, by stage and state (joining, online, leaving)",
        labels=["stage", "state"],
    )
    replicas = GaugeMetricFamily(
        "swarm_dashboard_replicas", "Online replicas serving a stage (0: the stage is lost)", labels=["stage"]
    )
    throughput = GaugeMetricFamily(
        "swarm_dashboard_stage_throughput_samples_per_second",
        "Samples per second a stage's online replicas announce, summed",
        labels=["stage"],
    )
    queue = GaugeMetricFamily(
        "swarm_dashboard_stage_queue_length", "Requests waiting at a stage's online replicas, summed", labels=["stage"]
    )
    for row in stages:
        stage = str(row["stage"])
        counts = {"joining": row["joining"], "online": row["replicas"], "leaving": row["leaving"]}
        for state in PEER_STATES:
            peers.add_metric([stage, state], counts[state])
        replicas.add_metric([stage], row["replicas"])
        throughput.add_metric([stage], row["throughput"])
        queue.add_metric([stage], row["queue"])
    return [peers, replicas, throughput, queue]


def dashboard_families(state: Mapping[str, Any], now: float, peer_id: str = "") -> List[Metric]:
    """The metric families of a dashboard state at Unix time ``now`` (pure). The global step and the loss
    are left out while unknown (no online replica, no trainer announcing a loss), never reported as 0."""
    swarm = state["swarm"]
    info = GaugeMetricFamily(
        "swarm_info", "Always 1; names the run, the role and its peer id", labels=["role", "run_id", "peer_id"]
    )
    info.add_metric(["dashboard", str(state["run_id"]), peer_id], 1)
    families: List[Metric] = [
        info,
        *_stage_families(state["stages"]),
        _gauge("swarm_dashboard_stages", "Pipeline stages of the run", state["num_stages"]),
        _gauge("swarm_dashboard_peers_online", "Online peers, all stages", swarm["num_peers"]),
        _gauge("swarm_dashboard_trainers", "Trainers announcing themselves", swarm["num_trainers"]),
        _gauge(
            "swarm_dashboard_samples_per_second", "Samples per second, summed over trainers", swarm["samples_per_s"]
        ),
        _gauge("swarm_dashboard_tokens_per_second", "Tokens per second, summed over trainers", swarm["tokens_per_s"]),
        _gauge(
            "swarm_dashboard_banned_peers",
            "Peers banned by a majority of their stage-mates (trainers route around them)",
            sum(bool(p["banned"]) for p in state["peers"]),
        ),
        _gauge(
            "swarm_dashboard_accusations", "Trainers whose latest accusation names a peer", len(state["accusations"])
        ),
        _gauge(
            "swarm_dashboard_poll_ok",
            "1 when the last read of the DHT succeeded, 0 when it failed",
            1 if state["poll"]["ok"] else 0,
        ),
        _gauge(
            "swarm_dashboard_last_poll_age_seconds",
            "Seconds since the last successful read of the DHT (since the dashboard started, before the first one)",
            max(0.0, now - state["updated_at"]),
        ),
    ]
    step = _finite(state["global_step"])
    if step is not None:
        families.append(
            _gauge(
                "swarm_dashboard_global_step",
                "The run's global step: the last stage's most advanced online replica",
                step,
            )
        )
    loss = _finite(swarm["loss"])
    if loss is not None:
        families.append(_gauge("swarm_dashboard_loss", "Mean loss over the trainers that announce one", loss))
    return families


class _DashboardCollector(Collector):
    """Reads the dashboard's latest state on every scrape."""

    def __init__(self, box: StateBox, peer_id: str, clock: Callable[[], float]):
        self._box, self._peer_id, self._clock = box, peer_id, clock

    def collect(self) -> Iterable[Metric]:
        return dashboard_families(self._box.latest(), self._clock(), self._peer_id)


def dashboard_registry(box: StateBox, peer_id: str = "", clock: Callable[[], float] = time.time) -> CollectorRegistry:
    """A registry serving the state in ``box`` as :func:`dashboard_families`, plus the process' own metrics."""
    registry = new_registry()
    registry.register(_DashboardCollector(box, peer_id, clock))
    return registry
