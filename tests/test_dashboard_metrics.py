"""The dashboard's Prometheus metrics: the families of a hand-made state, and ``/metrics`` of a live dashboard."""

from __future__ import annotations

import socket
from typing import Dict

import pytest
from prometheus_client import generate_latest

from peers.dashboard import DashboardConfig
from swarm.dashboard.history import History
from swarm.dashboard.join import JoinInfo
from swarm.dashboard.metrics import dashboard_families, dashboard_registry
from swarm.dashboard.server import StateBox
from swarm.dashboard.state import Snapshot, build_state
from swarm.dht.records import AccusationRecord, PeerRecord, TrainerRecord
from tests.utils.processes import RoleProcess, stop_all
from tests.test_metrics import free_port, samples_of, wait_for_scrape

Samples = Dict[str, float]


def peer(peer_id: str, stage: int, step: int, throughput: float, state: str = "online", excluded: str = "") -> PeerRecord:
    return PeerRecord(version=1, peer_id=peer_id, stage=stage, state=state, throughput=throughput, queue_length=1,
                      step=step, accum_step=step, samples_pending=0, samples_applied=0, excluded=excluded)


def trainer(trainer_id: str, loss, samples_per_s: float) -> TrainerRecord:
    return TrainerRecord(version=1, trainer_id=trainer_id, samples_sent=10, loss=loss, samples_per_s=samples_per_s,
                         tokens_per_s=samples_per_s * 16)


def state_of(snapshot: Snapshot, num_stages: int = 2) -> dict:
    return build_state(snapshot, History(10), JoinInfo("r", num_stages), uptime_s=5.0)


def a_run() -> Snapshot:
    """Stage 0: two online replicas and one joining; stage 1: three replicas, x1 banned by both stage-mates and
    accused by a trainer; two trainers, one without a loss yet."""
    peers = [peer("a0", 0, 6, 20.0), peer("b0", 0, 6, 30.0), peer("c0", 0, 0, 0.0, state="joining"),
             peer("x1", 1, 7, 5.0, excluded="y1"), peer("y1", 1, 7, 6.0, excluded="x1"), peer("z1", 1, 7, 7.0, excluded="x1")]
    accusation = AccusationRecord(version=1, trainer_id="t1", accused="x1", witness="y1", referee="z1", stage=1,
                                  method="forward", step=7, inputs_hash="i", accused_hash="a", witness_hash="w")
    return Snapshot(peers={p.peer_id: p for p in peers}, trainers={"t1": trainer("t1", 4.5, 12.0),
                                                                   "t2": trainer("t2", None, 8.0)},
                    accusations={"t1": accusation}, fetched_at=1000.0)


def exposition(state: dict, now: float) -> Samples:
    box = StateBox(state)
    return samples_of(generate_latest(dashboard_registry(box, peer_id="D", clock=lambda: now)).decode())


def test_families_say_what_the_state_says():
    got = exposition(state_of(a_run()), now=1012.5)
    assert got['swarm_info{peer_id="D",role="dashboard",run_id="r"}'] == 1
    assert got["swarm_dashboard_global_step"] == 7 and got["swarm_dashboard_loss"] == 4.5
    assert got['swarm_dashboard_replicas{stage="0"}'] == 2 and got['swarm_dashboard_replicas{stage="1"}'] == 3
    assert got['swarm_dashboard_peers{stage="0",state="joining"}'] == 1
    assert got['swarm_dashboard_peers{stage="0",state="online"}'] == 2
    assert got['swarm_dashboard_peers{stage="1",state="leaving"}'] == 0
    assert got['swarm_dashboard_stage_throughput_samples_per_second{stage="0"}'] == 50.0
    assert got["swarm_dashboard_peers_online"] == 5 and got["swarm_dashboard_trainers"] == 2
    assert got["swarm_dashboard_samples_per_second"] == 20.0 and got["swarm_dashboard_tokens_per_second"] == 320.0
    assert got["swarm_dashboard_banned_peers"] == 1 and got["swarm_dashboard_accusations"] == 1
    assert got["swarm_dashboard_poll_ok"] == 1 and got["swarm_dashboard_last_poll_age_seconds"] == 12.5
    assert "process_resident_memory_bytes" in got


def test_unknown_figures_are_left_out_and_a_failed_poll_shows():
    empty = state_of(Snapshot(fetched_at=1000.0, error="no DHT snapshot yet"), num_stages=3)
    got = exposition(empty, now=1030.0)
    assert "swarm_dashboard_global_step" not in got and "swarm_dashboard_loss" not in got
    assert [got[f'swarm_dashboard_replicas{{stage="{s}"}}'] for s in range(3)] == [0, 0, 0]
    assert got["swarm_dashboard_poll_ok"] == 0 and got["swarm_dashboard_last_poll_age_seconds"] == 30.0
    assert got["swarm_dashboard_trainers"] == 0 and got["swarm_dashboard_banned_peers"] == 0
    # a non-finite value is unknown too; a clock behind the poll never gives a negative age
    odd = {**empty, "global_step": float("nan"), "swarm": {**empty["swarm"], "loss": float("inf")}}
    names = [f.name for f in dashboard_families(odd, now=900.0)]
    assert "swarm_dashboard_global_step" not in names and "swarm_dashboard_loss" not in names
    assert exposition(empty, now=900.0)["swarm_dashboard_last_poll_age_seconds"] == 0


def test_config_refuses_bad_metrics_ports():
    assert DashboardConfig().metrics_port == 0 and DashboardConfig().metrics_host == "127.0.0.1"
    for bad in (-1, 65536, True):
        with pytest.raises(ValueError, match="metrics_port"):
            DashboardConfig(metrics_port=bad)


def test_live_dashboard_serves_metrics_and_a_busy_metrics_port_exits_with_2(tmp_path):
    port = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        # both at once: each imports torch. The live one reads a DHT of its own (no swarm).
        roles = [RoleProcess("dashboard", ["--run_id", "lone", "--num_stages", "2", "--port", "0", "--period_s", "0.5",
                                           "--metrics_port", str(port)], tmp_path, "live"),
                 RoleProcess("dashboard", ["--port", "0", "--metrics_port", str(taken)], tmp_path, "busy")]
        try:
            live, refused = roles
            url = live.wait_event("dashboard_ready", timeout=60)["metrics"]
            assert url == f"http://127.0.0.1:{port}/metrics"
            got = wait_for_scrape(url, lambda s: s.get("swarm_dashboard_poll_ok") == 1, 30, "a successful poll")
            assert got['swarm_info{peer_id="%s",role="dashboard",run_id="lone"}' % _peer_id(got)] == 1
            assert got['swarm_dashboard_replicas{stage="1"}'] == 0 and got["swarm_dashboard_trainers"] == 0
            assert "swarm_dashboard_global_step" not in got and got["swarm_dashboard_last_poll_age_seconds"] < 10
            assert refused.proc.wait(timeout=60) == 2, refused.log_tail()
            log = refused.log_path.read_text()
            assert f"cannot serve metrics on 127.0.0.1:{taken}" in log and "Traceback" not in log, log[-2000:]
        finally:
            stop_all(roles, timeout=5)


def _peer_id(samples: Samples) -> str:
    keys = [k for k in samples if k.startswith("swarm_info{")]
    assert len(keys) == 1, keys
    peer_id = keys[0].split('peer_id="', 1)[1].split('"', 1)[0]
    assert peer_id, "the dashboard names its DHT peer id"
    return peer_id
