"""Shared helpers of the live churn and rebalance benchmarks (``churn.py``, ``rebalance.py``).

A :class:`LiveSwarm` starts a bootstrap DHT, stage peers and trainers as subprocesses (one
process group each, every address 127.0.0.1) with :class:`peers.launcher.RoleProcess`, and a
:class:`tests.utils.probe.Probe` that reads the run's DHT records from this process.
``close()`` stops every one of them: SIGTERM to all at once, a bounded wait, then SIGKILL of
every process group (the role, its p2pd daemon and hivemind's forked helpers).

Every network wait here is bounded: role events by ``timeout``, DHT reads by
:func:`swarm.dht.store.fetch_records` (5 s) and :func:`wait_for` by its own deadline.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peers.launcher import RoleProcess, stop_all  # noqa: E402
from peers.netns import Hosts  # noqa: E402
from swarm.dht.store import fetch_records  # noqa: E402
from swarm.dht.records import PeerRecord, TrainerRecord, trainers_key  # noqa: E402
from tests.utils.probe import Probe, online  # noqa: E402
from tests.utils.processes import FAST_PEER, TINY_MODEL  # noqa: E402

__all__ = ["LiveSwarm", "FAST_PEER", "TINY_MODEL", "online", "accounted", "log", "make_log_dir", "LimitedHosts",
           "install_signal_handlers", "counts", "Snapshot", "free_port"]

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
_T0 = time.monotonic()


def log(message: str) -> None:
    """A progress line on stdout, with seconds since the script started."""
    print(f"[{time.monotonic() - _T0:7.1f}s] {message}", flush=True)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a role's ``--metrics_port``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LimitedHosts:
    """``count`` network-namespace hosts (``peers.netns.Hosts``) whose links are limited to ``mbit`` each way, and
    the roles started on them. Used as a context manager: leaving it stops every role and removes the hosts, also
    on error or Ctrl-C."""

    def __init__(self, count: int, mbit: float, log_dir: Path, name: str):
        self.hosts, self.mbit, self.log_dir, self.name = Hosts(count), mbit, log_dir, name
        self.roles: List[RoleProcess] = []

    def __enter__(self) -> "LimitedHosts":
        self.hosts.create()
        try:
            for host in range(self.hosts.count):
                self.hosts.limit(host, self.mbit)
        except BaseException:
            self.hosts.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            stop_all(self.roles, 10.0)
        finally:
            self.hosts.close()

    def start(self, role: str, host: int, extra: Sequence[str], label: str) -> RoleProcess:
        """Start ``role`` on ``host``, listening on that host's address (never loopback); its log is
        ``{name}-{label}.log`` in the log directory."""
        process = RoleProcess(role, [*extra, "--host_maddrs", f"/ip4/{self.hosts.address(host)}/tcp/0"], self.log_dir,
                              f"{self.name}-{label}", prefix=self.hosts.prefix(host))
        self.roles.append(process)
        return process


def make_log_dir(given: Optional[str], prefix: str) -> Path:
    path = Path(given) if given else Path(tempfile.mkdtemp(prefix=prefix))
    path.mkdir(parents=True, exist_ok=True)
    return path


def install_signal_handlers() -> None:
    """SIGTERM behaves like Ctrl-C, so that the ``finally`` blocks stop every process."""
    def _raise(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, _raise)


def accounted(records: Dict[str, PeerRecord], stage: int) -> int:
    """Samples a stage accounts for: max samples_applied over its online replicas + their pending + frozen."""
    replicas = online(records, stage)
    if not replicas:
        return 0
    return max(r.samples_applied for r in replicas) + sum(r.samples_pending + r.samples_frozen for r in replicas)


def counts(records: Dict[str, PeerRecord], num_stages: int = 2) -> Tuple[int, ...]:
    return tuple(len(online(records, s)) for s in range(num_stages))


class Snapshot:
    """One read of the run's DHT: peer records and trainer records, and when."""

    def __init__(self, t: float, peers: Dict[str, PeerRecord], trainers: Dict[str, TrainerRecord]):
        self.t, self.peers, self.trainers = t, peers, trainers


class LiveSwarm:
    """A bootstrap, peers and trainers of one run on 127.0.0.1; ``close()`` stops all of them."""

    def __init__(self, log_dir: Path, run_id: str, run_args: Sequence[str], peer_args: Sequence[str],
                 trainer_args: Sequence[str]):
        self.log_dir, self.run_id = log_dir, run_id
        self.run_args, self.peer_args, self.trainer_args = list(run_args), list(peer_args), list(trainer_args)
        self.processes: List[RoleProcess] = []
        self.initial_peers: List[str] = []
        self.probe: Optional[Probe] = None

    def _start(self, role: str, args: Sequence[str], name: str) -> RoleProcess:
        process = RoleProcess(role, args, self.log_dir, name)
        self.processes.append(process)
        return process

    def bootstrap(self, timeout: float = 60.0) -> None:
        process = self._start("bootstrap", ["--host_maddrs", LOOPBACK], f"{self.run_id}-bootstrap")
        self.initial_peers = process.wait_event("bootstrap_ready", timeout)["maddrs"]
        self.probe = Probe(self.initial_peers, self.run_id)

    def _common(self) -> List[str]:
        return ["--run_id", self.run_id, *self.run_args, "--initial_peers", ",".join(self.initial_peers),
                "--host_maddrs", LOOPBACK]

    def peer(self, stage: Any, name: str, extra: Sequence[str] = ()) -> RoleProcess:
        role = "faulty_peer" if "--fault" in extra else "peer"  # an emulated fault is installed from outside
        return self._start(role, ["--stage", str(stage), *self._common(), *self.peer_args, *extra],
                           f"{self.run_id}-{name}")

    def trainer(self, name: str, extra: Sequence[str] = ()) -> RoleProcess:
        return self._start("train", [*self._common(), *self.trainer_args, *extra], f"{self.run_id}-{name}")

    async def event(self, process: RoleProcess, name: str, timeout: float) -> Dict[str, Any]:
        """Wait for a role's event without blocking the event loop (other tasks keep sampling)."""
        return await asyncio.to_thread(process.wait_event, name, timeout)

    async def snapshot(self) -> Snapshot:
        peers, trainers = await asyncio.gather(
            self.probe.records(), fetch_records(self.probe.dht, trainers_key(self.run_id), TrainerRecord))
        return Snapshot(time.monotonic(), peers, trainers)

    async def wait_for(self, predicate: Callable[[Dict[str, PeerRecord]], bool], timeout: float,
                       what: str) -> Dict[str, PeerRecord]:
        return await self.probe.wait_for(predicate, timeout, what)

    def close(self, timeout: float = 10.0) -> None:
        """SIGTERM every role at once, wait at most ``timeout`` s in all, then SIGKILL every process group."""
        stop_all(self.processes, timeout)
        if self.probe is not None:
            try:
                self.probe.shutdown()
            except Exception:
                pass
