"""Prometheus metrics of a peer or a trainer, served over HTTP at ``/metrics`` (``--metrics_port``).

Two kinds of metrics, so that the code being measured needs as few hooks as possible:

- *Events* that happen deep in the code (bytes of each RPC method on the wire, bans, all-reduce
  rounds, spot-check outcomes) are process-wide prometheus objects, updated by one-line helpers
  (:func:`count_rpc_bytes`, :func:`count_ban`, :func:`observe_allreduce`, :func:`count_verification`).
  They cost a lock and an addition, and count whether or not anything serves them.
- A role's *state* (step, queue, samples, loss, throughput) is read from the live object when
  ``/metrics`` is scraped: the role's own ``snapshot()`` (``StagePeer.snapshot``, ``Trainer.snapshot``)
  copies the figures into a :class:`PeerSnapshot` or :class:`TrainerSnapshot`, and
  the pure :func:`peer_families` / :func:`trainer_families` turn a snapshot into metric families.

Every role has its own :class:`~prometheus_client.CollectorRegistry` (:func:`role_registry`), never
prometheus' global one, so several roles in one process (tests)
do not collide; each registry also serves the process-wide event metrics. Scrapes run on
prometheus_client's HTTP thread and only read the role's attributes (numbers, and containers
copied in one C-level call), never change them.
"""

from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, TypeVar
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

S = TypeVar("S")

__all__ = [
    "MetricsServer",
    "MetricsPortError",
    "start_metrics_server",
    "new_registry",
    "role_registry",
    "count_rpc_bytes",
    "count_ban",
    "observe_allreduce",
    "count_verification",
    "count_dht",
    "method_label",
    "PeerSnapshot",
    "TrainerSnapshot",
    "peer_families",
    "trainer_families",
    "check_metrics_port",
]

ALLREDUCE_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)  # seconds
_METHOD_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")

# ---- events, process-wide ----

RPC_BYTES = Counter(
    "swarm_rpc_bytes",
    "Bytes of RPC messages by method and direction (sent/received), requests and replies, as they go on the wire",
    ["method", "direction"],
    registry=None,
)
BANS = Counter(
    "swarm_bans", "Peers banned (or set aside), by the role that banned them and why", ["role", "reason"], registry=None
)
ALLREDUCE_SECONDS = Histogram(
    "swarm_allreduce_duration_seconds",
    "Duration of a stage's averaging rounds, by outcome (done/failed)",
    ["outcome"],
    buckets=ALLREDUCE_BUCKETS_S,
    registry=None,
)
ALLREDUCE_FAILURES = Counter(
    "swarm_allreduce_failures", "Averaging rounds that found no group or failed", registry=None
)
VERIFICATIONS = Counter(
    "swarm_verifications",
    "Spot checks of a reply against a second replica, by outcome (agree, disagree = a mismatch, incomparable)",
    ["outcome"],
    registry=None,
)
DHT_KEYS = Counter(
    "swarm_dht_keys",
    "DHT keys this process stored or looked up (a record's store, one shard of a "
    "stage's directory read), by operation (store/read) and outcome (ok/failed)",
    ["operation", "outcome"],
    registry=None,
)
_EVENT_METRICS = (RPC_BYTES, BANS, ALLREDUCE_SECONDS, ALLREDUCE_FAILURES, VERIFICATIONS, DHT_KEYS)


def method_label(method: str, known: Optional[Iterable[str]] = None) -> str:
    """A bounded label for an RPC method: a name this side knows (or, with ``known`` None, any short
    lowercase name), else 'other'. A remote caller choosing method names must not grow the metrics."""
    if known is not None:
        return method if method in known else "other"
    return method if isinstance(method, str) and _METHOD_NAME.fullmatch(method) else "other"


def count_rpc_bytes(method: str, direction: str, num_bytes: int) -> None:
    """Count ``num_bytes`` of ``method`` (already a bounded label) ``direction`` 'sent' or 'received'."""
    RPC_BYTES.labels(method, direction).inc(num_bytes)


def count_dht(operation: str, ok: bool, keys: int = 1) -> None:
    """Count ``keys`` DHT keys stored or read (``operation`` 'store' or 'read'): each one costs a traversal's
    worth of messages, so their rate is the control plane's traffic as this process causes it."""
    DHT_KEYS.labels(operation, "ok" if ok else "failed").inc(keys)


def count_ban(role: str, reason: str) -> None:
    """Count one ban by ``role`` ('peer' or 'trainer'); ``reason`` is one of a few fixed words."""
    BANS.labels(role, reason).inc()


def observe_allreduce(duration_s: float, ok: bool) -> None:
    """Record one averaging round of ``duration_s`` seconds that succeeded (``ok``) or failed."""
    ALLREDUCE_SECONDS.labels("done" if ok else "failed").observe(duration_s)
    if not ok:
        ALLREDUCE_FAILURES.inc()


def count_verification(outcome: str) -> None:
    """Count one spot check by its outcome (a comparison of :mod:`swarm.policy.verification`)."""
    VERIFICATIONS.labels(outcome).inc()


# ---- a role's state, read at scrape time ----


@dataclass(frozen=True)
class PeerSnapshot:
    """The figures of one stage peer at one moment."""

    run_id: str
    peer_id: str
    state: str  # joining, online, leaving
    stage: Optional[int]
    step: int  # global steps applied
    samples_processed: int  # samples this replica ran backward for
    samples_applied: int  # samples inside the applied steps
    samples_pending: int  # samples accumulated towards the next step
    queue_length: int  # requests waiting for the compute thread
    in_flight: int  # forward/backward requests being served
    throughput: float  # samples per second this replica computes
    forwards: int = 0  # module forward passes run
    recomputed: int = 0  # backward passes that recomputed their forward
    forward_cache: Dict[str, int] = field(default_factory=dict)  # ForwardCache.stats()
    banned_replicas: int = 0  # stage-mates banned from averaging now
    allreduce_bytes: int = 0  # encoded messages sent and received in robust averaging rounds, as of the last round
    dht_nodes_known: int = -1  # nodes in its DHT node's routing table at its last announce (-1: none yet)


@dataclass(frozen=True)
class TrainerSnapshot:
    """The figures of one trainer at one moment."""

    run_id: str
    trainer_id: str
    samples_sent: int
    micro_batches_failed: int
    resent: int  # contributions re-sent after the replica holding them was lost
    uncommitted: int  # contributions waiting for their global step to be confirmed
    samples_committed: Dict[int, int]  # stage -> samples confirmed in an applied step
    loss: Optional[float]  # mean loss of the recent micro-batches
    samples_per_s: float
    tokens_per_s: float
    global_step: int  # highest step the last stage's online replicas announce
    banned_peers: int  # replicas this trainer does not route to now (banned or distrusted)


def _gauge(name: str, doc: str, value: float, labels: Optional[Dict[str, str]] = None) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=list(labels or ()))
    family.add_metric(list((labels or {}).values()), value)
    return family


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _info(role: str, run_id: str, peer_id: str) -> GaugeMetricFamily:
    return _gauge(
        "swarm_info",
        "Always 1; names the run, the role and its peer id",
        1,
        {"role": role, "run_id": run_id, "peer_id": peer_id},
    )


def peer_families(s: PeerSnapshot) -> List[Metric]:
    """The metric families of a peer snapshot (pure)."""
    states = GaugeMetricFamily("swarm_peer_state", "1 for the state the peer is in", labels=["state"])
    for state in ("joining", "online", "leaving"):
        states.add_metric([state], 1.0 if s.state == state else 0.0)
    families: List[Metric] = [
        _info("peer", s.run_id, s.peer_id),
        states,
        _gauge(
            "swarm_peer_stage",
            "The stage this peer serves (-1 before it chose one)",
            -1 if s.stage is None else s.stage,
        ),
        _gauge("swarm_global_step", "Global steps applied", s.step),
        _counter("swarm_peer_samples_processed", "Samples this replica ran backward for", s.samples_processed),
        _gauge("swarm_peer_samples_applied", "Samples inside the applied global steps", s.samples_applied),
        _gauge("swarm_peer_samples_pending", "Samples accumulated towards the next global step", s.samples_pending),
        _gauge("swarm_peer_queue_length", "Requests waiting for the compute thread", s.queue_length),
        _gauge("swarm_peer_requests_in_flight", "Forward and backward requests being served", s.in_flight),
        _gauge("swarm_peer_throughput_samples_per_second", "Samples per second this replica computes", s.throughput),
        _counter("swarm_peer_forwards", "Module forward passes run, recomputations included", s.forwards),
        _counter("swarm_peer_recomputed_backwards", "Backward passes that recomputed their forward", s.recomputed),
        _gauge("swarm_peer_banned_replicas", "Stage-mates banned from averaging now", s.banned_replicas),
        _counter(
            "swarm_peer_allreduce_bytes",
            "Bytes of encoded messages sent and received in robust averaging rounds, as of the last round",
            s.allreduce_bytes,
        ),
        _gauge(
            "swarm_dht_nodes_known",
            "Nodes in this peer's DHT routing table at its last announce (-1 before): where its stores and lookups start",
            s.dht_nodes_known,
        ),
    ]
    for key in ("hits", "misses", "evicted", "mismatched"):
        if key in s.forward_cache:
            families.append(_counter(f"swarm_peer_forward_cache_{key}", f"Forward cache {key}", s.forward_cache[key]))
    if "bytes" in s.forward_cache:
        families.append(
            _gauge(
                "swarm_peer_forward_cache_bytes",
                "Bytes of autograd state the forward cache holds",
                s.forward_cache["bytes"],
            )
        )
    return families


def trainer_families(s: TrainerSnapshot) -> List[Metric]:
    """The metric families of a trainer snapshot (pure); no loss family before the first micro-batch."""
    committed = CounterMetricFamily(
        "swarm_trainer_samples_committed", "Samples confirmed in an applied global step, by stage", labels=["stage"]
    )
    for stage, samples in sorted(s.samples_committed.items()):
        committed.add_metric([str(stage)], samples)
    families: List[Metric] = [
        _info("trainer", s.run_id, s.trainer_id),
        committed,
        _counter("swarm_trainer_samples_sent", "Samples pushed through the whole pipeline", s.samples_sent),
        _counter(
            "swarm_trainer_micro_batches_failed",
            "Micro-batches given up (their samples are drawn again)",
            s.micro_batches_failed,
        ),
        _counter("swarm_trainer_resent", "Contributions re-sent after the replica holding them was lost", s.resent),
        _gauge("swarm_trainer_uncommitted", "Contributions waiting for their global step", s.uncommitted),
        _gauge("swarm_trainer_samples_per_second", "Samples per second over the last 30 s", s.samples_per_s),
        _gauge("swarm_trainer_tokens_per_second", "Tokens per second over the last 30 s", s.tokens_per_s),
        _gauge("swarm_global_step", "Highest global step the last stage's replicas announce", s.global_step),
        _gauge("swarm_trainer_banned_peers", "Replicas this trainer does not route to now", s.banned_peers),
    ]
    if s.loss is not None and math.isfinite(s.loss):
        families.append(_gauge("swarm_trainer_loss", "Mean loss of the last 20 micro-batches", s.loss))
    return families


class _RoleCollector(Collector):
    """Reads a live role's snapshot on every scrape."""

    def __init__(self, snapshot, families):
        self._snapshot, self._families = snapshot, families

    def collect(self) -> Iterable[Metric]:
        return self._families(self._snapshot())


class _EventCollector(Collector):
    """The process-wide event metrics, served by every role's registry."""

    def collect(self) -> Iterable[Metric]:
        for metric in _EVENT_METRICS:
            yield from metric.collect()


def new_registry() -> CollectorRegistry:
    """A private registry with the process' resource use and the process-wide event metrics; a role
    adds its own collector to it (a dashboard may too)."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    registry.register(_EventCollector())
    return registry


def role_registry(snapshot: Callable[[], S], families: Callable[[S], List[Metric]]) -> CollectorRegistry:
    """A role's registry: :func:`new_registry` plus the role's state, read with ``snapshot()`` at every scrape
    and turned into metric families by ``families`` (:func:`peer_families`, :func:`trainer_families`)."""
    registry = new_registry()
    registry.register(_RoleCollector(snapshot, families))
    return registry


# ---- serving ----


class MetricsPortError(OSError):
    """The metrics port cannot be listened on (in use, not permitted); the message says which."""


def check_metrics_port(port: int) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"metrics_port must be an integer in 0..65535 (0 = no metrics), got {port!r}")


@dataclass
class MetricsServer:
    """A running ``/metrics`` HTTP server on a daemon thread; ``shutdown()`` stops it."""

    host: str
    port: int
    _server: WSGIServer = field(repr=False)
    _thread: threading.Thread = field(repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def shutdown(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)


def start_metrics_server(port: int, registry: CollectorRegistry, host: str = "127.0.0.1") -> MetricsServer:
    """Serve ``registry`` at ``http://host:port/metrics`` until ``shutdown()``.

    Raises :class:`MetricsPortError` naming the address if it cannot listen there (a port in use is
    the usual reason), so a role can exit with one clear line instead of a traceback."""
    check_metrics_port(port)
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise MetricsPortError(f"cannot serve metrics on {host}:{port}: {e.strerror or e}") from None
    return MetricsServer(host, server.server_port, server, thread)
