"""Twin types, count-matrix costs and lower bounds of swarm.planner."""

from itertools import permutations

import numpy as np
import pytest

from swarm.planner import CostModel, Network, SearchConfig, Workload, load_scenario, random_placements, search
from swarm.planner.balanced import FastCost
from swarm.planner.bounds import enumerate_rows, exact_optimum, lower_bound, threshold_bound
from swarm.planner.counts import CountState
from swarm.planner.path import path_cost
from swarm.planner.symmetry import TypedCost, counts_to_groups, device_types, groups_to_counts


def _typed_total(typed: TypedCost, counts: np.ndarray) -> float:
    return max(typed.row_stage_s(r) for r in counts) + 2.0 * path_cost(typed.edge_matrix(counts))


def _sites_network(sizes, link_ms, link_gbps, within=(5.0, 2.0)) -> Network:
    """Devices at sites: ``sizes[k]`` devices at site k, symmetric site-pair links."""
    sites = [k for k, n in enumerate(sizes) for _ in range(n)]
    lat = np.array([[within[0] if a == b else link_ms[a][b] for b in sites] for a in sites]) / 1e3
    gbps = np.array([[within[1] if a == b else link_gbps[a][b] for b in sites] for a in sites])
    return Network(lat, gbps * 1.25e8)


def test_device_types_are_the_sites():
    assert np.bincount(device_types(CostModel(load_scenario("world-wide"), Workload()))).tolist() == [8] * 8
    spot = np.bincount(device_types(CostModel(load_scenario("data-center-spot"), Workload())))
    assert sorted(spot.tolist()) == [4] * 8 + [32]  # single GPUs are interchangeable too


def test_device_types_split_on_compute_speed():
    n = 4
    speed = np.array([1.0, 1.0, 2.0, 1.0])
    net = Network(np.full((n, n), 0.01), np.full((n, n), 1e9), compute_tflops=speed)
    labels = device_types(CostModel(net, Workload(num_layers=2, num_stages=2)))
    assert labels[0] == labels[1] == labels[3] != labels[2]


@pytest.mark.parametrize("name", ["regional", "data-center-spot", "world-wide"])
def test_count_cost_equals_device_cost(name):
    model = CostModel(load_scenario(name), Workload())
    typed, fast = TypedCost(model), FastCost(model)
    for groups, _ in random_placements(model, 10, seed=5):
        counts = groups_to_counts(typed.labels, typed.num_types, groups)
        assert _typed_total(typed, counts) == pytest.approx(fast.total(groups), rel=1e-12)
        rebuilt, unused = counts_to_groups(typed.labels, counts)
        assert unused == [] and fast.total(np.array(rebuilt)) == pytest.approx(fast.total(groups), rel=1e-12)


def test_count_move_pricing_matches_recomputation():
    model = CostModel(load_scenario("regional"), Workload())
    typed = TypedCost(model)
    groups, _ = random_placements(model, 1, seed=2)[0]
    state = CountState(typed, groups_to_counts(typed.labels, typed.num_types, groups), np.zeros(4, dtype=np.int64))
    g, h = 0, 1
    t, u = int(np.flatnonzero(state.counts[g])[0]), int(np.flatnonzero(state.counts[h])[-1])
    if t == u:
        u = int(np.flatnonzero(state.counts[h])[0])
    assert t != u
    priced = state.price(g, t, h, u, reject_above=np.inf)
    state.commit()
    assert state.counts.sum(1).tolist() == [8] * 8
    assert priced == pytest.approx(_typed_total(typed, state.counts), rel=1e-12)


def _brute_force_optimum(model: CostModel) -> float:
    """Every ordered device assignment into equal groups (tiny networks only)."""
    fast, s, size = FastCost(model), model.num_stages, model.nominal_replicas
    return min(fast.total(np.array(p).reshape(s, size)) for p in permutations(range(model.num_devices)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bounds_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    ms, gb = rng.uniform(5, 150, (3, 3)), rng.uniform(0.3, 1.5, (3, 3))
    net = _sites_network([3, 2, 1], (ms + ms.T) / 2, (gb + gb.T) / 2)
    model = CostModel(net, Workload(num_layers=3, num_stages=3))
    typed = TypedCost(model)
    rows = enumerate_rows(typed.type_sizes, typed.size)
    optimum = _brute_force_optimum(model)
    assert exact_optimum(typed, rows) == pytest.approx(optimum, rel=1e-12)
    assert lower_bound(model, typed) == pytest.approx(optimum, rel=1e-12)
    assert threshold_bound(typed, rows) <= optimum + 1e-9


@pytest.mark.parametrize("name", ["regional", "world-wide", "data-center-on-demand"])
def test_threshold_bound_is_below_every_placement(name):
    model = CostModel(load_scenario(name), Workload())
    typed, fast = TypedCost(model), FastCost(model)
    bound = threshold_bound(typed, enumerate_rows(typed.type_sizes, typed.size))
    assert bound > 0
    assert all(bound <= fast.total(g) + 1e-9 for g, _ in random_placements(model, 50, seed=3))


def test_spot_optimum_proven_and_found():
    """Singles fill four stages, each 4-GPU instance is spread over the other four."""
    model = CostModel(load_scenario("data-center-spot"), Workload())
    labels = device_types(model)
    quads = [np.flatnonzero(labels == t) for t in range(labels.max() + 1) if (labels == t).sum() == 4]
    singles = np.flatnonzero(np.bincount(labels)[labels] == 32)
    groups = [list(singles[8 * k: 8 * k + 8]) for k in range(4)] + [[q[k] for q in quads] for k in range(4)]
    hand = model.total_s(groups)
    bound = lower_bound(model)
    assert bound == pytest.approx(hand, rel=1e-12)
    result = search(model, SearchConfig(seed=0, allow_uneven=False))
    assert result.breakdown.total_s == pytest.approx(bound, rel=1e-9)
    assert result.lower_bound_s == pytest.approx(bound, rel=1e-12)


def test_universities_optimum_is_exact_and_reached():
    model = CostModel(load_scenario("multiple-universities"), Workload())
    bound = lower_bound(model)
    result = search(model, SearchConfig(seed=0, allow_uneven=False))
    assert result.breakdown.total_s == pytest.approx(bound, rel=1e-9)
    # Not a trivial bound: most placements are far above it.
    assert np.mean([model.total_s(g.tolist()) for g, _ in random_placements(model, 20, seed=1)]) > 1.5 * bound
