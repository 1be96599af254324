"""Constructive starting placements: cheap guesses that put the search near good regions.

Two shapes recur in good plans: stages made of nearby devices (cheap all-reduce, costly
hops between stages), and stages that each take one device from every site (costly
all-reduce, but every pipeline hop can stay inside a site). Both start from one proximity
order of the devices, from average-linkage clustering over pipeline link costs, so they
need no region labels and work for any network.
"""

from __future__ import annotations

import numpy as np
from scipy.cluster.hierarchy import leaves_list, linkage
from scipy.spatial.distance import squareform

from swarm.planner.cost import CostModel

__all__ = [
    "proximity_order",
    "clustered_groups",
    "striped_groups",
    "grid_groups",
    "block_striped_groups",
    "type_orders",
]


def proximity_order(model: CostModel) -> np.ndarray:
    """Devices ordered so that devices with cheap links between them sit next to each other."""
    n = model.num_devices
    if n <= 2:
        return np.arange(n)
    distance = model.pp_link.copy()
    np.fill_diagonal(distance, 0.0)
    distance = (distance + distance.T) / 2.0
    return leaves_list(linkage(squareform(distance, checks=False), method="average"))


def grid_groups(model: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """Region-blind placement: devices in index order, D at a time; leftovers unused."""
    size = model.nominal_replicas
    used = model.num_stages * size
    order = np.arange(model.num_devices)
    return order[:used].reshape(model.num_stages, size), order[used:]


def clustered_groups(model: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """Consecutive runs of the proximity order: each stage is one tight cluster."""
    size = model.nominal_replicas
    order = proximity_order(model)
    used = model.num_stages * size
    return order[:used].reshape(model.num_stages, size), order[used:]


def striped_groups(model: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """The proximity order dealt round-robin: each stage spans the clusters."""
    size = model.nominal_replicas
    order = proximity_order(model)
    used = model.num_stages * size
    return order[:used].reshape(size, model.num_stages).T.copy(), order[used:]


def block_striped_groups(
    model: CostModel, block: int, order: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """A device order (default: the proximity order) cut into runs of ``block`` groups' worth,
    each run dealt round-robin over its ``block`` groups.

    Between clustered (block 1) and striped (block S): ``block`` consecutive stages share
    their sites, so the hops inside a block stay on cheap links while each all-reduce spans
    only a few sites. Plans of this shape are optimal in several of the paper's networks
    (e.g. spot instances: the single GPUs fill half the stages, the 4-GPU instances are
    spread over the other half so that every hop there stays inside an instance).
    """
    s, size = model.num_stages, model.nominal_replicas
    if block < 1 or s % block:
        raise ValueError(f"block must divide num_stages ({s}), got {block!r}")
    order = proximity_order(model) if order is None else np.asarray(order)
    used = s * size
    runs = order[:used].reshape(s // block, size, block)
    return runs.transpose(0, 2, 1).reshape(s, size).copy(), order[used:]


def type_orders(labels: np.ndarray) -> list[np.ndarray]:
    """Device orders that keep twins together: types as listed, and largest types first."""
    sizes = np.bincount(labels)
    by_label = np.argsort(labels, kind="stable")
    by_size = np.lexsort((labels, -sizes[labels]))
    return [by_label, by_size]
