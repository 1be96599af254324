"""Benchmark records: every run of a script in ``benchmarks/`` leaves one JSON file that says what it measured,
on which commit and machine, when, with which arguments, every raw per-run value and the summary it printed.

Why: a figure quoted in prose loses the commit, the machine and the settings it came from, and a summary
hides how far the runs behind it were apart. A record keeps all of them together, and
``benchmarks/report.py`` renders the newest record of each benchmark into ``docs/benchmarks.md``.

A record is written to ``benchmarks/results/<benchmark>/<UTC timestamp>-<short commit>.json`` (``--results_dir``
moves it, ``--no_record`` skips it) before the script prints its last-line JSON, which stays what it was.
Its fields:

  benchmark, schema            the script's name (one of :data:`BENCHMARKS`) and the record format's version
  git                          commit (``git rev-parse HEAD``), short commit, dirty (uncommitted changes in the
                               tree), dirty_paths (the paths ``git status --porcelain`` lists, at most 200),
                               diff_sha256 (of ``git diff HEAD`` and those paths: two dirty records with the same
                               digest ran on the same changes to tracked files)
  machine                      hostname, CPU model, cores, memory, GPUs, Python / torch / hivemind / numpy
                               versions, and the load average when the script started and when it finished
  started_utc, date_utc, wall_s   when the script started and finished (UTC, ISO 8601), seconds between them
  command, arguments           the command line as typed and every parsed argument, defaults included
  raw                          name -> one value per run (numbers or null): what the summary was made from
  spread                       name -> n, missing, min, median, max of ``raw`` (:func:`spread`)
  headline                     the few figures the report shows: a flat mapping, or a list of flat rows
  notes                        what a reader must know to read the figures (definitions, caveats)
  summary                      the last-line JSON the script printed

This module is imported by the scripts (their directory is on ``sys.path``); it imports neither torch nor
hivemind, so that a record of a script that does not need them costs nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Union

__all__ = ["BENCHMARKS", "RESULTS_DIR", "REPO", "SCHEMA_VERSION", "add_record_arguments", "git_state", "machine_info",
           "spread", "spreads", "spread_of", "json_safe", "record_path", "build_record", "write_record",
           "load_record", "RecordError", "take_turns", "median_item"]

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = Path(__file__).resolve().parent / "results"
SCHEMA_VERSION = 1
BENCHMARKS = ("pipeline", "planner", "slow_peer", "attacks", "fuzz", "churn", "rebalance", "batching", "wan", "relay",
              "containers", "control_plane", "step_traffic", "simulate", "gpu", "compression", "alignment",
              "averaging")
MAX_DIRTY_PATHS = 200
GIT_TIMEOUT_S = 10.0
GPU_QUERY_TIMEOUT_S = 10.0
REQUIRED_FIELDS = ("schema", "benchmark", "git", "machine", "date_utc", "command", "arguments", "raw", "summary")

# when the script started: this module is imported before a benchmark does any work
_STARTED = datetime.now(timezone.utc)
_STARTED_MONOTONIC = time.monotonic()
_LOAD_AT_START = os.getloadavg() if hasattr(os, "getloadavg") else None

Scalar = Union[int, float, str, bool, None]
Headline = Union[Mapping[str, Scalar], Sequence[Mapping[str, Scalar]]]


class RecordError(ValueError):
    """A record that cannot be written or read as it is: the message names the field and the file."""


def add_record_arguments(parser: argparse.ArgumentParser) -> None:
    """``--results_dir`` and ``--no_record``, the same in every script."""
    parser.add_argument("--results_dir", default=str(RESULTS_DIR),
                        help="where the run's record goes (a folder per benchmark below it)")
    parser.add_argument("--no_record", action="store_true", help="write no record of this run")


# ---- where and on what it ran ----

def _git(repo: Path, *args: str) -> Optional[str]:
    try:
        done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=GIT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def git_state(repo: Path = REPO) -> Dict[str, Any]:
    """The commit the tree is at and whether it has uncommitted changes (read-only git commands). Outside a
    git checkout, or without git, every field is None: a record then says it cannot name its commit."""
    head = _git(repo, "rev-parse", "HEAD")
    if head is None:
        return {"commit": None, "short": None, "dirty": None, "dirty_paths": None}
    status = _git(repo, "status", "--porcelain", "--untracked-files=normal") or ""
    paths = [line[3:] for line in status.splitlines() if line.strip()]
    diff = _git(repo, "diff", "HEAD", "--binary") or ""
    return {"commit": head.strip(), "short": head.strip()[:7], "dirty": bool(paths),
            "dirty_paths": paths[:MAX_DIRTY_PATHS], "dirty_paths_total": len(paths),
            "diff_sha256": hashlib.sha256((diff + "\n".join(paths)).encode()).hexdigest() if paths else None}


def _cpu_model() -> Optional[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or None


def _memory_bytes() -> Optional[int]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _gpus() -> List[str]:
    """GPU names (with memory where known): from torch if the script imported it (no new import: a CPU-only
    benchmark should not pay for torch), else from ``nvidia-smi``; an empty list when there is none."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available():
                return [f"{torch.cuda.get_device_name(i)}, "
                        f"{torch.cuda.get_device_properties(i).total_memory / 2**30:.0f} GiB"
                        for i in range(torch.cuda.device_count())]
        except Exception:  # a broken driver must not cost the record; nvidia-smi may still answer
            pass
    if shutil.which("nvidia-smi"):
        try:
            done = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                                  capture_output=True, text=True, timeout=GPU_QUERY_TIMEOUT_S)
            if done.returncode == 0:
                return [line.strip() for line in done.stdout.splitlines() if line.strip()]
        except (OSError, subprocess.TimeoutExpired):
            pass
    return []


def _version(package: str) -> Optional[str]:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine_info() -> Dict[str, Any]:
    """What a reader needs to compare figures between machines: the same benchmark on 2 shared cores and
    on 16 idle ones measures different things. The load average says how shared the cores were."""
    return {
        "hostname": socket.gethostname(), "cpu_model": _cpu_model(), "cores": os.cpu_count(),
        "memory_bytes": _memory_bytes(), "gpus": _gpus(), "platform": platform.platform(),
        "python": platform.python_version(), "torch": _version("torch"), "hivemind": _version("hivemind"),
        "numpy": _version("numpy"),
        "load_average_start": list(_LOAD_AT_START) if _LOAD_AT_START else None,
        "load_average_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


# ---- values ----

def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def spread(values: Iterable[Any]) -> Dict[str, Any]:
    """n, min, median, max of the finite numbers among ``values``; ``missing`` counts the rest (None, NaN,
    infinity: a run that measured nothing, or a loss that diverged), so that a spread never hides a failed run.
    A bool or a string is refused: a spread of those is a bug in the caller."""
    numbers, missing = [], 0
    for value in values:
        if value is None:
            missing += 1
        elif not _is_number(value):
            raise RecordError(f"a spread is of numbers or None, got {value!r} ({type(value).__name__})")
        elif math.isfinite(value):
            numbers.append(value)
        else:
            missing += 1
    if not numbers:
        return {"n": 0, "missing": missing, "min": None, "median": None, "max": None}
    return {"n": len(numbers), "missing": missing, "min": min(numbers), "median": statistics.median(numbers),
            "max": max(numbers)}


def spreads(raw: Mapping[str, Sequence[Any]]) -> Dict[str, Dict[str, Any]]:
    return {name: spread(values) for name, values in raw.items()}


def spread_of(runs: Sequence[Mapping[str, Any]], key: str) -> Dict[str, Any]:
    """The spread of one figure over repeated runs (a run without it counts as missing)."""
    return spread(run.get(key) for run in runs)


def json_safe(value: Any) -> Any:
    """A value JSON can hold: NaN and infinities become None (JSON has neither), paths and other objects
    their text, tuples and sets lists, mapping keys text."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(json_safe(v) for v in value)
    return str(value)


def _check_raw(raw: Mapping[str, Sequence[Any]]) -> None:
    for name, values in raw.items():
        if not isinstance(name, str) or isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise RecordError(f"raw[{name!r}] must be a list of per-run values, got {type(values).__name__}")
        for value in values:
            if value is not None and not _is_number(value):
                raise RecordError(f"raw[{name!r}] holds {value!r}: per-run values are numbers or None")


def _check_headline(headline: Optional[Headline]) -> None:
    rows = [] if headline is None else ([headline] if isinstance(headline, Mapping) else list(headline))
    for row in rows:
        if not isinstance(row, Mapping):
            raise RecordError(f"a headline is a mapping or a list of mappings, got a {type(row).__name__}")
        for key, value in row.items():
            if not (value is None or isinstance(value, (int, float, str, bool))):
                raise RecordError(f"headline figure {key!r} must be a number, text, bool or None, got {value!r}")


# ---- writing and reading ----

def _stamp(date: datetime) -> str:
    return date.astimezone(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def record_path(results_dir: Path, benchmark: str, date: datetime, short_commit: Optional[str]) -> Path:
    """``<results_dir>/<benchmark>/<UTC timestamp>-<short commit>.json``, with ``-2``, ``-3``, ... before the
    suffix if a record of that second already exists (two runs never overwrite each other)."""
    folder = Path(results_dir) / benchmark
    stem = f"{_stamp(date)}-{short_commit or 'nocommit'}"
    path, number = folder / f"{stem}.json", 2
    while path.exists():
        path, number = folder / f"{stem}-{number}.json", number + 1
    return path


def _command() -> List[str]:
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path("?")
    try:
        shown = script.resolve().relative_to(REPO).as_posix()
    except ValueError:
        shown = str(script)
    return ["python", shown, *sys.argv[1:]]


def build_record(benchmark: str, args: Optional[argparse.Namespace], summary: Any,
                 raw: Mapping[str, Sequence[Any]], headline: Optional[Headline] = None,
                 notes: Sequence[str] = (), finished: Optional[datetime] = None) -> Dict[str, Any]:
    """The record of a run that just finished (see the module docstring for its fields)."""
    if benchmark not in BENCHMARKS:
        raise RecordError(f"unknown benchmark {benchmark!r}; known: {', '.join(BENCHMARKS)}")
    _check_raw(raw)
    _check_headline(headline)
    finished = finished or datetime.now(timezone.utc)
    return json_safe({
        "schema": SCHEMA_VERSION, "benchmark": benchmark, "git": git_state(), "machine": machine_info(),
        "started_utc": _STARTED.isoformat(timespec="seconds"), "date_utc": finished.isoformat(timespec="seconds"),
        "wall_s": round(time.monotonic() - _STARTED_MONOTONIC, 1),
        "command": _command(), "arguments": dict(vars(args)) if args is not None else {},
        "raw": {name: list(values) for name, values in raw.items()}, "spread": spreads(raw),
        "headline": headline, "notes": list(notes), "summary": summary,
    })


def write_record(benchmark: str, args: Optional[argparse.Namespace], summary: Any,
                 raw: Mapping[str, Sequence[Any]], headline: Optional[Headline] = None,
                 notes: Sequence[str] = ()) -> Optional[Path]:
    """Write the run's record unless ``args.no_record``; print where it went (on stdout, before the script's
    last line) and return the path. A record that cannot be made or written costs the run nothing but an error
    on stderr: the script still prints its figures, which took minutes to measure."""
    if args is not None and getattr(args, "no_record", False):
        return None
    try:
        record = build_record(benchmark, args, summary, raw, headline, notes)
    except RecordError as e:
        print(f"error: no record of this run: {e}", file=sys.stderr, flush=True)
        return None
    results_dir = Path(getattr(args, "results_dir", None) or RESULTS_DIR)
    path = record_path(results_dir, benchmark, datetime.fromisoformat(record["date_utc"]), record["git"]["short"])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1, allow_nan=False) + "\n")
    except OSError as e:
        print(f"could not write the record {path}: {e}", file=sys.stderr, flush=True)
        return None
    print(f"record: {_shown(path)}", flush=True)
    return path


def _shown(path: Path) -> str:
    try:
        return path.resolve().relative_to(REPO).as_posix()
    except ValueError:
        return str(path)


def load_record(path: Path) -> Dict[str, Any]:
    """A record read back, its required fields checked; :class:`RecordError` names the file and the field."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise RecordError(f"{path}: not a readable JSON record ({type(e).__name__}: {e})") from e
    if not isinstance(record, dict):
        raise RecordError(f"{path}: a record is a JSON object, got {type(record).__name__}")
    missing = [field for field in REQUIRED_FIELDS if field not in record]
    if missing:
        raise RecordError(f"{path}: missing field(s) {', '.join(missing)}")
    if record["schema"] != SCHEMA_VERSION:
        raise RecordError(f"{path}: record schema {record['schema']!r}, this reader knows {SCHEMA_VERSION}")
    if record["benchmark"] not in BENCHMARKS:
        raise RecordError(f"{path}: unknown benchmark {record['benchmark']!r}")
    try:
        datetime.fromisoformat(record["date_utc"])
    except (TypeError, ValueError) as e:
        raise RecordError(f"{path}: date_utc {record['date_utc']!r} is not an ISO 8601 time") from e
    if not isinstance(record["raw"], dict):
        raise RecordError(f"{path}: raw must be an object of per-run value lists")
    _check_raw(record["raw"])
    return record


def take_turns(kinds: Sequence[str], repeat: int) -> List[str]:
    """The order of the kinds of run in repeat ``repeat``: as given, then reversed, and so on (A B, B A, A B, ...),
    so that a steady drift of a shared machine's speed over the repeats favours no kind."""
    return list(kinds) if repeat % 2 == 0 else list(reversed(kinds))


def median_item(items: Sequence[Mapping[str, Any]], key: str) -> Mapping[str, Any]:
    """The item of median ``key`` (the lower middle one of an even count; an item without a finite ``key``
    ranks lowest): a real run to report, where a mean of runs would be no run at all."""
    if not items:
        raise RecordError("median_item of no items")

    def rank(item: Mapping[str, Any]) -> float:
        value = item.get(key)
        return value if _is_number(value) and math.isfinite(value) else -math.inf
    return sorted(items, key=rank)[(len(items) - 1) // 2]
