"""The optimality certificate of swarm.planner (issue 4): sound on brute-forced networks, and
it proves the regional optimum that the paper's GA also reaches."""

from itertools import permutations

import numpy as np
import pytest

from swarm.planner import CostModel, Network, SearchConfig, Workload, load_scenario, search
from swarm.planner.balanced import FastCost
from swarm.planner.certificate import certify_optimal, fewest_distinct_rows, pair_floor
from swarm.planner.bounds import enumerate_rows
from swarm.planner.symmetry import TypedCost


def _sites_network(sizes, rng) -> Network:
    sites = [k for k, n in enumerate(sizes) for _ in range(n)]
    ms, gb = rng.uniform(5, 150, (len(sizes),) * 2), rng.uniform(0.3, 1.5, (len(sizes),) * 2)
    ms, gb = (ms + ms.T) / 2, (gb + gb.T) / 2
    lat = np.array([[5.0 if a == b else ms[a, b] for b in sites] for a in sites]) / 1e3
    gbps = np.array([[2.0 if a == b else gb[a, b] for b in sites] for a in sites])
    return Network(lat, gbps * 1.25e8)


def _brute_force_optimum(model: CostModel) -> float:
    fast, s, size = FastCost(model), model.num_stages, model.nominal_replicas
    return min(fast.total(np.array(p).reshape(s, size)) for p in permutations(range(model.num_devices)))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("sizes,stages", [([3, 2, 1], 3), ([2, 2, 2], 2), ([4, 2], 3)])
def test_never_certifies_a_cost_that_can_be_beaten(seed, sizes, stages):
    model = CostModel(_sites_network(sizes, np.random.default_rng(seed)), Workload(num_layers=6, num_stages=stages))
    typed = TypedCost(model)
    optimum = _brute_force_optimum(model)
    assert not certify_optimal(typed, optimum * 1.001)
    assert not certify_optimal(typed, optimum + 10.0)


def test_pair_floor_is_below_every_exact_edge():
    model = CostModel(load_scenario("world-wide"), Workload())
    typed = TypedCost(model)
    rows = enumerate_rows(typed.type_sizes, typed.size)[::97]
    floor = pair_floor(typed, rows)
    exact = min(typed.row_edge_s(x, y) for i, x in enumerate(rows) for y in rows[i + 1:])
    assert 0 < floor <= exact + 1e-12


def test_fewest_distinct_rows():
    model = CostModel(load_scenario("regional"), Workload())  # 4 sites x 16, 8 groups of 8
    typed = TypedCost(model)
    rows = enumerate_rows(typed.type_sizes, typed.size)
    assert fewest_distinct_rows(typed, rows) == 1  # two of each site, eight times
    single_site = rows[(rows == 8).any(1)]  # whole groups at one site: two groups per site
    assert fewest_distinct_rows(typed, single_site) == 4
    assert fewest_distinct_rows(typed, single_site[:3]) == float("inf")  # a site left out


def test_regional_optimum_is_certified():
    model = CostModel(load_scenario("regional"), Workload())
    typed = TypedCost(model)
    found = search(model, SearchConfig(seed=0, allow_uneven=False)).breakdown.total_s
    assert certify_optimal(typed, found)
    assert not certify_optimal(typed, found * 1.001)
