"""Prometheus metrics: the module alone, the join summary and progress line, and /metrics of a live peer and trainer."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from typing import Callable, Dict

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from peers._common import parameter_count
from peers.peer import progress_line
from swarm.config.settings import PeerConfig, TrainerConfig
from swarm.model.footprint import (COMPUTE_BYTES_PER_PARAMETER, OPTIMIZER_BYTES_PER_PARAMETER, expected_footprint,
                             stage_parameter_counts)
from swarm.metrics import (
    MetricsPortError, PeerSnapshot, TrainerSnapshot, count_ban, count_dht, count_rpc_bytes, method_label, new_registry,
    observe_allreduce, peer_families, start_metrics_server, trainer_families,
)
from swarm.model.gpt import ModelConfig
from swarm.model.stages import build_stage
from tests.utils.processes import REPO

TINY = ModelConfig(num_layers=3, hidden_size=32, num_heads=2, seq_len=16)
Samples = Dict[str, float]


def samples_of(text: str) -> Samples:
    """``name{label="value",...}`` -> value, for every sample of an exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=5) as response:
        return samples_of(response.read().decode())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_state(**changes) -> PeerSnapshot:
    values = dict(run_id="r", peer_id="P", state="online", stage=1, step=3, samples_processed=120, samples_applied=96,
                  samples_pending=24, queue_length=2, in_flight=1, throughput=55.5, forwards=10, recomputed=4,
                  forward_cache={"hits": 6, "misses": 4, "evicted": 1, "mismatched": 0, "bytes": 1024},
                  banned_replicas=1, allreduce_bytes=4096, dht_nodes_known=7)
    return PeerSnapshot(**{**values, **changes})


def trainer_state(**changes) -> TrainerSnapshot:
    values = dict(run_id="r", trainer_id="T", samples_sent=64, micro_batches_failed=1, resent=2, uncommitted=5,
                  samples_committed={0: 48, 1: 40}, loss=4.25, samples_per_s=12.0, tokens_per_s=192.0, global_step=7,
                  banned_peers=1)
    return TrainerSnapshot(**{**values, **changes})


# ---- the module alone ----

def exposition(families) -> Samples:
    registry = new_registry()

    class Fixed:
        def collect(self):
            return families

    registry.register(Fixed())
    return samples_of(generate_latest(registry).decode())


def test_peer_families_say_what_the_snapshot_says():
    got = exposition(peer_families(peer_state()))
    assert got['swarm_info{peer_id="P",role="peer",run_id="r"}'] == 1
    assert got["swarm_global_step"] == 3 and got["swarm_peer_samples_processed_total"] == 120
    assert got["swarm_peer_queue_length"] == 2 and got["swarm_peer_throughput_samples_per_second"] == 55.5
    assert got['swarm_peer_state{state="online"}'] == 1 and got['swarm_peer_state{state="joining"}'] == 0
    assert got["swarm_peer_forward_cache_hits_total"] == 6 and got["swarm_peer_banned_replicas"] == 1
    assert got["swarm_peer_allreduce_bytes_total"] == 4096 and got["swarm_dht_nodes_known"] == 7
    joining = exposition(peer_families(peer_state(state="joining", stage=None, forward_cache={})))
    assert joining["swarm_peer_stage"] == -1 and joining['swarm_peer_state{state="joining"}'] == 1
    assert not any(name.startswith("swarm_peer_forward_cache") for name in joining)


def test_trainer_families_say_what_the_snapshot_says():
    got = exposition(trainer_families(trainer_state()))
    assert got["swarm_trainer_loss"] == 4.25 and got["swarm_trainer_samples_sent_total"] == 64
    assert got["swarm_trainer_samples_per_second"] == 12.0 and got["swarm_global_step"] == 7
    assert got['swarm_trainer_samples_committed_total{stage="1"}'] == 40 and got["swarm_trainer_resent_total"] == 2
    for missing in (None, float("nan")):  # no micro-batch yet, or a non-finite loss: no loss sample at all
        assert "swarm_trainer_loss" not in exposition(trainer_families(trainer_state(loss=missing)))


def test_event_helpers_count_into_every_registry():
    first, second = new_registry(), new_registry()
    before = [samples_of(generate_latest(r).decode()) for r in (first, second)]
    count_rpc_bytes("forward", "sent", 1000)
    count_ban("trainer", "timeout")
    observe_allreduce(0.3, ok=False)
    observe_allreduce(1.5, ok=True)
    count_dht("read", True, keys=3)
    count_dht("store", False)
    for registry, old in zip((first, second), before):
        new = samples_of(generate_latest(registry).decode())
        delta = lambda key: new[key] - old.get(key, 0.0)
        assert delta('swarm_rpc_bytes_total{direction="sent",method="forward"}') == 1000
        assert delta('swarm_bans_total{reason="timeout",role="trainer"}') == 1
        assert delta("swarm_allreduce_failures_total") == 1
        assert delta('swarm_allreduce_duration_seconds_count{outcome="done"}') == 1
        assert delta('swarm_allreduce_duration_seconds_bucket{le="0.5",outcome="failed"}') == 1
        assert delta('swarm_dht_keys_total{operation="read",outcome="ok"}') == 3
        assert delta('swarm_dht_keys_total{operation="store",outcome="failed"}') == 1
        assert "process_resident_memory_bytes" in new


def test_method_labels_are_bounded():
    assert method_label("forward", {"forward", "backward"}) == "forward"
    assert method_label("x" * 5000, {"forward"}) == "other"
    assert method_label("step_members") == "step_members"
    for odd in ("A" * 10, "a" * 100, "../etc", "", "forward\n"):
        assert method_label(odd) == "other"


def test_server_serves_the_registry_and_a_busy_port_is_a_clear_error():
    registry = new_registry()

    class Fixed:
        def collect(self):
            return peer_families(peer_state(step=11))

    registry.register(Fixed())
    server = start_metrics_server(0, registry)
    try:
        assert scrape(server.url)["swarm_global_step"] == 11
        with pytest.raises(MetricsPortError, match=f"127.0.0.1:{server.port}"):
            start_metrics_server(server.port, new_registry())
    finally:
        server.shutdown()
    with pytest.raises(ValueError, match="metrics_port"):
        start_metrics_server(70000, registry)


def test_config_refuses_bad_metrics_ports():
    for cls in (PeerConfig, TrainerConfig):
        assert cls().metrics_port == 0
        for bad in (-1, 65536, True):
            with pytest.raises(ValueError, match="metrics_port"):
                cls(metrics_port=bad)


# ---- what a joining peer is told, and its progress line ----

def test_stage_parameter_counts_match_the_stages():
    counts = stage_parameter_counts(TINY, 2)
    assert counts == [sum(p.numel() for p in build_stage(TINY, s, 2, seed=0).parameters()) for s in range(2)]
    assert sum(counts) == parameter_count(TINY)


def test_footprint_of_a_stage_and_of_auto():
    last = expected_footprint(TINY, 2, 1, forward_cache_mb=64)
    assert last.cache_bytes == 0, "the last stage caches no forwards"
    parameters = stage_parameter_counts(TINY, 2)[1]
    assert last.state_bytes == parameters * (COMPUTE_BYTES_PER_PARAMETER + OPTIMIZER_BYTES_PER_PARAMETER)
    assert last.host_bytes == 0, "on the CPU the optimizer's state is in state_bytes"
    on_gpu = expected_footprint(TINY, 2, 1, forward_cache_mb=64, device="cuda:0")
    assert on_gpu.state_bytes == parameters * COMPUTE_BYTES_PER_PARAMETER, "the optimizer's state stays in host memory"
    assert on_gpu.host_bytes == parameters * (OPTIMIZER_BYTES_PER_PARAMETER + 4), "with a host copy of the weights"
    first = expected_footprint(TINY, 2, 0, forward_cache_mb=64)
    assert first.cache_bytes == 64 * 2**20 and first.device_bytes == first.state_bytes + first.cache_bytes
    auto = expected_footprint(TINY, 2, "auto", forward_cache_mb=64)
    assert auto.parameters == max(stage_parameter_counts(TINY, 2))
    assert auto.device_bytes >= max(first.device_bytes, last.device_bytes)


def test_progress_line():
    line = progress_line(peer_state())
    assert line == "online stage 1 | step 3 | processed 120 samples (pending 24) | 55.5 samples/s | queue 2"
    assert progress_line(peer_state(state="joining", stage=None)).startswith("joining stage ?")


# ---- live ----

def test_a_busy_metrics_port_ends_a_role_with_exit_code_2():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for role in ("peer", "train"):
            result = subprocess.run([sys.executable, "-m", "peers.cli", role, "--metrics_port", str(port)], cwd=REPO, capture_output=True, text=True, timeout=120)
            assert result.returncode == 2, (role, result.stderr[-2000:])
            assert f"cannot serve metrics on 127.0.0.1:{port}" in result.stderr, result.stderr[-2000:]
            assert "Traceback" not in result.stderr, result.stderr[-2000:]


def wait_for_scrape(url: str, predicate: Callable[[Samples], bool], timeout: float, what: str) -> Samples:
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        last = scrape(url)
        if predicate(last):
            return last
        time.sleep(0.5)
    raise AssertionError(f"no {what} within {timeout}s; last scrape: { {k: v for k, v in (last or {}).items() if k.startswith('swarm_')} }")


def test_live_peer_and_trainer_serve_metrics_that_move(launcher):
    launcher.bootstrap()
    ports = [free_port() for _ in range(3)]
    peers = [launcher.peer(stage, target_batch_size=32, extra=["--metrics_port", str(port)])
             for stage, port in zip((0, 1), ports)]
    urls = [peer.wait_event("peer_ready", timeout=5)["metrics"] for peer in peers]
    assert urls == [f"http://127.0.0.1:{port}/metrics" for port in ports[:2]]
    idle = scrape(urls[1])
    assert idle["swarm_global_step"] == 0 and idle["swarm_peer_samples_processed_total"] == 0
    assert idle['swarm_peer_state{state="online"}'] == 1 and idle["swarm_peer_stage"] == 1
    trainer = launcher.trainer(target_batch_size=32, extra=["--metrics_port", str(ports[2]), "--batch_size", "8"])
    trainer_url = trainer.wait_event("trainer_ready", timeout=90)["metrics"]
    assert trainer_url == f"http://127.0.0.1:{ports[2]}/metrics"
    last = wait_for_scrape(urls[1], lambda s: s["swarm_global_step"] >= 1, 120, "a global step at the last stage")
    assert last["swarm_peer_samples_processed_total"] >= 32
    assert last['swarm_rpc_bytes_total{direction="received",method="backward"}'] > 0
    first = scrape(urls[0])
    assert first["swarm_peer_samples_processed_total"] >= 32
    assert first['swarm_rpc_bytes_total{direction="sent",method="forward"}'] > 0
    assert first['swarm_dht_keys_total{operation="store",outcome="ok"}'] > 0  # its record, announced
    assert first['swarm_dht_keys_total{operation="read",outcome="ok"}'] > 0  # its stage's records, polled
    seen = wait_for_scrape(trainer_url, lambda s: "swarm_trainer_loss" in s and s["swarm_global_step"] >= 1, 60,
                           "a loss and the global step at the trainer")
    assert 0 < seen["swarm_trainer_loss"] < 20 and seen["swarm_trainer_samples_sent_total"] >= 32
    assert seen['swarm_rpc_bytes_total{direction="sent",method="backward"}'] > 0
    later = wait_for_scrape(trainer_url, lambda s: s["swarm_trainer_samples_sent_total"] > seen["swarm_trainer_samples_sent_total"],
                            60, "more samples sent")
    assert later["swarm_trainer_samples_per_second"] > 0
