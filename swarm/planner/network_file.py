"""Read a user's own network (CSV or JSON) into a validated ``Network``.

JSON: {"latency_ms": [[...]], "bandwidth_gbps": [[...]], "compute_tflops": [...]?, "names": [...]?}
CSV: one row per ordered or unordered device pair, header
``device_a,device_b,latency_ms,bandwidth_gbps`` (per-device speed needs the JSON form).
Every pair must be present. Problems are
raised as ``NetworkFileError`` (a ValueError) whose message names the problem, for the CLI.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np

from swarm.planner.network import Network
from swarm.planner.scenarios import GBIT_BYTES_PER_S

__all__ = ["NetworkFileError", "load_network_file"]


class NetworkFileError(ValueError):
    """A network file that cannot be planned for; the message says why."""


def _matrix(data: dict, key: str, path: Path) -> np.ndarray:
    if key not in data:
        raise NetworkFileError(f"{path}: missing {key!r}")
    try:
        matrix = np.array(data[key], dtype=float)
    except (TypeError, ValueError):
        raise NetworkFileError(f"{path}: {key!r} must be a square matrix of numbers (missing or non-numeric entries)")
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
        raise NetworkFileError(f"{path}: {key!r} must be a square matrix, got shape {matrix.shape}")
    return matrix


def _from_json(path: Path) -> Network:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise NetworkFileError(f"{path}: not valid JSON ({e})")
    if not isinstance(data, dict):
        raise NetworkFileError(f"{path}: expected a JSON object")
    latency_ms = _matrix(data, "latency_ms", path)
    gbps = _matrix(data, "bandwidth_gbps", path)
    if latency_ms.shape != gbps.shape:
        raise NetworkFileError(f"{path}: latency_ms is {latency_ms.shape} but bandwidth_gbps is {gbps.shape}")
    return _build(path, latency_ms, gbps, data.get("compute_tflops"), data.get("names") or ())


def _from_csv(path: Path) -> Network:
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    need = {"device_a", "device_b", "latency_ms", "bandwidth_gbps"}
    if not rows or not need <= set(rows[0]):
        raise NetworkFileError(f"{path}: expected a header with columns {sorted(need)}")
    names = sorted({r["device_a"] for r in rows} | {r["device_b"] for r in rows})
    index = {name: k for k, name in enumerate(names)}
    n = len(names)
    latency_ms, gbps = np.full((n, n), np.nan), np.full((n, n), np.nan)
    for line, r in enumerate(rows, start=2):
        try:
            lat, bw = float(r["latency_ms"]), float(r["bandwidth_gbps"])
        except (TypeError, ValueError):
            raise NetworkFileError(f"{path}: line {line}: latency_ms and bandwidth_gbps must be numbers")
        if math.isnan(lat) or math.isnan(bw):
            raise NetworkFileError(f"{path}: line {line}: NaN value")
        a, b = index[r["device_a"]], index[r["device_b"]]
        latency_ms[a, b] = latency_ms[b, a] = lat
        gbps[a, b] = gbps[b, a] = bw
    np.fill_diagonal(latency_ms, 0.0)
    np.fill_diagonal(gbps, 1.0)
    missing = np.argwhere(np.isnan(latency_ms))
    if missing.size:
        a, b = missing[0]
        raise NetworkFileError(
            f"{path}: missing entry for the pair {names[a]}, {names[b]} ({len(missing) // 2} pairs missing)"
        )
    return _build(path, latency_ms, gbps, None, names)


def _build(path: Path, latency_ms: np.ndarray, gbps: np.ndarray, tflops, names) -> Network:
    off = ~np.eye(latency_ms.shape[0], dtype=bool)
    if np.isnan(latency_ms[off]).any() or np.isnan(gbps[off]).any():
        raise NetworkFileError(f"{path}: NaN or missing entries in the matrices")
    if (gbps[off] < 0).any():
        raise NetworkFileError(f"{path}: negative bandwidth")
    if (latency_ms[off] < 0).any():
        raise NetworkFileError(f"{path}: negative latency")
    try:
        return Network(
            latency_s=latency_ms / 1e3,
            bandwidth_bytes_per_s=gbps * GBIT_BYTES_PER_S,
            compute_tflops=None if tflops is None else np.array(tflops, dtype=float),
            names=tuple(str(x) for x in names),
        )
    except (TypeError, ValueError) as e:
        raise NetworkFileError(f"{path}: {e}")


def load_network_file(path: str | Path) -> Network:
    """Parse ``path`` (.json or .csv; see module doc) into a Network, or raise NetworkFileError."""
    path = Path(path)
    if not path.is_file():
        raise NetworkFileError(f"{path}: no such file")
    if path.suffix.lower() == ".json":
        return _from_json(path)
    if path.suffix.lower() == ".csv":
        return _from_csv(path)
    raise NetworkFileError(f"{path}: unknown format; use a .json or .csv file")
