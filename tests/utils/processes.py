"""Test-specific launching: a tiny model, fast announce periods, one Launcher per test."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence

from peers.launcher import REPO, RoleProcess, stop_all

__all__ = ["Launcher", "REPO", "RoleProcess", "TINY_MODEL", "FAST_PEER", "wait_for_log_lines"]

# a model small enough that a 2-core machine runs several peers and trainers at once
TINY_MODEL = ["--num_layers", "2", "--hidden_size", "32", "--num_heads", "2", "--seq_len", "16"]
FAST_PEER = ["--announce_period_s", "0.5", "--expiration_s", "3", "--poll_period_s", "0.2",
             "--matchmaking_time_s", "1.0", "--averaging_timeout_s", "15", "--state_download_timeout_s", "20"]
# where stage peers compute: SWARM_TEST_DEVICE=cuda:0 runs every live test's stages on a GPU
DEVICE = ["--device", os.environ["SWARM_TEST_DEVICE"]] if os.environ.get("SWARM_TEST_DEVICE") else []


class Launcher:
    """Starts roles for one test and stops every one of them in ``close()``."""

    def __init__(self, log_dir: Path, run_id: str):
        self.log_dir, self.run_id = log_dir, run_id
        self.processes: List[RoleProcess] = []
        self.initial_peers: List[str] = []
        self._count = 0

    def start(self, role: str, args: Sequence[str], name: Optional[str] = None, prefix: Sequence[str] = ()) -> RoleProcess:
        self._count += 1
        process = RoleProcess(role, args, self.log_dir, name or f"{role}{self._count}", prefix=prefix)
        self.processes.append(process)
        return process

    def bootstrap(self, num_stages: int = 2) -> RoleProcess:
        """The run's entry point; it enforces the run's record schema, as every other node does."""
        process = self.start("bootstrap", ["--run_id", self.run_id, "--num_stages", str(num_stages)], name="bootstrap")
        self.initial_peers = process.wait_event("bootstrap_ready", timeout=60)["maddrs"]
        return process

    def run_args(self, num_stages: int = 2, target_batch_size: int = 64, extra: Sequence[str] = ()) -> List[str]:
        return ["--run_id", self.run_id, "--num_stages", str(num_stages), "--target_batch_size",
                str(target_batch_size), "--initial_peers", ",".join(self.initial_peers), *TINY_MODEL, *extra]

    def peer(self, stage, num_stages: int = 2, target_batch_size: int = 64, extra: Sequence[str] = (),
             wait: bool = True, name: Optional[str] = None) -> RoleProcess:
        args = ["--stage", str(stage), *self.run_args(num_stages, target_batch_size), *FAST_PEER, *DEVICE, *extra]
        process = self.start("faulty_peer" if "--fault" in args else "peer", args, name=name)
        if wait:
            process.wait_event("peer_ready", timeout=90)
        return process

    @staticmethod
    def wait_ready(peers: Sequence[RoleProcess], timeout: float = 90.0) -> List[dict]:
        """The 'peer_ready' events of ``peers``, started with ``wait=False`` so that they start side by side
        (each spends seconds importing torch and starting its DHT): within ``timeout`` seconds in all."""
        deadline = time.monotonic() + timeout
        return [peer.wait_event("peer_ready", timeout=max(0.1, deadline - time.monotonic())) for peer in peers]

    def trainer(self, num_stages: int = 2, target_batch_size: int = 64, extra: Sequence[str] = (),
                name: Optional[str] = None) -> RoleProcess:
        args = [*self.run_args(num_stages, target_batch_size), "--max_data_mb", "2", "--refresh_period_s", "0.5",
                "--log_period_s", "1", *extra]
        return self.start("train", args, name=name)

    def close(self) -> None:
        """Stop the trainers, then every other role at once (each leaves gracefully in parallel, within one
        shared bound), then kill whatever is left of their process groups. Trainers go first, as a user's
        would: a leaving trainer waits until live replicas hold what it sent, which cannot happen once the
        replicas holding it have left too."""
        processes, self.processes = self.processes, []  # stopped once: a second close signals no reused pid
        stop_all([p for p in reversed(processes) if p.role == "train"], timeout=10)
        stop_all([p for p in reversed(processes) if p.role != "train"], timeout=15)


def wait_for_log_lines(process: RoleProcess, predicate: Callable[[str], bool], timeout: float,
                       what: str = "a log line") -> List[str]:
    """The lines of ``process``'s log for which ``predicate`` holds, once there is at least one: a role logs
    some decisions only when a later event (the next step, a retry) settles them, so a test polls for them."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [line for line in process.log_path.read_text(errors="replace").splitlines() if predicate(line)]
        if lines or time.monotonic() >= deadline:
            break
        time.sleep(0.3)
    if not lines:
        raise TimeoutError(f"{process.name} logged no {what} within {timeout}s; log tail:\n{process.log_tail()}")
    return lines
