"""The autograd state of recent training forwards, so that their backward need not recompute them.

A stage's backward is stateless by design (any replica can serve it from the inputs the request
carries), but the replica that ran a micro-batch's forward has just built the very graph the
backward needs. Keeping that graph lets the backward skip the recomputation: on CPU the forward is
about a third of a stage's forward+backward. The cache is only an optimisation: a miss, an evicted
entry, or another replica recomputes exactly as without it, so a dead peer still costs only one
recomputation elsewhere.

Used on the peer's compute thread only, under :attr:`StageRunner.lock`. Knows nothing about networks.

Memory is bounded in bytes. An entry's size is measured while its forward runs, with
:func:`torch.autograd.graph.saved_tensors_hooks`: the bytes of every distinct storage autograd saves
for backward (activations, attention probabilities, masks), plus the inputs and outputs, parameters
excluded (they are shared, not held by the entry). Whole storages are counted, so a saved view of a
larger buffer counts the buffer: the figure errs high, never low. The runner measures once per input
shape and reuses the figure (the hooks cost a Python call per saved tensor, a quarter of a small
stage's forward), since the same module saves the same tensors for inputs of the same shape.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Optional, Set, Tuple

import torch

__all__ = ["ForwardCache", "CachedForward", "measure_saved_bytes"]


@dataclass
class CachedForward:
    """One training forward's graph: ``inputs`` as the forward saw them, ``leaf`` the tensor that
    gradients flow back to (None on the first stage, whose inputs are token ids), ``outputs`` the
    graph's root, ``params_version`` the parameters it was built on, ``nbytes`` what it holds."""

    inputs: torch.Tensor
    leaf: Optional[torch.Tensor]
    outputs: torch.Tensor
    params_version: int
    nbytes: int


class ForwardCache:
    """Graphs of training forwards keyed by micro-batch id, at most ``max_bytes`` in all, oldest evicted first.

    Keys are micro-batch ids, which the handlers have already bound to their caller
    (``"<caller peer id>:..."``), so one trainer can neither use nor evict by name another's entry.
    ``max_bytes == 0`` disables the cache: nothing is stored.
    """

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: "OrderedDict[str, CachedForward]" = OrderedDict()
        self.nbytes = 0
        self.stored = self.hits = self.misses = self.evicted = self.invalidated = self.mismatched = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def put(self, key: str, entry: CachedForward) -> bool:
        """Keep ``entry`` under ``key``, evicting the oldest entries to make room; False if it cannot fit at all."""
        self.discard(key)
        if entry.nbytes > self.max_bytes:
            return False
        while self.nbytes + entry.nbytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes
            self.evicted += 1
        self._entries[key] = entry
        self.nbytes += entry.nbytes
        self.stored += 1
        return True

    def take(self, key: str, params_version: int, inputs: torch.Tensor) -> Optional[CachedForward]:
        """Remove and return the entry for ``key`` if it was built on ``params_version`` from exactly
        ``inputs``; None otherwise (the entry, if any, is dropped: the caller recomputes)."""
        entry = self._entries.pop(key, None)
        if entry is None:
            self.misses += 1
            return None
        self.nbytes -= entry.nbytes
        if entry.params_version != params_version:
            self.invalidated += 1
            self.misses += 1
            return None
        if not _same_tensor(entry.inputs, inputs):
            self.mismatched += 1
            self.misses += 1
            return None
        self.hits += 1
        return entry

    def discard(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry.nbytes

    def clear(self) -> int:
        """Drop every entry (the parameters changed, or the replica leaves its stage); returns how many."""
        dropped = len(self._entries)
        self._entries.clear()
        self.nbytes = 0
        return dropped

    def invalidate(self) -> None:
        """The parameters changed: no graph built on the old ones may serve a backward."""
        self.invalidated += self.clear()

    def stats(self) -> Dict[str, int]:
        return {
            "entries": len(self._entries),
            "bytes": self.nbytes,
            "max_bytes": self.max_bytes,
            "stored": self.stored,
            "hits": self.hits,
            "misses": self.misses,
            "evicted": self.evicted,
            "invalidated": self.invalidated,
            "mismatched": self.mismatched,
        }


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        isinstance(b, torch.Tensor)
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.device == b.device
        and bool(torch.equal(a, b))
    )


def _storage_key(tensor: torch.Tensor) -> Tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def measure_saved_bytes(fn: Callable[[], torch.Tensor], exclude: Iterator[torch.Tensor]) -> Tuple[torch.Tensor, int]:
    """Run ``fn`` (a forward with autograd on) and return its result and the bytes of the distinct storages
    autograd saved for its backward, leaving out those of ``exclude`` (the parameters)."""
    excluded: Set[Tuple[int, int]] = {_storage_key(t) for t in exclude}
    seen: Set[Tuple[int, int]] = set()
    total = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in excluded and key not in seen:
            seen.add(key)
            total[0] += key[1]
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = fn()
    return result, total[0]
