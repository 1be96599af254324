"""A live swarm at the default periods, one role per network namespace, and the bytes each host's link
carries: what :mod:`control_plane` reports as the ``"live"`` rows.

Every role (the bootstrap, ``stages x replicas`` stage peers, the trainers) runs on its own host of
:class:`peers.netns.Hosts` (198.18.0.0/15, one bridge), so the link counters of a host hold everything its
role sent and received: libp2p's framing, Noise, yamux and TCP included. Two windows are measured:

  idle      every peer online, no trainer started: all a link carries is the control plane (DHT stores and
            lookups, p2pd's keep-alives);
  training  the trainers train: the link also carries activations, their gradients and the all-reduce.
            Control bytes = link bytes - the data plane, where the data plane is what the peer's RPC
            meters count for forward and backward (``swarm_rpc_bytes_total``, payloads) and an all-reduce
            estimate of ``2 x (replicas - 1) / replicas x`` the stage's parameter bytes per global step it
            applied (what butterfly all-reduce moves in and out). Both are payload figures without
            framing, so the control figure of a training window is an upper bound.

The metrics scrapes that read those meters cross the links too; their bytes are subtracted.
"""

from __future__ import annotations

import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

from peers.launcher import RoleProcess, stop_all
from peers.netns import Hosts

__all__ = ["Layout", "measure_layout"]

READY_TIMEOUT_S = 300.0
METRICS_PORT = 9400  # every host is its own namespace: the same port on each
SCRAPE_OVERHEAD_BYTES = 700  # a scrape's request, HTTP headers and TCP handshake, beyond the body


@dataclass(frozen=True)
class Layout:
    stages: int
    replicas: int
    trainers: int

    @property
    def peers(self) -> int:
        return self.stages * self.replicas

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """``"2x8+2"``: 2 stages of 8 replicas and 2 trainers."""
        shape, _, trainers = text.partition("+")
        stages, _, replicas = shape.partition("x")
        return cls(int(stages), int(replicas), int(trainers or 0))


def _samples(text: str) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue
    return out


def _scrape(url: str) -> Tuple[Dict[str, float], int]:
    with urllib.request.urlopen(url, timeout=10) as response:
        body = response.read()
    return _samples(body.decode()), len(body) + SCRAPE_OVERHEAD_BYTES


def _data_plane_bytes(samples: Dict[str, float]) -> float:
    return sum(
        value
        for name, value in samples.items()
        if name.startswith("swarm_rpc_bytes_total{") and ('method="forward"' in name or 'method="backward"' in name)
    )


def _link_bytes(hosts: Hosts, host: int) -> int:
    return hosts.tx_bytes(host) + hosts.rx_bytes(host)


def measure_layout(layout: Layout, model: Sequence[str], window_s: float, log_dir: Path,
                   target_batch_size: int, param_bytes_per_stage: int) -> List[Dict[str, Any]]:
    """Run ``layout`` and measure an idle and a training window of ``window_s`` seconds each; one row per window."""
    count = 1 + layout.peers + layout.trainers
    hosts = Hosts(count).create()
    roles: List[RoleProcess] = []
    run_id = f"ctl{layout.stages}x{layout.replicas}_{hosts.tag}"

    def start(role: str, host: int, extra: List[str], name: str) -> RoleProcess:
        process = RoleProcess(role, [*extra, "--host_maddrs", f"/ip4/{hosts.address(host)}/tcp/0"], log_dir,
                              f"{run_id}-{name}", prefix=hosts.prefix(host))
        roles.append(process)
        return process

    try:
        run = ["--run_id", run_id, "--num_stages", str(layout.stages)]
        bootstrap = start("bootstrap", 0, run, "bootstrap")
        initial = bootstrap.wait_event("bootstrap_ready", READY_TIMEOUT_S)["maddrs"]
        common = [*run, "--initial_peers", ",".join(initial), "--target_batch_size", str(target_batch_size), *model]
        peer_hosts = list(range(1, 1 + layout.peers))
        peers = []
        for index, host in enumerate(peer_hosts):
            stage = index % layout.stages
            peers.append(start("peer", host, ["--stage", str(stage), *common, "--metrics_port", str(METRICS_PORT),
                                              "--metrics_host", hosts.address(host)], f"s{stage}_{index // layout.stages}"))
            if index < layout.stages:  # the first replica of each stage first: the others download its state
                peers[-1].wait_event("peer_ready", READY_TIMEOUT_S)
        deadline = time.monotonic() + READY_TIMEOUT_S
        for peer in peers:
            peer.wait_event("peer_ready", max(1.0, deadline - time.monotonic()))
        urls = [f"http://{hosts.address(host)}:{METRICS_PORT}/metrics" for host in peer_hosts]
        time.sleep(window_s / 2)  # the joins' reads and stores are over
        rows = [_window(hosts, layout, urls, peer_hosts, [], window_s, "idle", param_bytes_per_stage)]
        trainer_hosts = list(range(1 + layout.peers, count))
        trainers = [start("train", host, [*common, "--max_data_mb", "2", "--batch_size", "8", "--log_period_s", "10",
                                          "--trainer_seed", str(index + 1), "--metrics_port", str(METRICS_PORT),
                                          "--metrics_host", hosts.address(host)], f"trainer{index}")
                    for index, host in enumerate(trainer_hosts)]
        for trainer in trainers:
            trainer.wait_event("trainer_ready", READY_TIMEOUT_S)
        if trainers:
            time.sleep(window_s / 2)  # past the first steps
            rows.append(_window(hosts, layout, urls, peer_hosts, trainer_hosts, window_s, "training",
                                param_bytes_per_stage))
        return rows
    finally:
        stop_all(roles, 15.0)
        hosts.close()


def _window(hosts: Hosts, layout: Layout, urls: List[str], peer_hosts: List[int], trainer_hosts: List[int],
            window_s: float, phase: str, param_bytes_per_stage: int) -> Dict[str, Any]:
    trainer_urls = [f"http://{hosts.address(host)}:{METRICS_PORT}/metrics" for host in trainer_hosts]
    scraped = [_scrape(url) for url in urls]
    trainers_scraped = [_scrape(url) for url in trainer_urls]
    links = {host: _link_bytes(hosts, host) for host in [0, *peer_hosts, *trainer_hosts]}
    started = time.monotonic()
    time.sleep(window_s)
    elapsed = time.monotonic() - started
    links_after = {host: _link_bytes(hosts, host) for host in links}
    scraped_after = [_scrape(url) for url in urls]
    trainers_after = [_scrape(url) for url in trainer_urls]
    per_peer = []
    for host, (before, first_cost), (after, second_cost) in zip(peer_hosts, scraped, scraped_after):
        data = _data_plane_bytes(after) - _data_plane_bytes(before)
        steps = after.get("swarm_global_step", 0.0) - before.get("swarm_global_step", 0.0)
        allreduce = steps * 2 * (layout.replicas - 1) / layout.replicas * param_bytes_per_stage
        moved = links_after[host] - links[host] - second_cost  # the first scrape ended before the window began
        per_peer.append({"link": moved, "data": data, "allreduce": allreduce, "steps": steps,
                         "control": max(0.0, moved - data - allreduce)})
    per_trainer = [
        max(0.0, links_after[h] - links[h] - cost - (_data_plane_bytes(after) - _data_plane_bytes(before))) / elapsed
        for h, (before, _), (after, cost) in zip(trainer_hosts, trainers_scraped, trainers_after)
    ]
    control = [p["control"] / elapsed for p in per_peer]
    return {
        "stages": layout.stages, "peers": layout.peers, "trainers": len(trainer_hosts), "phase": phase,
        "bytes_per_s_per_peer_in_plus_out": round(sum(control) / len(control), 1),
        "bytes_per_s_per_peer_max": round(max(control), 1),
        "link_bytes_per_s_per_peer": round(sum(p["link"] for p in per_peer) / len(per_peer) / elapsed, 1),
        "data_plane_bytes_per_s_per_peer": round(sum(p["data"] + p["allreduce"] for p in per_peer) / len(per_peer)
                                                 / elapsed, 1),
        "bytes_per_s_per_trainer": round(sum(per_trainer) / len(per_trainer), 1) if per_trainer else None,
        "bootstrap_bytes_per_s": round((links_after[0] - links[0]) / elapsed, 1),
        "global_steps": max((p["steps"] for p in per_peer), default=0),
        "window_s": round(elapsed, 1),
        "source": "live",
        "_control_per_peer": [round(c, 1) for c in control],
    }
