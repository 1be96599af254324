"""Helpers the benchmarks measure and report with: stopping the swarm's processes while the single process
runs, combining a phase's windows into one figure and comparing it with each baseline (pipeline), the
policy-on and policy-off runs side by side (slow_peer), when an attacker counts as excluded (attacks), and
what repeated runs add up to (fuzz, churn). No live swarm."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.utils.benchmark_modules import load_benchmark


def _state(pid: int) -> str:
    raw = Path(f"/proc/{pid}/stat").read_text()
    return raw[raw.rindex(")") + 2]


def _wait_state(pid: int, wanted: str, timeout: float = 5.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = _state(pid)
        if (state == "T") == (wanted == "T"):
            return state
        time.sleep(0.02)
    return _state(pid)


@pytest.fixture
def process_tree():
    """A parent that forked a child, both sleeping; both killed at the end."""
    code = ("import subprocess, sys, time; "
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(child.pid, flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    yield parent.pid, child_pid
    for pid in (child_pid, parent.pid):
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    parent.wait(timeout=10)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc (Linux)")
def test_paused_stops_a_whole_tree_and_continues_it_also_on_error(process_tree):
    roles = load_benchmark("_roles")
    parent, child = process_tree
    with roles.paused([parent]) as stopped:
        assert sorted(stopped) == sorted([parent, child])
        assert _wait_state(parent, "T") == "T" and _wait_state(child, "T") == "T"
    assert _wait_state(parent, "S") != "T" and _wait_state(child, "S") != "T"

    with pytest.raises(RuntimeError):
        with roles.paused([parent]):
            assert _wait_state(child, "T") == "T"
            raise RuntimeError("a window failed")
    assert _wait_state(parent, "S") != "T" and _wait_state(child, "S") != "T"


def test_paused_leaves_the_calling_process_running():
    roles = load_benchmark("_roles")
    with roles.paused([os.getpid()]) as stopped:
        assert os.getpid() not in stopped
        assert _state(os.getpid()) != "T"


def test_windows_combine_into_totals_and_weighted_means():
    pipeline = load_benchmark("pipeline")
    window = lambda elapsed, samples, mbs, latency, cpu, before: {  # noqa: E731
        "in_flight": 4, "elapsed_s": elapsed, "samples": samples, "micro_batches": mbs,
        "tokens_per_s": samples * 128 / elapsed, "latency_ms": latency, "calls_ms": {"forward0": latency / 2},
        "failed": 1, "cpu_s": {"peer0 python": cpu, "machine": 2 * cpu}, "single_before": before}
    phase = pipeline.combine_windows([window(2.0, 64, 4, 100.0, 1.0, 0), window(6.0, 64, 12, 200.0, 3.0, 1)])
    assert phase["elapsed_s"] == 8.0 and phase["samples"] == 128 and phase["micro_batches"] == 16
    assert phase["tokens_per_s"] == pytest.approx(128 * 128 / 8.0)  # total tokens over total time, not a mean of rates
    assert phase["latency_ms"] == pytest.approx((4 * 100 + 12 * 200) / 16)
    assert phase["calls_ms"]["forward0"] == pytest.approx((4 * 50 + 12 * 100) / 16)
    assert phase["failed"] == 2
    assert phase["cpu_s_per_micro_batch"]["peer0 python"] == pytest.approx(4.0 / 16)
    assert phase["cores_busy"]["machine"] == pytest.approx(8.0 / 8.0)
    assert [w["single_before"] for w in phase["windows"]] == [0, 1]


def test_a_baseline_pools_its_windows_tokens_over_their_seconds():
    pipeline = load_benchmark("pipeline")
    fast, slow = {"tokens_per_s": 5000.0, "wall_s": 2.0}, {"tokens_per_s": 2500.0, "wall_s": 4.0}
    assert pipeline.pooled_tokens_per_s([fast, slow]) == pytest.approx(20000 / 6.0)
    assert pipeline.pooled_tokens_per_s([fast]) == 5000.0


def test_a_phase_is_compared_with_each_baseline_in_the_windows_around_its_own():
    pipeline = load_benchmark("pipeline")
    phase = {"tokens_per_s": 450.0, "windows": [{"tokens_per_s": 300.0, "single_before": 0},
                                                {"tokens_per_s": 600.0, "single_before": 1}]}
    baseline = [{"tokens_per_s": 100.0, "wall_s": 1.0}, {"tokens_per_s": 200.0, "wall_s": 1.0},
                {"tokens_per_s": 300.0, "wall_s": 2.0}, {"tokens_per_s": 9999.0, "wall_s": 1.0}]  # the last: not around
    found = pipeline.against(phase, baseline)
    assert found["tokens_per_s"] == pytest.approx((100 + 200 + 600) / 4)
    assert found["ratio"] == pytest.approx(450 / 225)
    assert found["ratio_by_window"] == pytest.approx([300 / 150, 600 / ((200 + 600) / 3)])


def test_a_baseline_on_several_threads_counts_the_cpu_of_its_whole_process():
    pipeline = load_benchmark("pipeline")
    window = lambda tokens, cpu, process, busy: {"micro_batches": 2, "wall_s": 1.0, "tokens_per_s": tokens,  # noqa: E731
                                                 "cpu_s": cpu, "process_cpu_s": process, "busy_s": busy}
    parts = [window(100.0, 0.5, 0.9, 1.5), window(300.0, 0.3, 0.7, 0.5)]
    one_thread, wide = pipeline.combine_single(parts), pipeline.combine_single(parts, "process_cpu_s")
    assert one_thread["cpu_ms_per_micro_batch"] == pytest.approx(200.0)
    assert wide["cpu_ms_per_micro_batch"] == pytest.approx(400.0)
    assert wide["cpu_ms_per_micro_batch_by_window"] == pytest.approx([450.0, 350.0])
    assert wide["tokens_per_s"] == pytest.approx(200.0) and wide["machine_cores_busy"] == pytest.approx(1.0)


def _slow_run(ratio, policy, share=0.0):
    return {"slowdown": 5.0, "policy": policy, "throughput_ratio_after_vs_before": ratio,
            "slow_replica_share_of_stage0": share, "stood_by": policy == "on"}


def test_the_slow_peer_entry_reports_the_policy_off_runs_beside_the_policy_on_ones():
    slow_peer = load_benchmark("slow_peer")
    runs = {"on": [_slow_run(1.0, "on"), _slow_run(0.9, "on"), _slow_run(1.1, "on")],
            "off": [_slow_run(0.8, "off", 0.3), _slow_run(0.7, "off", 0.4), _slow_run(0.85, "off", 0.2)]}
    entry = slow_peer.combine_policies(5.0, runs, {"on": 1.0, "off": 0.85})
    assert entry["policy"] == "on" and entry["throughput_ratio_after_vs_before"] == 1.0
    assert entry["ratios"] == [1.0, 0.9, 1.1]
    assert entry["throughput_ratio_after_vs_before_policy_off"] == 0.8
    assert entry["ratios_policy_off"] == [0.8, 0.7, 0.85]
    assert entry["slow_replica_share_of_stage0_policy_off"] == 0.3
    assert slow_peer.median_of_policy(entry, "off")["policy"] == "off"
    assert entry["simulated"] == {"on": 1.0, "off": 0.85}

    alone = slow_peer.combine_policies(5.0, {"off": runs["off"]}, {"on": None, "off": None})
    assert alone["policy"] == "off" and "policy_off" not in alone
    assert slow_peer.median_of_policy(alone, "on") is None and slow_peer.median_of_policy(alone, "off") is alone


def test_the_simulator_ratio_is_taken_at_the_slowdown_asked_for():
    slow_peer = load_benchmark("slow_peer")
    simulated = {"policy": [{"slowdown": 5.0, "throughput_ratio_after_vs_before": 1.0},
                            {"slowdown": 50.0, "throughput_ratio_after_vs_before": 0.99}],
                 "naive": [{"slowdown": 5.0, "throughput_ratio_after_vs_before": 0.85},
                           {"slowdown": 50.0, "throughput_ratio_after_vs_before": 0.81}]}
    assert slow_peer.simulated_ratios(simulated, 50.0) == {"on": 0.99, "off": 0.81}
    assert slow_peer.simulated_ratios(simulated, 7.0) == {"on": None, "off": None}


def test_an_attacker_counts_as_excluded_only_when_it_is_banned_or_refused():
    roles = load_benchmark("_attacks_roles")
    a = "QmAttacker1"
    for line in (f"banning peer {a} of stage 0: its forward reply was outvoted by QmB and QmC (outputs)",
                 f"stage 1: excluding {a} from averaging: sent a gradient 900x farther from the robust mean",
                 f"stage 0: refusing the state downloaded from {a}: its digest is not the stage's",
                 f"refusing calls from unauthorized peer {a}",
                 f"stage 1 s1: down-weighting trainer {a} to 0.0: its targets cost persistently more than expected",
                 f"stage 1 s1: down-weighting trainer {a} to 0: its targets cost persistently more than expected"):
        assert roles.excludes(line, a), line
    for line in (f"stage 0 s0: clipped micro-batches of trainer {a} in step 3: the largest had 40 times the bound",
                 f"stage 1 s1: down-weighting trainer {a} to 0.05: its targets cost persistently more than expected",
                 f"stage 0: ignoring the claims of {a} for 30s: claimed 100000 samples",
                 f"stage 1 forward failed on {a}: TimeoutError; trying another replica",
                 "banning peer QmOther of stage 0: bad reply",
                 f"banning peer {a}2 of stage 0: bad reply"):  # another id that starts with the attacker's
        assert not roles.excludes(line, a), line


def test_the_first_warning_and_the_first_exclusion_are_told_apart(tmp_path):
    roles = load_benchmark("_attacks_roles")
    a = "QmAttacker1"
    replica, trainer = tmp_path / "s1p0.log", tmp_path / "trainer0.log"
    replica.write_text(
        f"Mar 05 12:00:01.000 [WARN] [swarm.server.runner] stage 1 s1: clipped micro-batches of trainer {a} in step 0\n"
        "Traceback (most recent call last):\n"
        f"Mar 05 12:00:09.500 [WARN] [swarm.server.runner] stage 1 s1: down-weighting trainer {a} to 0.0: targets\n")
    trainer.write_text(
        f"Mar 05 12:00:05.000 [INFO] [swarm.client.pipeline] banning peer {a} of stage 0: only INFO\n"
        f"Mar 05 12:00:07.250 [WARN] [swarm.client.pipeline] banning peer {a} of stage 0: bad reply\n")
    warned, excluded = roles.first_warning([replica, trainer], a), roles.first_exclusion([replica, trainer], a)
    assert warned[1] == "s1p0" and "clipped" in warned[0].message
    assert excluded[1] == "trainer0" and excluded[0].message.startswith(f"banning peer {a}")
    assert excluded[0].t - warned[0].t == pytest.approx(6.25)
    assert roles.first_exclusion([replica], "QmNobody") is None


def _fuzz_repeat(repeat, ratio, requests, unexpected, tracebacks, rss_clean, rss_fuzz):
    return {"repeat": repeat, "clean_samples_per_s": 10.0, "fuzz_samples_per_s": 10.0 * ratio,
            "throughput_ratio_during_fuzz": ratio, "requests": requests, "requests_per_s": requests / 60,
            "answered_with_error": requests - 1, "unexpected": unexpected, "tracebacks": tracebacks,
            "max_rss_mb_clean": rss_clean, "max_rss_mb_fuzz": rss_fuzz, "fuzzer_cpu_s": 3.0,
            "trainer_clean": {"samples_per_s": 10.0}, "trainer_fuzz": {"samples_per_s": 10.0 * ratio},
            "outcomes": {"error": requests - 1, "ok": 1}, "error_kinds": {"bad_request": requests - 1},
            "families": {"raw": requests}, "dht_junk": {"peers": 2}, "notes": []}


def test_fuzz_repeats_add_up_their_counts_and_report_the_spread_of_every_figure():
    fuzz = load_benchmark("fuzz")
    repeats = [_fuzz_repeat(0, 0.9, 100, 0, 0, 300.0, 320.0), _fuzz_repeat(1, 0.7, 120, 1, 2, 330.0, 310.0),
               _fuzz_repeat(2, 1.0, 110, 0, 0, 305.0, 315.0)]
    result = fuzz.summarize(repeats, crashes=0, log_dir=Path("/tmp/logs"))
    assert result["requests"] == 330 and result["unexpected"] == 1 and result["tracebacks"] == 2
    assert result["throughput_ratio_during_fuzz"] == 0.9  # the median repeat's, not a mean
    assert result["spread"]["throughput_ratio_during_fuzz"] == {
        "n": 3, "missing": 0, "min": 0.7, "median": 0.9, "max": 1.0}
    assert result["max_rss_mb"] == 330.0 and result["max_rss_mb_clean"] == 330.0
    assert result["outcomes"] == {"error": 327, "ok": 3} and result["dht_junk"] == {"peers": 6}
    assert [r["repeat"] for r in result["repeats"]] == [0, 1, 2] and "outcomes" not in result["repeats"][0]

    one = fuzz.summarize(repeats[:1], crashes=1, log_dir=Path("/tmp/logs"))
    assert one["throughput_ratio_during_fuzz"] == 0.9 and one["requests"] == 100 and one["crashes"] == 1
    assert one["trainer_clean"] == {"samples_per_s": 10.0}


def _churn_repeat(repeat, ratio, lost, stall):
    figures = {"throughput_ratio_vs_no_churn": ratio, "lost": lost, "max_stall_s": stall, "churn_samples_per_s": 20.0,
               "baseline_samples_per_s": None if ratio is None else 20.0 / ratio, "baseline_max_stall_s": 1.0,
               "baseline_lost": 0, "failed_micro_batches": 0, "resent": 3, "kills": 2, "joins": 2}
    return {"repeat": repeat, **figures, "events": [], "samples_sent": 100}


def test_churn_repeats_report_the_median_ratio_repeat_the_worst_loss_and_the_spread():
    churn = load_benchmark("churn")
    repeats = [_churn_repeat(0, 0.8, 0, 4.0), _churn_repeat(1, 0.95, 5, 2.0), _churn_repeat(2, 0.9, 0, 3.0)]
    result = churn.summarize(repeats, no_baseline=False)
    assert result["repeat"] == 2 and result["throughput_ratio_vs_no_churn"] == 0.9  # a real run, the median one
    assert result["lost"] == 0 and result["lost_max"] == 5  # one repeat lost samples: the top run must not hide it
    assert result["spread"]["max_stall_s"] == {"n": 3, "missing": 0, "min": 2.0, "median": 3.0, "max": 4.0}
    assert [r["repeat"] for r in result["repeats"]] == [0, 1, 2] and "events" not in result["repeats"][0]

    alone = churn.summarize([_churn_repeat(0, None, 1, 4.0), _churn_repeat(1, None, 0, 2.0)], no_baseline=True)
    assert alone["repeat"] == 0 and alone["spread"]["throughput_ratio_vs_no_churn"]["missing"] == 2


def test_an_attack_record_keeps_every_run_by_label_and_the_exclusion_beside_the_first_warning(tmp_path):
    attacks = load_benchmark("attacks")
    clean = [{"label": "clean_s0_on", "heldout_loss": h, "loss": 5.0, "throughput_samples_per_s": t,
              "peer_cpu_ms_per_sample": 30.0, "samples_lost": 0} for h, t in ((4.9, 16.0), (4.8, 15.0))]
    clipped = {"label": "scaled_grad_outputs_on", "heldout_loss": 4.85, "loss": 5.1, "throughput_samples_per_s": 17.0,
               "peer_cpu_ms_per_sample": 31.0, "samples_lost": 0, "attacker_excluded_after_s": None,
               "attacker_first_warning_after_s": 4.7}
    failed = {"label": "nan_gradients_on", "defences": True, "error": "TimeoutError: no peer"}
    row = {"attack": "scaled_grad_outputs", "heldout_loss_clean": 4.9, "heldout_loss_defended": 4.85,
           "heldout_loss_undefended": None, "attacker_excluded_after_s": None, "attacker_first_warning_after_s": 4.7,
           "throughput_ratio_defended_vs_clean": 1.06, "undefended_diverged": None}
    args = argparse.Namespace(results_dir=str(tmp_path), no_record=False, attacks="scaled_grad_outputs")
    attacks.record(args, [row], [*clean, clipped, failed])

    record = json.loads(next((tmp_path / "attacks").glob("*.json")).read_text())
    assert record["raw"]["heldout_loss[clean_s0_on]"] == [4.9, 4.8]
    assert "attacker_excluded_after_s[clean_s0_on]" not in record["raw"]
    assert record["raw"]["attacker_excluded_after_s[scaled_grad_outputs_on]"] == [None]  # clipped, never banned
    assert record["raw"]["attacker_first_warning_after_s[scaled_grad_outputs_on]"] == [4.7]
    assert record["raw"]["heldout_loss[nan_gradients_on]"] == [None]  # a failed run is missing, not dropped
    assert record["headline"][0]["excluded_after_s"] is None and record["headline"][0]["first_warning_after_s"] == 4.7


def test_fuzz_and_churn_records_keep_one_raw_value_per_repeat(tmp_path):
    fuzz, churn = load_benchmark("fuzz"), load_benchmark("churn")
    args = argparse.Namespace(results_dir=str(tmp_path), no_record=False)
    fuzzed = [_fuzz_repeat(0, 0.9, 100, 0, 0, 300.0, 320.0), _fuzz_repeat(1, 0.7, 120, 1, 2, 330.0, 310.0)]
    fuzz.record(args, fuzz.summarize(fuzzed, crashes=0, log_dir=tmp_path))
    churn.record(args, churn.summarize([_churn_repeat(0, 0.8, 0, 4.0), _churn_repeat(1, None, 2, 3.0)], False))
    fuzz_record = json.loads(next((tmp_path / "fuzz").glob("*.json")).read_text())
    churn_record = json.loads(next((tmp_path / "churn").glob("*.json")).read_text())
    assert fuzz_record["raw"]["throughput_ratio_during_fuzz"] == [0.9, 0.7]
    assert fuzz_record["headline"]["throughput_ratio_during_fuzz (min)"] == 0.7
    assert churn_record["raw"]["throughput_ratio_vs_no_churn"] == [0.8, None]  # a failed baseline stays visible
    assert churn_record["headline"]["lost_max"] == 2
