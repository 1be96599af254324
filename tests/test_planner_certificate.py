"""The optimality certificate of swarm.planner: sound on brute-forced networks, and
it proves the regional optimum (which the paper's GA also reaches) and the world-wide one."""

from itertools import permutations

import numpy as np
import pytest

from swarm.planner import CostModel, Network, SearchConfig, Workload, load_scenario, search
from swarm.planner.balanced import FastCost
from swarm.planner.certificate import admissible_rows, certify_optimal, class_is_empty, type_clusters
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


def test_type_clusters_split_at_the_widest_gap():
    typed = TypedCost(CostModel(load_scenario("world-wide"), Workload()))
    names = ["Oregon", "Virginia", "Ohio", "Tokyo", "Seoul", "London", "Frankfurt", "Ireland"]
    labels = type_clusters(typed)
    asia = {labels[names.index("Tokyo")], labels[names.index("Seoul")]}
    assert len(asia) == 1 and len(set(labels)) == 2  # Asia vs the rest


def test_class_is_empty_counts_distinct_rows():
    typed = TypedCost(CostModel(load_scenario("regional"), Workload()))  # 4 sites x 16, 8 groups of 8
    data = admissible_rows(typed, float("inf"))

    def empty(keep, k):
        return class_is_empty(typed, data, keep, k, k, float("inf"), float("inf"), price=False)

    everything = np.ones(len(data.rows), dtype=bool)
    assert not empty(everything, 1)  # two of each site, eight times
    single_site = (data.rows == 8).any(1)  # whole groups at one site: two groups per site
    assert empty(single_site, 3) and not empty(single_site, 4)
    three_sites = single_site & (np.cumsum(single_site) <= 3)
    assert empty(three_sites, 8)  # a site left out: its devices cannot all be placed


def test_regional_optimum_is_certified():
    model = CostModel(load_scenario("regional"), Workload())
    typed = TypedCost(model)
    found = search(model, SearchConfig(seed=0, allow_uneven=False)).breakdown.total_s
    assert certify_optimal(typed, found)
    assert not certify_optimal(typed, found * 1.001)


@pytest.mark.long
def test_world_wide_optimum_is_certified():
    """One device of every region per stage is the optimum of the equal-group problem: half the
    random mean (about 47 s) cannot be reached under this cost model."""
    model = CostModel(load_scenario("world-wide"), Workload())
    typed = TypedCost(model)
    per_region = [[8 * region + k for region in range(8)] for k in range(8)]
    cost = model.total_s(per_region)
    assert cost == pytest.approx(49.708, abs=1e-3)
    assert certify_optimal(typed, cost)
    assert not certify_optimal(typed, cost * 1.001)
