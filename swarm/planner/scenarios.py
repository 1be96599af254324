"""The five network settings of the paper's evaluation, built from the packaged data files.

``data/scenarios.json`` transcribes ``data/SCENARIOS.md`` (both copied from the project's
shared data; see ``data/SOURCE.md``); the world-wide case reads measured region pairs from
``data/geo_links.csv``. Devices are numbered site by site, in the order the table lists them,
which is also what the region-blind "grid" baseline uses.
"""

from __future__ import annotations

import csv
import io
import json
from importlib import resources

import numpy as np

from swarm.planner.network import Network

__all__ = ["SCENARIOS", "load_scenario", "scenario_description", "GBIT_BYTES_PER_S"]

GBIT_BYTES_PER_S = 1e9 / 8
SCENARIOS = (
    "data-center-on-demand",
    "data-center-spot",
    "multiple-universities",
    "regional",
    "world-wide",
)


def _read_text(name: str) -> str:
    return (resources.files("swarm.planner") / "data" / name).read_text(encoding="utf-8")


def _spec(name: str) -> dict:
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; choose one of {', '.join(SCENARIOS)}")
    return json.loads(_read_text("scenarios.json"))[name]


def _site_links(spec: dict) -> dict[tuple[str, str], tuple[float, float]]:
    """(site, site) -> (latency_ms, bandwidth_gbps), both orders."""
    rows = [tuple(row) for row in spec.get("links", [])]
    if "links_csv" in spec:
        reader = csv.DictReader(io.StringIO(_read_text(spec["links_csv"])))
        rows += [(r["region_a"], r["region_b"], float(r["latency_ms"]), float(r["bandwidth_gbps"])) for r in reader]
    links = {}
    for a, b, latency_ms, gbps in rows:
        links[(a, b)] = links[(b, a)] = (float(latency_ms), float(gbps))
    return links


def scenario_description(name: str) -> str:
    """One line saying what the scenario is (from the paper's table)."""
    return str(_spec(name)["description"])


def load_scenario(name: str) -> Network:
    """The network of one scenario: 64 devices, latency in seconds, bandwidth in bytes/s."""
    spec = _spec(name)
    regions = [site for site, count in spec["sites"] for _ in range(count)]
    names = [f"{site}/{k}" for site, count in spec["sites"] for k in range(count)]
    links = _site_links(spec)
    within = (spec["within_site"]["latency_ms"], spec["within_site"]["bandwidth_gbps"])
    between = spec.get("between_sites")
    pair_cache: dict[tuple[str, str], tuple[float, float]] = {}
    n = len(regions)
    latency_ms, gbps = np.zeros((n, n)), np.zeros((n, n))
    for i, a in enumerate(regions):
        for j, b in enumerate(regions):
            if (a, b) not in pair_cache:
                if a == b:
                    pair_cache[(a, b)] = within
                elif (a, b) in links:
                    pair_cache[(a, b)] = links[(a, b)]
                elif between is not None:
                    pair_cache[(a, b)] = (between["latency_ms"], between["bandwidth_gbps"])
                else:
                    raise ValueError(f"scenario {name!r} has no link between {a} and {b}")
            latency_ms[i, j], gbps[i, j] = pair_cache[(a, b)]
    return Network(
        latency_s=latency_ms / 1e3,
        bandwidth_bytes_per_s=gbps * GBIT_BYTES_PER_S,
        names=tuple(names),
        regions=tuple(regions),
    )
