"""A live swarm at the default periods, one role per network namespace, and the bytes each host's link
carries: what :mod:`control_plane` reports as the ``"live"`` rows.

Every role (the bootstrap, ``stages x replicas`` stage peers, the trainers) runs on its own host of
:class:`peers.netns.Hosts` (198.18.0.0/15, one bridge), so the link counters of a host hold everything its
role sent and received: libp2p's framing, Noise, yamux and TCP included. Two windows are measured:

  idle      every peer online, no trainer started: all a link carries is the control plane (DHT stores and
            lookups, p2pd's keep-alives);
  training  the trainers train: the link also carries activations and their gradients (on the direct
            channels: nothing else goes there) and the all-reduce (through p2pd). Control bytes = the
            wire bytes of the host's connections other than direct channels, counted per connection with
            ``ss`` (payload plus 66 bytes of Ethernet, IP and TCP headers a segment; offloads are off on
            every link, so a segment is a frame), less the all-reduce: the encoded messages the peer's
            averager counted in its rounds (``swarm_peer_allreduce_bytes``; a robust round sends each member's
            whole gradient to every other member, about ``2 x (replicas - 1)`` gradients in and out a step),
            plus ``ALLREDUCE_HEADERS`` of TCP, Noise and yamux framing. The streams' opening (multistream
            negotiation, a few small segments each, 3 exchanges x 2 x (replicas - 1) streams a round) stays in
            the control bytes. Connections are listed every ``SAMPLE_PERIOD_S``, so one that opens and
            closes within the window counts up to its last listing; ``link_bytes_per_s_per_peer`` shows the
            link's whole count.

The metrics scrapes that read the peers' steps cross the links too; their bytes are subtracted.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Sequence, Set, Tuple

from peers.launcher import RoleProcess, stop_all
from peers.netns import Hosts

__all__ = ["Layout", "measure_layout"]

READY_TIMEOUT_S = 300.0
METRICS_PORT = 9400  # every host is its own namespace: the same port on each
SCRAPE_OVERHEAD_BYTES = 700  # a scrape's request, HTTP headers and TCP handshake, beyond the body
SAMPLE_PERIOD_S = 2.0  # how often every host's connections are listed within a window
SEGMENT_HEADER_BYTES = 66  # Ethernet (14), IP (20) and TCP with timestamps (32) of one segment on a veth
ALLREDUCE_HEADERS = 1.07  # wire bytes per encoded byte of bulk TCP: 66 B a 1448-byte segment, an ACK a 2 segments
ALLREDUCE_METRIC = "swarm_peer_allreduce_bytes_total"  # what the averager counted (a counter: exposed with _total)


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


Connection = Tuple[str, str, bool]  # local address, remote address, whether it is a direct channel


def _connections(hosts: Hosts, host: int, ports: Set[int]) -> Dict[Connection, int]:
    """Wire bytes so far of each of ``host``'s TCP connections, marked direct when to or from one of ``ports``."""
    listing = subprocess.run(["ip", "netns", "exec", hosts.namespaces[host], "ss", "-tinH"], capture_output=True,
                             text=True, timeout=10).stdout.splitlines()
    out: Dict[Tuple[str, str], int] = {}
    for head, info in zip(listing, listing[1:]):
        if head[:1].isspace() or not info[:1].isspace():
            continue
        columns = head.split()
        if len(columns) < 5:
            continue
        local, remote = columns[3], columns[4]
        on_port = int(local.rsplit(":", 1)[1]) in ports or int(remote.rsplit(":", 1)[1]) in ports
        fields = dict(re.findall(r"(bytes_sent|bytes_received|segs_out|segs_in):(\d+)", info))
        payload = int(fields.get("bytes_sent", 0)) + int(fields.get("bytes_received", 0))
        segments = int(fields.get("segs_out", 0)) + int(fields.get("segs_in", 0))
        out[(local, remote, on_port)] = payload + SEGMENT_HEADER_BYTES * segments
    return out


class _ConnectionLog:
    """Every connection of some hosts over a window, sampled every ``SAMPLE_PERIOD_S``: a connection that closes
    within the window still counts, up to its last sample (at most a period of its bytes is missed)."""

    def __init__(self, hosts: Hosts, measured: Sequence[int], ports: Set[int]):
        self.hosts, self.measured, self.ports = hosts, list(measured), ports
        self.first = {host: _connections(hosts, host, ports) for host in self.measured}
        self.last = {host: dict(seen) for host, seen in self.first.items()}
        self.open = {host: set(seen) for host, seen in self.first.items()}  # as of the latest listing

    def sample(self) -> None:
        for host in self.measured:
            listed = _connections(self.hosts, host, self.ports)
            for key, value in listed.items():
                self.first[host].setdefault(key, 0)  # opened within the window: all its bytes count
                self.last[host][key] = value
            self.open[host] = set(listed)

    def moved(self, host: int, direct: bool) -> int:
        return sum(value - self.first[host][key] for key, value in self.last[host].items() if key[2] == direct)

    def moved_by_remote(self, host: int) -> Dict[str, int]:
        """Bytes of the host's connections other than direct channels, by the remote address (no port)."""
        out: Dict[str, int] = {}
        for key, value in self.last[host].items():
            if not key[2]:
                remote = key[1].rsplit(":", 1)[0]
                out[remote] = out.get(remote, 0) + value - self.first[host][key]
        return out

    def closed(self, host: int) -> int:
        """Connections seen in the window that were gone at its latest listing."""
        return len(set(self.last[host]) - self.open[host])


def _direct_port(role: RoleProcess) -> int:
    match = re.search(r"direct calls: listening on \S+ port (\d+)", role.log_path.read_text(errors="replace"))
    if match is None:
        raise RuntimeError(f"{role.name} logged no direct port")
    return int(match.group(1))


def _segment_by_segment(hosts: Hosts) -> None:
    """Turn segmentation and receive offloads off on every link, so that each TCP segment is one frame on it:
    a connection's wire bytes are then its payload plus ``SEGMENT_HEADER_BYTES`` a segment, exactly as the
    link counters count them (with offloads a 64 KiB burst is one frame, headers counted once)."""
    for host in range(hosts.count):
        for namespace, link in ((hosts.namespaces[host], hosts.inside(host)), (hosts.switch, hosts.links[host])):
            subprocess.run(["ip", "netns", "exec", namespace, "ethtool", "-K", link, "tso", "off", "gso", "off",
                            "gro", "off"], capture_output=True, check=True, timeout=10)


def _link_bytes(hosts: Hosts, host: int) -> int:
    return hosts.tx_bytes(host) + hosts.rx_bytes(host)


def measure_layout(layout: Layout, model: Sequence[str], window_s: float, log_dir: Path,
                   target_batch_size: int, param_bytes_per_stage: int) -> List[Dict[str, Any]]:
    """Run ``layout`` and measure an idle and a training window of ``window_s`` seconds each; one row per window."""
    if shutil.which("ethtool") is None:
        raise RuntimeError("this benchmark needs ethtool (apt-get install ethtool) to count bytes per segment")
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
        _segment_by_segment(hosts)
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
        ports = {_direct_port(peer) for peer in peers}
        time.sleep(window_s / 2)  # the joins' reads and stores are over
        rows = [_window(hosts, layout, urls, peer_hosts, [], window_s, "idle", param_bytes_per_stage, ports)]
        trainer_hosts = list(range(1 + layout.peers, count))
        trainers = [start("train", host, [*common, "--max_data_mb", "2", "--batch_size", "8", "--log_period_s", "10",
                                          "--trainer_seed", str(index + 1)], f"trainer{index}")
                    for index, host in enumerate(trainer_hosts)]
        for trainer in trainers:
            trainer.wait_event("trainer_ready", READY_TIMEOUT_S)
        if trainers:
            time.sleep(window_s / 2)  # past the first steps
            rows.append(_window(hosts, layout, urls, peer_hosts, trainer_hosts, window_s, "training",
                                param_bytes_per_stage, ports))
        return rows
    finally:
        stop_all(roles, 15.0)
        hosts.close()


def _window(hosts: Hosts, layout: Layout, urls: List[str], peer_hosts: List[int], trainer_hosts: List[int],
            window_s: float, phase: str, param_bytes_per_stage: int, ports: Set[int]) -> Dict[str, Any]:
    scraped = [_scrape(url) for url in urls]
    hosts_measured = [0, *peer_hosts, *trainer_hosts]
    log = _ConnectionLog(hosts, hosts_measured, ports)
    links = {host: _link_bytes(hosts, host) for host in hosts_measured}
    started = time.monotonic()
    while time.monotonic() < started + window_s:
        time.sleep(max(0.0, min(SAMPLE_PERIOD_S, started + window_s - time.monotonic())))
        log.sample()
    elapsed = time.monotonic() - started
    links_after = {host: _link_bytes(hosts, host) for host in hosts_measured}
    scraped_after = [_scrape(url) for url in urls]
    closed = sum(log.closed(host) for host in hosts_measured)
    data = {host: log.moved(host, True) for host in hosts_measured}
    p2pd = {host: log.moved(host, False) for host in hosts_measured}
    per_peer = []
    for host, (before, _), (after, scrape_cost) in zip(peer_hosts, scraped, scraped_after):
        steps = after.get("swarm_global_step", 0.0) - before.get("swarm_global_step", 0.0)
        counted = after.get(ALLREDUCE_METRIC, 0.0) - before.get(ALLREDUCE_METRIC, 0.0)
        allreduce = ALLREDUCE_HEADERS * max(0.0, counted)
        moved = links_after[host] - links[host] - scrape_cost  # the first scrape ended before the window began
        control = p2pd[host] - allreduce if trainer_hosts else moved  # idle: the whole link is control
        per_peer.append({"link": moved, "data": data[host], "allreduce": allreduce, "steps": steps,
                         "allreduce_counted": counted, "control": max(0.0, control)})
    per_trainer = [p2pd[h] / elapsed for h in trainer_hosts]
    rpc = _rpc_bytes_by_method(scraped, scraped_after, elapsed)
    by_remote = _by_remote_kind(hosts, layout, log, peer_hosts, trainer_hosts, per_peer, elapsed)
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
        "connections_closed": closed,
        # what the averagers counted a step, against one stage's float32 gradient (a robust round moves about
        # 2 x (replicas - 1) of them in and out, less the compression and for members with no samples)
        "allreduce_bytes_per_step_per_peer": round(sum(p["allreduce_counted"] for p in per_peer)
                                                   / max(1.0, sum(p["steps"] for p in per_peer)), 1),
        "gradient_bytes": param_bytes_per_stage,
        "window_s": round(elapsed, 1),
        "source": "live",
        "_control_per_peer": [round(c, 1) for c in control],
        "control_by_stage_and_remote": by_remote,
        "rpc_payload_bytes_per_s_per_peer_by_method": rpc,
        # each peer's DHT routing table at its last announce, by stage: a peer's record lands on the key's nearest
        # nodes among those it knows
        "dht_nodes_known_by_stage": _nodes_known_by_stage(layout, scraped_after),
    }


def _nodes_known_by_stage(layout: Layout, scraped: List[Tuple[Dict[str, float], int]]) -> Dict[str, List[int]]:
    out: Dict[str, List[int]] = {}
    for index, (samples, _) in enumerate(scraped):
        out.setdefault(f"stage{index % layout.stages}", []).append(int(samples.get("swarm_dht_nodes_known", -1)))
    return out


def _rpc_bytes_by_method(before: List[Tuple[Dict[str, float], int]], after: List[Tuple[Dict[str, float], int]],
                         elapsed: float) -> Dict[str, float]:
    """Mean over the peers of the payload bytes per second of their RPCs (sent and received, requests and replies)
    by method, from ``swarm_rpc_bytes_total``: which call the peers' p2pd traffic is made of, before framing."""
    sums: Dict[str, float] = {}
    for (b, _), (a, _) in zip(before, after):
        for name, value in a.items():
            if name.startswith("swarm_rpc_bytes_total{"):
                method = name.split('method="', 1)[1].split('"', 1)[0] if 'method="' in name else "?"
                sums[method] = sums.get(method, 0.0) + value - b.get(name, 0.0)
    peers = max(1, len(after))
    return {method: round(total / peers / elapsed, 1) for method, total in sorted(sums.items()) if total > 0}


def _by_remote_kind(hosts: Hosts, layout: Layout, log: _ConnectionLog, peer_hosts: List[int],
                    trainer_hosts: List[int], per_peer: List[Dict[str, float]], elapsed: float) -> Dict[str, Any]:
    """Each stage's mean control bytes per second per peer, by whom they went to and came from: the bootstrap,
    stage-mates (less what the averagers counted), peers of other stages, trainers, anyone else (the metrics
    scrapes, whose bytes the peer's total leaves out). Where a peer's control
    bytes go shows which mechanism spends them."""
    kinds = {hosts.address(0): "bootstrap", **{hosts.address(h): "trainer" for h in trainer_hosts}}
    stage_of = {hosts.address(h): index % layout.stages for index, h in enumerate(peer_hosts)}
    out: Dict[str, Dict[str, float]] = {}
    for index, (host, figures) in enumerate(zip(peer_hosts, per_peer)):
        stage = index % layout.stages
        sums = {"bootstrap": 0.0, "stage_mates": -figures["allreduce"], "other_stages": 0.0, "trainers": 0.0,
                "other": 0.0}
        for remote, moved in log.moved_by_remote(host).items():
            if remote in stage_of:
                sums["stage_mates" if stage_of[remote] == stage else "other_stages"] += moved
            else:
                sums[{"trainer": "trainers", "bootstrap": "bootstrap"}.get(kinds.get(remote, ""), "other")] += moved
        row = out.setdefault(f"stage{stage}", {k: 0.0 for k in sums})
        for key, value in sums.items():
            row[key] += value / elapsed / (layout.peers // layout.stages)
    return {stage: {k: round(v, 1) for k, v in row.items()} for stage, row in out.items()}
