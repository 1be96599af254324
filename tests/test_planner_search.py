"""Searches of swarm.planner: never worse than their starts, deterministic, beyond-the-paper moves."""

import numpy as np
import pytest

from swarm.planner import (
    CostModel, GeneticConfig, Network, SearchConfig, Workload, best_of_random, genetic_search,
    load_scenario, search,
)


def test_search_never_worse_than_best_random():
    model = CostModel(load_scenario("regional"), Workload())
    placement, best_s = best_of_random(model, 50, seed=1)
    result = search(model, SearchConfig(time_budget_s=1.0, seed=0, num_chains=1, max_evaluations=5),
                    initial=[placement])
    assert result.breakdown.total_s <= best_s + 1e-9


def test_search_is_deterministic_for_a_seed():
    model = CostModel(load_scenario("multiple-universities"), Workload())
    config = SearchConfig(time_budget_s=30.0, seed=7, allow_uneven=False, max_evaluations=300)
    first, second = search(model, config), search(model, config)
    assert first.breakdown.allocation == second.breakdown.allocation
    assert first.breakdown.total_s == second.breakdown.total_s


def test_search_beats_genetic_world_wide_short_budget():
    model = CostModel(load_scenario("world-wide"), Workload())
    ours = search(model, SearchConfig(time_budget_s=2.0, seed=0))
    theirs = genetic_search(model, GeneticConfig(time_budget_s=2.0, seed=0))
    assert ours.breakdown.total_s < theirs.breakdown.total_s
    assert sorted(d for g in theirs.breakdown.allocation.stages for d in g) == list(range(64))


def test_search_leaves_out_a_very_slow_device():
    n = 6
    latency, bandwidth = np.full((n, n), 0.001), np.full((n, n), 1e10)
    speed = np.full(n, 100.0)
    speed[4] = 1.0
    model = CostModel(Network(latency, bandwidth, compute_tflops=speed), Workload(num_layers=2, num_stages=2))
    equal = search(model, SearchConfig(time_budget_s=2.0, seed=0, allow_uneven=False))
    uneven = search(model, SearchConfig(time_budget_s=2.0, seed=0))
    assert 4 in uneven.breakdown.allocation.unused
    assert uneven.breakdown.total_s < equal.breakdown.total_s
    assert equal.breakdown.allocation.unused == ()


def test_search_config_validation():
    with pytest.raises(ValueError, match="time_budget_s"):
        SearchConfig(time_budget_s=0)
    with pytest.raises(ValueError, match="population_size"):
        GeneticConfig(population_size=1)
