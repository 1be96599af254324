"""Start swarm roles as subprocesses on 127.0.0.1 for a benchmark, always stop them, and
account the CPU time every process of the benchmark spends.

Roles are started with :class:`peers.launcher.RoleProcess` (as ``swarm demo`` does): each
runs in its own session (process group), so stopping the group also stops the ``p2pd``
daemons and hivemind processes the role forked.

CPU accounting reads ``/proc`` (Linux), because on a 2-core machine "where the time goes"
is mostly "which process holds a core": stage compute, serialization, or the p2pd daemons.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

from peers.launcher import RoleProcess, stop_all

__all__ = ["RoleProcess", "Swarm", "cpu_seconds_by_kind", "machine_busy_seconds", "paused"]

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


class Swarm:
    """A bootstrap DHT and stage peers for one run; ``close()`` stops every process it started."""

    def __init__(self, log_dir: Path, run_args: Sequence[str]):
        self.log_dir, self.run_args = log_dir, list(run_args)
        self.processes: List[RoleProcess] = []
        self.initial_peers: List[str] = []

    def _start(self, role: str, args: Sequence[str], name: str) -> RoleProcess:
        process = RoleProcess(role, args, self.log_dir, name)
        self.processes.append(process)
        return process

    def _bootstrap_run_args(self) -> List[str]:
        """The run's id and stage count, so that the bootstrap's storage refuses anything but the run's records."""
        args = []
        for flag in ("--run_id", "--num_stages"):
            if flag in self.run_args:
                args += [flag, self.run_args[self.run_args.index(flag) + 1]]
        return args

    def bootstrap(self, timeout: float = 60.0) -> None:
        process = self._start("bootstrap", ["--host_maddrs", LOOPBACK, *self._bootstrap_run_args()], "bootstrap")
        self.initial_peers = process.wait_event("bootstrap_ready", timeout)["maddrs"]

    def peers(self, stage_args: Sequence[Sequence[str]], timeout: float = 120.0) -> List[Dict[str, Any]]:
        """Start one peer per entry of ``stage_args`` at once; return their 'peer_ready' events in order."""
        started = [self._start("peer", [*self.run_args, "--initial_peers", ",".join(self.initial_peers),
                                        "--host_maddrs", LOOPBACK, *args], f"peer{i}")
                   for i, args in enumerate(stage_args)]
        return [process.wait_event("peer_ready", timeout) for process in started]

    def close(self, timeout: float = 15.0) -> None:
        """SIGTERM every role at once, give them ``timeout`` seconds in all, then SIGKILL every process group."""
        stop_all(self.processes, timeout)


# ---- CPU accounting over /proc ----

def _proc_stat(pid: int) -> Optional[tuple]:
    """(comm, ppid, pgrp, cpu seconds) of a live process, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    comm = raw[raw.index("(") + 1 : raw.rindex(")")]
    fields = raw[raw.rindex(")") + 2 :].split()
    # after the comm: state(0) ppid(1) pgrp(2) ... utime(11) stime(12)
    return comm, int(fields[1]), int(fields[2]), (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


def _all_processes() -> Dict[int, tuple]:
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _proc_stat(int(entry))
            if stat is not None:
                table[int(entry)] = stat
    return table


def _descendants(root: int, table: Dict[int, tuple], stop_at: Sequence[int]) -> List[int]:
    """``root`` and the processes it forked, leaving out the subtrees rooted at ``stop_at``."""
    children: Dict[int, List[int]] = {}
    for pid, (_, ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in table:
            found.append(pid)
        todo.extend(child for child in children.get(pid, []) if child not in stop_at)
    return found


def cpu_seconds_by_kind(roles: Dict[str, int]) -> Dict[str, float]:
    """CPU seconds used so far, keyed '<role> python' / '<role> p2pd', for each role's process tree.

    ``roles`` maps a name to the root pid of a tree (a role subprocess, or this process for the
    in-process trainer); a tree ends where another role's tree begins. Python helpers that a role forked (hivemind's DHT and averager) count
    as '<role> helpers'. Seconds of processes that already exited are not included.
    """
    table = _all_processes()
    totals: Dict[str, float] = {}
    for name, root in roles.items():
        for pid in _descendants(root, table, stop_at=list(roles.values())):
            comm, _, _, seconds = table[pid]
            kind = "p2pd" if comm.startswith("p2pd") else ("python" if pid == root else "helpers")
            key = f"{name} {kind}"
            totals[key] = totals.get(key, 0.0) + seconds
    return totals


@contextlib.contextmanager
def paused(roots: Sequence[int]) -> Iterator[List[int]]:
    """Stop (SIGSTOP) every process of the trees rooted at ``roots``, this process excepted, and continue
    them (SIGCONT) on leaving, also on error: a baseline measured meanwhile has the machine to itself,
    as if the swarm were not there, without tearing the swarm down."""
    table = _all_processes()
    pids = [pid for root in roots for pid in _descendants(root, table, stop_at=[]) if pid != os.getpid()]
    stopped = []
    try:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            except ProcessLookupError:
                pass
        yield stopped
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def machine_busy_seconds() -> float:
    """CPU seconds all cores of the machine have spent not idle (every process, ours or not), from /proc/stat."""
    fields = [int(value) for value in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / _TICKS_PER_S
