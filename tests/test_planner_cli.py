"""`swarm plan` as a subprocess: scenario runs, custom networks, bad files refused cleanly."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--time_budget", "1", "--num_random", "5", "--best_of", "10"]


def _plan(*args):
    return subprocess.run([sys.executable, "-m", "peers.cli", "plan", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_plan_scenario_json():
    proc = _plan("--scenario", "regional", "--json", *FAST)
    assert proc.returncode == 0, proc.stderr
    assert "stage 0:" in proc.stdout
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(summary["stages"]) == 8
    assert summary["total_s"] == pytest.approx(summary["dp_s"] + 2 * summary["pipeline_s"])
    assert summary["total_s"] <= summary["best_of_random_s"] + 1e-9
    assert summary["total_s"] < summary["grid_s"]


def test_plan_custom_json_with_speeds(tmp_path):
    n = 4
    net = {"latency_ms": [[1.0] * n for _ in range(n)], "bandwidth_gbps": [[10.0] * n for _ in range(n)],
           "compute_tflops": [50, 50, 50, 50], "names": ["a", "b", "c", "d"]}
    path = tmp_path / "net.json"
    path.write_text(json.dumps(net))
    proc = _plan("--network", str(path), "--stages", "2", "--layers", "24", "--json", *FAST)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["compute_s"] > 0
    assert sorted(sum(summary["stages"], []) + summary["unused"]) == ["a", "b", "c", "d"]


BAD = {
    "missing.csv": ("device_a,device_b,latency_ms,bandwidth_gbps\na,b,1,1\na,c,1,1\n", "missing entry"),
    "negative.json": (json.dumps({"latency_ms": [[0, 1], [1, 0]], "bandwidth_gbps": [[0, -1], [-1, 0]]}), "negative bandwidth"),
    "shape.json": (json.dumps({"latency_ms": [[0, 1, 2], [1, 0, 2]], "bandwidth_gbps": [[0, 1], [1, 0]]}), "square"),
    "nan.json": (json.dumps({"latency_ms": [[0, 1], [1, 0]], "bandwidth_gbps": [[0, "NaN"], [1, 0]]}), "NaN"),
    "nokey.json": (json.dumps({"latency_ms": [[0, 1], [1, 0]]}), "missing 'bandwidth_gbps'"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_network_file_refused(tmp_path, name):
    text, message = BAD[name]
    path = tmp_path / name
    path.write_text(text)
    proc = _plan("--network", str(path), "--stages", "1", "--layers", "1", *FAST)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
