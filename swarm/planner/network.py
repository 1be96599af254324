"""The network a plan is made for: per-pair latency and bandwidth, optional per-device speed.

A plain value object, validated on construction so that every later stage (cost model,
search, CLI) can trust it: square matrices of one shape, finite, latency >= 0, bandwidth > 0
between distinct devices. The diagonal (a device to itself) is never used and is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

__all__ = ["Network"]


def _off_diagonal(matrix: np.ndarray) -> np.ndarray:
    return matrix[~np.eye(matrix.shape[0], dtype=bool)]


@dataclass(frozen=True)
class Network:
    """Measured links between N devices.

    latency_s: (N, N) one-way latency in seconds, as used by the paper's cost model.
    bandwidth_bytes_per_s: (N, N) bandwidth in bytes per second.
    compute_tflops: optional (N,) effective training throughput of each device in TFLOP/s;
        None means "all equal, leave compute out of the cost" (the paper's model).
    names: one label per device (for printing); regions: the site of each device, if known
        (used to print plans and to seed the search with region-aware placements).
    """

    latency_s: np.ndarray
    bandwidth_bytes_per_s: np.ndarray
    compute_tflops: Optional[np.ndarray] = None
    names: tuple[str, ...] = field(default=())
    regions: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        latency = np.array(self.latency_s, dtype=float)
        bandwidth = np.array(self.bandwidth_bytes_per_s, dtype=float)
        if latency.ndim != 2 or latency.shape[0] != latency.shape[1] or latency.shape[0] < 1:
            raise ValueError(f"latency_s must be a square N x N matrix, got shape {latency.shape}")
        if bandwidth.shape != latency.shape:
            raise ValueError(f"bandwidth_bytes_per_s has shape {bandwidth.shape}, latency_s has {latency.shape}")
        n = latency.shape[0]
        if not np.isfinite(_off_diagonal(latency)).all():
            raise ValueError("latency_s has NaN or infinite entries")
        if (_off_diagonal(latency) < 0).any():
            raise ValueError("latency_s has negative entries")
        if not np.isfinite(_off_diagonal(bandwidth)).all():
            raise ValueError("bandwidth_bytes_per_s has NaN or infinite entries")
        if (_off_diagonal(bandwidth) <= 0).any():
            raise ValueError("bandwidth_bytes_per_s must be positive between distinct devices")
        np.fill_diagonal(latency, 0.0)
        np.fill_diagonal(bandwidth, np.inf)
        object.__setattr__(self, "latency_s", latency)
        object.__setattr__(self, "bandwidth_bytes_per_s", bandwidth)
        self._set_compute(n)
        names = tuple(self.names) or tuple(f"dev{i}" for i in range(n))
        if len(names) != n:
            raise ValueError(f"names has {len(names)} entries for {n} devices")
        object.__setattr__(self, "names", names)
        if self.regions and len(self.regions) != n:
            raise ValueError(f"regions has {len(self.regions)} entries for {n} devices")
        object.__setattr__(self, "regions", tuple(self.regions))

    def _set_compute(self, n: int) -> None:
        if self.compute_tflops is None:
            return
        speed = np.array(self.compute_tflops, dtype=float).reshape(-1)
        if speed.shape != (n,):
            raise ValueError(f"compute_tflops has {speed.size} entries for {n} devices")
        if not np.isfinite(speed).all() or (speed <= 0).any():
            raise ValueError("compute_tflops must be finite and positive")
        object.__setattr__(self, "compute_tflops", speed)

    @property
    def num_devices(self) -> int:
        return int(self.latency_s.shape[0])
