"""Benchmark records and the page made from them: what a record holds, where it goes, how a spread counts
failed runs, and that docs/benchmarks.md shows the newest record of each benchmark and names the rest.

No live swarm: records are written to a temporary folder by the same functions the scripts call."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from tests.utils.benchmark_modules import load_benchmark

report = load_benchmark("report")
records = sys.modules["_records"]  # the module the scripts and the report import: one RecordError class for all


def _args(tmp_path: Path, **extra) -> argparse.Namespace:
    return argparse.Namespace(results_dir=str(tmp_path), no_record=False, seed=0, **extra)


def _write(tmp_path: Path, benchmark: str, date: datetime, commit: str, raw: dict, headline=None) -> Path:
    """A record as write_record makes it, with its date and commit set, so that ordering can be tested."""
    record = records.build_record(benchmark, _args(tmp_path), {"figure": 1.0}, raw, headline=headline,
                                  notes=["a note"], finished=date)
    record["git"] = {**record["git"], "commit": commit * 40, "short": commit * 7, "dirty": False, "dirty_paths": []}
    path = records.record_path(tmp_path, benchmark, date, commit * 7)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))
    return path


# ---- spread ----

def test_a_spread_counts_failed_runs_as_missing_instead_of_dropping_them_silently():
    assert records.spread([3.0, None, 1.0, math.nan, 2.0, math.inf]) == {
        "n": 3, "missing": 3, "min": 1.0, "median": 2.0, "max": 3.0}
    assert records.spread([4, 1, 3, 2]) == {"n": 4, "missing": 0, "min": 1, "median": 2.5, "max": 4}
    assert records.spread([None, math.nan]) == {"n": 0, "missing": 2, "min": None, "median": None, "max": None}
    assert records.spread([]) == {"n": 0, "missing": 0, "min": None, "median": None, "max": None}


@pytest.mark.parametrize("bad", [True, "1.0", [1.0]])
def test_a_spread_refuses_values_that_are_not_numbers(bad):
    with pytest.raises(records.RecordError, match="numbers or None"):
        records.spread([1.0, bad])


def test_spread_of_runs_counts_a_run_without_the_figure_as_missing():
    runs = [{"ratio": 0.9}, {"ratio": 1.1}, {}, {"ratio": None}]
    assert records.spread_of(runs, "ratio") == {"n": 2, "missing": 2, "min": 0.9, "median": 1.0, "max": 1.1}


def test_runs_take_turns_so_that_a_drift_favours_neither_kind():
    assert [records.take_turns(["on", "off"], r) for r in range(4)] == [
        ["on", "off"], ["off", "on"], ["on", "off"], ["off", "on"]]
    assert records.take_turns(["churn"], 1) == ["churn"]


def test_the_median_item_is_a_real_run_and_a_run_without_the_figure_ranks_lowest():
    runs = [{"id": "a", "ratio": 1.2}, {"id": "b", "ratio": None}, {"id": "c", "ratio": 0.8}, {"id": "d", "ratio": 1.0}]
    assert records.median_item(runs, "ratio")["id"] == "c"  # ranked b, c, d, a: the lower middle one
    assert records.median_item(runs[:1], "ratio")["id"] == "a"
    with pytest.raises(records.RecordError):
        records.median_item([], "ratio")


def test_json_safe_turns_what_json_cannot_hold_into_null_or_text():
    value = {"nan": math.nan, "inf": -math.inf, "path": Path("/x/y"), 3: (1, 2.5), "set": {2, 1}, "ok": True}
    assert records.json_safe(value) == {"nan": None, "inf": None, "path": "/x/y", "3": [1, 2.5], "set": [1, 2],
                                        "ok": True}


# ---- a record ----

def test_a_record_holds_commit_machine_date_arguments_raw_values_and_summary(tmp_path):
    args = _args(tmp_path, window_s=12.5, log_dir=Path("/tmp/x"))
    path = records.write_record("planner", args, [{"scenario": "a", "ours_cost_s": 3.5}],
                                raw={"random_cost_s[a]": [4.0, math.nan, 6.0]},
                                headline=[{"scenario": "a", "ours": 3.5}],
                                notes=["why"])
    assert path.parent == tmp_path / "planner"
    assert re.fullmatch(r"\d{8}T\d{6}Z-[0-9a-f]{7}\.json", path.name)
    record = records.load_record(path)
    assert record["benchmark"] == "planner" and record["schema"] == records.SCHEMA_VERSION
    assert re.fullmatch(r"[0-9a-f]{40}", record["git"]["commit"])
    assert record["git"]["short"] == record["git"]["commit"][:7]
    assert path.name.endswith(f"-{record['git']['short']}.json")
    assert isinstance(record["git"]["dirty"], bool)
    assert (record["git"]["diff_sha256"] is not None) == record["git"]["dirty"]  # a dirty tree names its changes
    machine = record["machine"]
    assert machine["cores"] == os.cpu_count() and machine["hostname"] and machine["python"]
    assert machine["memory_bytes"] > 0 and isinstance(machine["gpus"], list)
    assert machine["hivemind"] and machine["torch"]
    assert datetime.fromisoformat(record["date_utc"]).tzinfo is not None
    assert record["arguments"] == {"results_dir": str(tmp_path), "no_record": False, "seed": 0, "window_s": 12.5,
                                   "log_dir": "/tmp/x"}
    assert record["command"][0] == "python"
    assert record["raw"] == {"random_cost_s[a]": [4.0, None, 6.0]}
    assert record["spread"]["random_cost_s[a]"] == {"n": 2, "missing": 1, "min": 4.0, "median": 5.0, "max": 6.0}
    assert record["summary"] == [{"scenario": "a", "ours_cost_s": 3.5}]
    assert record["headline"] == [{"scenario": "a", "ours": 3.5}] and record["notes"] == ["why"]


def test_no_record_writes_nothing(tmp_path):
    args = _args(tmp_path)
    args.no_record = True
    assert records.write_record("planner", args, {}, raw={}) is None
    assert not any(tmp_path.iterdir())


def test_two_records_of_the_same_second_do_not_overwrite_each_other(tmp_path):
    date = datetime(2025, 3, 4, 5, 6, 7, tzinfo=timezone.utc)
    first = records.record_path(tmp_path, "fuzz", date, "abcdef0")
    assert first == tmp_path / "fuzz" / "20250304T050607Z-abcdef0.json"
    first.parent.mkdir(parents=True)
    first.write_text("{}")
    assert records.record_path(tmp_path, "fuzz", date, "abcdef0").name == "20250304T050607Z-abcdef0-2.json"
    assert records.record_path(tmp_path, "fuzz", date, None).name == "20250304T050607Z-nocommit.json"


@pytest.mark.parametrize("raw, match", [
    ({"x": "1, 2"}, "list of per-run values"),
    ({"x": [1.0, "2"]}, "numbers or None"),
    ({"x": [{"nested": 1}]}, "numbers or None"),
])
def test_raw_values_that_are_not_per_run_numbers_are_refused_with_the_name(tmp_path, raw, match):
    with pytest.raises(records.RecordError, match=match):
        records.build_record("fuzz", _args(tmp_path), {}, raw)


def test_an_unknown_benchmark_or_a_nested_headline_is_refused(tmp_path):
    with pytest.raises(records.RecordError, match="unknown benchmark"):
        records.build_record("pipelines", _args(tmp_path), {}, {})
    with pytest.raises(records.RecordError, match="headline figure 'x'"):
        records.build_record("fuzz", _args(tmp_path), {}, {}, headline={"x": [1, 2]})


def test_a_record_that_cannot_be_made_still_lets_the_script_print_its_figures(tmp_path, capsys):
    assert records.write_record("fuzz", _args(tmp_path), {}, raw={"x": ["bad"]}) is None
    assert "no record of this run" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_git_state_outside_a_checkout_says_it_cannot_name_the_commit(tmp_path):
    assert records.git_state(tmp_path) == {"commit": None, "short": None, "dirty": None, "dirty_paths": None}


@pytest.mark.parametrize("content, match", [
    ("not json", "not a readable JSON record"),
    ("[1, 2]", "a JSON object"),
    ('{"schema": 1, "benchmark": "fuzz"}', "missing field"),
])
def test_a_broken_record_is_named_when_read(tmp_path, content, match):
    path = tmp_path / "fuzz" / "x.json"
    path.parent.mkdir()
    path.write_text(content)
    with pytest.raises(records.RecordError, match=match):
        records.load_record(path)


# ---- the page ----

def test_the_page_shows_the_newest_record_of_each_benchmark_and_names_those_without_one(tmp_path):
    old = datetime(2025, 1, 1, tzinfo=timezone.utc)
    _write(tmp_path, "planner", old, "a", {"random_cost_s[x]": [9.0, 9.0]}, headline=[{"scenario": "x", "ours": 9.0}])
    newest = _write(tmp_path, "planner", old + timedelta(days=1), "b", {"random_cost_s[x]": [1.0, 3.0, None, 2.0]},
                    headline=[{"scenario": "x", "ours": 1.5}])
    _write(tmp_path, "simulate", old, "c", {"fraction": [0.95]}, headline={"fraction_of_optimal": 0.9583})
    page = report.render(report.load_records(tmp_path), tmp_path)

    assert page.startswith("# Benchmark records")
    assert "Generated file: do not edit" in page and "python benchmarks/report.py" in page
    no_record = next(line for line in page.splitlines() if line.startswith("No record yet"))
    for missing in ("pipeline", "slow_peer", "attacks", "fuzz", "churn", "wan", "relay", "containers"):
        assert f"`{missing}`" in no_record
    assert "`planner`" not in no_record and "`simulate`" not in no_record

    assert f"| [`planner`](#planner) | {report.WHAT['planner']} | {(old + timedelta(days=1)).isoformat()} |" in page
    assert f"| `fuzz` | {report.WHAT['fuzz']} | none yet |" in page
    planner = page[page.index("## planner"):page.index("## simulate")]
    assert newest.name in planner and "(and 1 older)" in planner
    assert "b" * 40 in planner and "a" * 40 not in planner
    assert "| x | 1.5 |" in planner and "| x | 9 |" not in planner
    assert "| random_cost_s[x] | 3 | 1 | 1 | 2 | 3 |" in planner
    assert "clean tree" in planner and "cores" in planner and "hivemind" in planner
    assert "| fraction_of_optimal | 0.9583 |" in page[page.index("## simulate"):]
    assert page.index("## planner") < page.index("## simulate")  # the order of BENCHMARKS


def test_a_dirty_tree_is_said_with_its_paths(tmp_path):
    path = _write(tmp_path, "fuzz", datetime(2025, 1, 1, tzinfo=timezone.utc), "d", {})
    record = json.loads(path.read_text())
    record["git"].update(dirty=True, dirty_paths=["benchmarks/fuzz.py"], dirty_paths_total=1,
                         diff_sha256="0123456789abcdef")
    path.write_text(json.dumps(record))
    page = report.render(report.load_records(tmp_path), tmp_path)
    assert "with uncommitted changes in 1 path, 0 of them in swarm/ or peers/: `benchmarks/fuzz.py`; diff digest " \
           "`0123456789ab`" in page
    record["git"].update(dirty_paths=["benchmarks/fuzz.py", "swarm/dht/node.py"], dirty_paths_total=3)
    path.write_text(json.dumps(record))
    page = report.render(report.load_records(tmp_path), tmp_path)
    assert "with uncommitted changes in 3 paths, 1 or more of them in swarm/ or peers/: `benchmarks/fuzz.py`, " in page


def test_a_run_on_a_loaded_machine_is_flagged(tmp_path):
    path = _write(tmp_path, "fuzz", datetime(2025, 1, 1, tzinfo=timezone.utc), "d", {})
    record = json.loads(path.read_text())
    record["machine"].update(cores=2, load_average_start=[1.5, 1, 1], load_average_end=[1.9, 1, 1])
    path.write_text(json.dumps(record))
    assert "loaded machine" not in report.render(report.load_records(tmp_path), tmp_path)
    record["machine"].update(load_average_end=[12.25, 9, 8])
    path.write_text(json.dumps(record))
    page = report.render(report.load_records(tmp_path), tmp_path)
    assert "**loaded machine**: a load average of up to 12.25 on 2 cores" in page


def test_a_note_of_several_lines_stays_one_list_item(tmp_path):
    path = _write(tmp_path, "gpu", datetime(2025, 1, 1, tzinfo=timezone.utc), "d", {"x": [1.0]})
    record = json.loads(path.read_text())
    record["notes"] = ["What runs:\n  (a) stage: a runner\n  (b) memory"]
    path.write_text(json.dumps(record))
    assert "- What runs: (a) stage: a runner (b) memory\n" in report.render(report.load_records(tmp_path), tmp_path)


def test_an_empty_results_folder_gives_a_page_that_says_no_benchmark_has_a_record(tmp_path):
    page = report.render(report.load_records(tmp_path), tmp_path)
    assert "No record yet: " + ", ".join(f"`{b}`" for b in ("pipeline", "planner")) in page
    assert "## " not in page


def test_a_record_in_the_wrong_folder_stops_the_report(tmp_path):
    path = _write(tmp_path, "fuzz", datetime(2025, 1, 1, tzinfo=timezone.utc), "e", {})
    moved = tmp_path / "churn" / path.name
    moved.parent.mkdir()
    path.rename(moved)
    with pytest.raises(records.RecordError, match="in the folder of 'churn'"):
        report.load_records(tmp_path)


def test_check_fails_when_the_page_differs_from_the_records_and_passes_once_regenerated(tmp_path, capsys):
    results, page = tmp_path / "results", tmp_path / "benchmarks.md"
    _write(results, "simulate", datetime(2025, 1, 1, tzinfo=timezone.utc), "f", {"fraction": [0.9]})
    assert report.main(["--results_dir", str(results), "--output", str(page), "--check"]) == 1
    assert report.main(["--results_dir", str(results), "--output", str(page)]) == 0
    assert report.main(["--results_dir", str(results), "--output", str(page), "--check"]) == 0
    _write(results, "simulate", datetime(2025, 1, 2, tzinfo=timezone.utc), "g", {"fraction": [0.8]})
    assert report.main(["--results_dir", str(results), "--output", str(page), "--check"]) == 1


def test_every_benchmark_is_described_on_the_page():
    assert set(report.WHAT) == set(records.BENCHMARKS)
    assert set(report.NEEDS) <= set(records.BENCHMARKS)


@pytest.mark.parametrize("value, shown", [
    (None, "-"), (True, "yes"), (3, "3"), (0.95831, "0.9583"), (32.0912, "32.09"), (2063.4, "2063"),
    (1234567.0, "1.235e+06"), (0.0001234, "1.234e-04"), (0.0, "0"), ([1, 2.5], "[1, 2.5]"), ("a|b", "a\\|b"),
])
def test_figures_are_shown_to_four_significant_digits(value, shown):
    assert report.fmt(value) == shown


def test_the_committed_page_is_what_the_committed_records_give():
    """docs/benchmarks.md is generated: editing it by hand, or adding a record without regenerating it, fails."""
    assert report.main(["--check"]) == 0
