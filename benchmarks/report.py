"""Render docs/benchmarks.md from the benchmark records under benchmarks/results/.

Why: figures quoted by hand drift from the code and the machine they were measured on. The page this
script writes holds, for every benchmark, the newest record's headline figures beside its commit, machine,
date, command line and the spread (n, min, median, max) of every raw per-run value, and names the
benchmarks that have no record yet. It holds nothing a record does not say, so it can be checked:
``--check`` exits 1 when the page differs from what the records give.

Usage: python benchmarks/report.py [--results_dir benchmarks/results] [--output docs/benchmarks.md] [--check]
"""

from __future__ import annotations

import argparse
import math
import sys
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _records import BENCHMARKS, REPO, RESULTS_DIR, RecordError, load_record, spread  # noqa: E402

__all__ = ["load_records", "newest", "render", "fmt", "main"]

OUTPUT = REPO / "docs" / "benchmarks.md"
REGENERATE = "python benchmarks/report.py"
LIBRARY = ("swarm/", "peers/")  # what a benchmark measures; changes elsewhere (tests, docs, benchmarks) do not move it

# What each script measures, in one line: a reader of the page should not need the script open to know.
WHAT = {
    "pipeline": "one process vs a 2-stage swarm on loopback: tokens/s, CPU per micro-batch, where the time goes",
    "planner": "the allocation planner on the paper's five network scenarios, against every baseline it computes",
    "slow_peer": "a much slower replica joins a balanced 2+2 swarm: throughput after/before, standby policy on and off",
    "attacks": "one Byzantine replica or trainer per run, defences on and off, beside clean runs",
    "fuzz": "random and mutated requests and DHT junk thrown at live peers while a trainer trains",
    "churn": "peers killed and started while training: samples lost, throughput against no churn, stalls",
    "rebalance": "a 3+1 swarm that rebalances itself against a 2+2 swarm balanced from the start",
    "batching": "merged vs one-by-one requests on a stage's compute thread: CPU ms per micro-batch",
    "wan": "a 2-stage swarm across network namespaces with tc-limited links: tokens/s and bytes per sample",
    "relay": "a trainer through a stage peer that accepts no incoming connections, against a reachable one",
    "containers": "the Docker image and the compose swarm: build, start, train, tear down",
    "control_plane": "control-plane bytes per peer, trainer and bootstrap, counted at network-namespace links and modelled",
    "step_traffic": "DHT keys each training stage peer stores and reads per second, at short and long steps",
    "compression": "bytes per sample of activations and of the all-reduce, and loss at equal samples, per codec",
    "alignment": "honest replicas' gradient cosines, when the alignment check excludes same-norm flippers, "
                 "and what it costs per round",
    "simulate": "the 1,000-peer simulation and the SWARM paper's rebalancing experiment",
    "averaging": "overlapped against synchronous averaging in a 2+2 swarm over limited links: samples/s, loss",
    "gpu": "a Llama-class stage's training throughput and MFU, a 2-stage swarm against one process on one GPU, "
           "and each stage's peak memory against its estimate",
}

# Why a benchmark may have no record on a given machine: said beside its name in the list of missing records.
NEEDS = {
    "wan": "needs root for network namespaces and tc",
    "averaging": "needs root for network namespaces and tc",
    "relay": "needs root for network namespaces; its relayed cell waits minutes for libp2p's relay boot delay",
    "containers": "needs a running Docker engine",
    "gpu": "needs a CUDA GPU (--tiny runs on the CPU, for the tests)",
}


def fmt(value: Any) -> str:
    """A figure as the page shows it: integers as they are, floats to 4 significant digits (no exponent
    below a million), None as '-', lists item by item."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-3):
            return f"{value:.3e}"
        if abs(value) >= 1000:
            return f"{value:.0f}"
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(fmt(v) for v in value) + "]"
    return str(value).replace("|", "\\|").replace("\n", " ")


def load_records(results_dir: Path) -> Dict[str, List[Dict[str, Any]]]:
    """Every record under ``results_dir``, by benchmark; a file that is not a valid record stops the report
    with its name (a page built around a broken record would hide it). Each record gets its path as ``_path``."""
    found: Dict[str, List[Dict[str, Any]]] = {}
    for path in sorted(Path(results_dir).glob("*/*.json")):
        record = load_record(path)
        if record["benchmark"] != path.parent.name:
            raise RecordError(f"{path}: a record of {record['benchmark']!r} in the folder of {path.parent.name!r}")
        record["_path"] = path
        found.setdefault(record["benchmark"], []).append(record)
    return found


def newest(records: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """The record finished last (by ``date_utc``; the file name breaks a tie)."""
    return max(records, key=lambda r: (datetime.fromisoformat(r["date_utc"]), str(r["_path"])))


def _shown(path: Path) -> str:
    try:
        return Path(path).resolve().relative_to(REPO).as_posix()
    except ValueError:
        return str(path)


def _git_line(git: Mapping[str, Any]) -> str:
    if not git.get("commit"):
        return "commit: unknown (not run from a git checkout)"
    line = f"commit: `{git['commit']}`"
    if git.get("dirty"):
        paths = git.get("dirty_paths") or []
        total = git.get("dirty_paths_total", len(paths))
        shown = ", ".join(f"`{p}`" for p in paths[:8]) + (", ..." if total > 8 else "")
        library = sum(p.startswith(LIBRARY) for p in paths)
        line += (f", with uncommitted changes in {total} path{'s' if total != 1 else ''}, {library}"
                 f"{' or more' if total > len(paths) else ''} of them in {' or '.join(LIBRARY)}: {shown}")
        if git.get("diff_sha256"):
            line += f"; diff digest `{git['diff_sha256'][:12]}`"
    else:
        line += ", clean tree"
    return line


def _machine_line(machine: Mapping[str, Any]) -> str:
    memory = machine.get("memory_bytes")
    gpus = machine.get("gpus") or []
    parts = [f"{machine.get('hostname')}", f"{machine.get('cpu_model')}", f"{machine.get('cores')} cores",
             f"{memory / 2**30:.1f} GiB memory" if memory else "memory unknown",
             ("GPU " + "; ".join(gpus)) if gpus else "no GPU",
             f"Python {machine.get('python')}, torch {machine.get('torch')}, hivemind {machine.get('hivemind')}"]
    start, end = machine.get("load_average_start"), machine.get("load_average_end")
    if start and end:
        parts.append(f"load average (1 min) {fmt(start[0])} at start, {fmt(end[0])} at end")
    return "machine: " + ", ".join(parts)


def _load_warning(machine: Mapping[str, Any]) -> List[str]:
    """A line when the machine ran more runnable processes than it has cores: live figures then measure the
    contention as much as the code."""
    loads = [load[0] for load in (machine.get("load_average_start"), machine.get("load_average_end")) if load]
    cores = machine.get("cores")
    if not loads or not cores or max(loads) <= cores:
        return []
    return [f"- **loaded machine**: a load average of up to {fmt(max(loads))} on {cores} cores: other work competed "
            "for the cores during this run, so its timings and rates say as much about that load as about the code"]


def _table(rows: Sequence[Mapping[str, Any]]) -> List[str]:
    columns: List[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(row.get(c)) for c in columns) + " |" for row in rows]
    return lines


def _headline(headline: Any) -> List[str]:
    if not headline:
        return []
    if isinstance(headline, Mapping):
        return ["| figure | value |", "|---|---|"] + [f"| {key} | {fmt(value)} |" for key, value in headline.items()]
    return _table(headline)


def _spread_table(raw: Mapping[str, Sequence[Any]]) -> List[str]:
    if not raw:
        return ["No raw per-run values in this record."]
    lines = ["| raw value | n | missing | min | median | max |", "|---|---|---|---|---|---|"]
    for name, values in raw.items():
        s = spread(values)
        lines.append(f"| {name} | {s['n']} | {s['missing']} | {fmt(s['min'])} | {fmt(s['median'])} | {fmt(s['max'])} |")
    return lines


def _section(benchmark: str, records: Sequence[Dict[str, Any]]) -> List[str]:
    record = newest(records)
    older = len(records) - 1
    lines = [f"## {benchmark}", "", WHAT[benchmark][0].upper() + WHAT[benchmark][1:] + ".", "",
             f"- record: `{_shown(record['_path'])}`" + (f" (and {older} older)" if older else ""),
             f"- date: {record['date_utc']} (UTC), wall time {fmt(record.get('wall_s'))} s",
             f"- {_git_line(record['git'])}",
             f"- {_machine_line(record['machine'])}",
             *_load_warning(record["machine"]),
             f"- command: `{' '.join(record['command'])}`", ""]
    headline = _headline(record.get("headline"))
    if headline:
        lines += ["Headline figures:", "", *headline, ""]
    lines += ["Raw per-run values (one per run, window or repeat; the spread is over those):", "",
              *_spread_table(record["raw"]), ""]
    notes = record.get("notes") or []
    if notes:
        lines += ["Notes:", "", *[f"- {' '.join(str(note).split())}" for note in notes], ""]
    return lines


def render(found: Mapping[str, Sequence[Dict[str, Any]]], results_dir: Path) -> str:
    """The page: a header that says it is generated and how, the benchmarks without a record, then one
    section per benchmark with a record, in the order of :data:`BENCHMARKS`."""
    missing = [b for b in BENCHMARKS if b not in found]
    lines = [
        "# Benchmark records",
        "",
        "<!-- Generated file: do not edit. Regenerate with `" + REGENERATE + "`. -->",
        "",
        f"Generated by `{REGENERATE}` from the JSON records under `{_shown(results_dir)}/`: for each benchmark, "
        "the newest record. Every run of a script in `benchmarks/` writes one record "
        "(`<benchmark>/<UTC timestamp>-<short commit>.json`: commit and whether the tree was dirty, machine, "
        "date, the exact arguments, every raw per-run value and the summary it printed; `benchmarks/_records.py` "
        f"describes the fields). Run a benchmark, then `{REGENERATE}` to update this page; "
        f"`{REGENERATE} --check` fails when the page and the records disagree.",
        "",
        "Figures from different sections may come from different commits and machines: each section says which. "
        "A record made on a shared 2-core machine measures that machine as much as the code.",
        "",
    ]
    lines += ["| benchmark | what it measures | newest record |", "|---|---|---|"]
    for benchmark in BENCHMARKS:
        date = newest(found[benchmark])["date_utc"] if benchmark in found else "none yet"
        name = f"[`{benchmark}`](#{benchmark})" if benchmark in found else f"`{benchmark}`"
        lines.append(f"| {name} | {WHAT[benchmark]} | {date} |")
    lines.append("")
    if missing:
        lines += ["No record yet: " + ", ".join(f"`{b}`" + (f" ({NEEDS[b]})" if b in NEEDS else "") for b in missing)
                  + ".", ""]
    for benchmark in BENCHMARKS:
        if benchmark in found:
            lines += _section(benchmark, found[benchmark])
    return "\n".join(lines).rstrip() + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results_dir", type=Path, default=RESULTS_DIR, help="where the records are")
    parser.add_argument("--output", type=Path, default=OUTPUT, help="the page to write")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the page is not up to date")
    args = parser.parse_args(argv)
    try:
        found = load_records(args.results_dir)
    except RecordError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    page = render(found, args.results_dir)
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != page:
            print(f"{_shown(args.output)} is not what the records give; run {REGENERATE}", file=sys.stderr)
            return 1
        print(f"{_shown(args.output)} is up to date")
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(page)
    print(f"wrote {_shown(args.output)} from {sum(len(v) for v in found.values())} records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
