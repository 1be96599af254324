"""Start swarm roles as subprocesses on 127.0.0.1 and always stop them.

Each role runs in its own session (process group), so that stopping it also stops the p2pd
daemons and hivemind processes it forked. Roles print JSON event lines on stdout; a reader
thread collects them so a test can wait for 'peer_ready' and the like with a timeout.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[2]

# a model small enough that a 2-core machine runs several peers and trainers at once
TINY_MODEL = ["--num_layers", "2", "--hidden_size", "32", "--num_heads", "2", "--seq_len", "16"]
FAST_PEER = ["--announce_period_s", "0.5", "--expiration_s", "3", "--poll_period_s", "0.2",
             "--matchmaking_time_s", "1.0", "--averaging_timeout_s", "15", "--state_download_timeout_s", "20"]


class RoleProcess:
    """One ``swarm <role>`` subprocess with its stdout events and a log file for stderr."""

    def __init__(self, role: str, args: Sequence[str], log_dir: Path, name: str):
        self.role, self.name = role, name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore::DeprecationWarning"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "peers.cli", role, *args], cwd=REPO, stdout=subprocess.PIPE,
            stderr=self._log, stdin=subprocess.DEVNULL, text=True, start_new_session=True, env=env)
        self.pid = self.proc.pid
        self.events: "queue.Queue[Dict[str, Any]]" = queue.Queue()
        self.seen: List[Dict[str, Any]] = []
        self.stdout_lines: List[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.stdout_lines.append(line)
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and "event" in event:
                self.events.put(event)

    def wait_event(self, name: str, timeout: float) -> Dict[str, Any]:
        for event in self.seen:
            if event["event"] == name:
                return event
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                event = self.events.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None and self.events.empty():
                    break
                continue
            self.seen.append(event)
            if event["event"] == name:
                return event
        raise TimeoutError(f"{self.name} did not report {name!r} within {timeout}s "
                           f"(exit code {self.proc.poll()}); log tail:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, sig)

    def kill_group(self) -> None:
        """SIGKILL the whole process group: the role, its p2pd daemons and forked helpers."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def stop(self, timeout: float = 20.0) -> Optional[int]:
        """SIGTERM, wait for a clean exit, then kill whatever is left of the group."""
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        code = self.proc.poll()
        self.kill_group()
        self._log.close()
        return code


class Launcher:
    """Starts roles for one test and stops every one of them in ``close()``."""

    def __init__(self, log_dir: Path, run_id: str):
        self.log_dir, self.run_id = log_dir, run_id
        self.processes: List[RoleProcess] = []
        self.initial_peers: List[str] = []
        self._count = 0

    def start(self, role: str, args: Sequence[str], name: Optional[str] = None) -> RoleProcess:
        self._count += 1
        process = RoleProcess(role, args, self.log_dir, name or f"{role}{self._count}")
        self.processes.append(process)
        return process

    def bootstrap(self) -> RoleProcess:
        process = self.start("bootstrap", [], name="bootstrap")
        self.initial_peers = process.wait_event("bootstrap_ready", timeout=60)["maddrs"]
        return process

    def run_args(self, num_stages: int = 2, target_batch_size: int = 64, extra: Sequence[str] = ()) -> List[str]:
        return ["--run_id", self.run_id, "--num_stages", str(num_stages), "--target_batch_size",
                str(target_batch_size), "--initial_peers", ",".join(self.initial_peers), *TINY_MODEL, *extra]

    def peer(self, stage, num_stages: int = 2, target_batch_size: int = 64, extra: Sequence[str] = (),
             wait: bool = True, name: Optional[str] = None) -> RoleProcess:
        args = ["--stage", str(stage), *self.run_args(num_stages, target_batch_size), *FAST_PEER, *extra]
        process = self.start("peer", args, name=name)
        if wait:
            process.wait_event("peer_ready", timeout=90)
        return process

    def trainer(self, num_stages: int = 2, target_batch_size: int = 64, extra: Sequence[str] = (),
                name: Optional[str] = None) -> RoleProcess:
        args = [*self.run_args(num_stages, target_batch_size), "--max_data_mb", "2", "--refresh_period_s", "0.5",
                "--log_period_s", "1", *extra]
        return self.start("train", args, name=name)

    def close(self) -> None:
        for process in reversed(self.processes):
            process.stop(timeout=15)
