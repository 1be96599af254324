"""Discrete-event simulation of a swarm at scale, using the live routing and rebalancing policies.

Modules: ``config`` (SimConfig), ``network`` (hardware, bandwidth and latency model),
``churn`` (generated or traced joins and preemptions), ``optimum`` (exact max-min
partition), ``engine`` (events and the fluid flow model), ``experiment`` (rebalanced vs
static against the optimum).
"""

from swarm.config.simulation import SimConfig
from swarm.simulate.experiment import optimum_timeline, run_experiment
from swarm.simulate.optimum import PartitionResult, max_min_partition

__all__ = ["SimConfig", "run_experiment", "optimum_timeline", "max_min_partition", "PartitionResult"]
