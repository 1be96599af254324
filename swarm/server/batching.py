"""Merging concurrent requests into one module call: forwards always, backwards when the peer asks for it.

A stage serves many trainers; while its compute thread is busy, requests queue up. Running those that
queued meanwhile as one batch (concatenated along the batch dimension) costs one kernel launch and one
pass over the weights instead of many, which pays on GPUs and for small micro-batches.

**Forwards.** A stage's outputs are per sample, so splitting the merged output gives each request what it
would have got alone. On the last stage the module returns a loss per token (``reduction="none"``) and
each request's loss is the mean over its own tokens: the same reduction whether the request ran alone
or merged, so only the matmuls' blocking over a larger batch can change a result, by float rounding
(at most 1e-6 relative on CPU in ``tests/test_batching.py``; replicas still compare within 1e-4). A
merged call that fails is re-run one request per call, so a request that breaks the module fails alone.

Training forwards whose graph the replica keeps for their backward (:mod:`swarm.server.forward_cache`)
are not merged: they run one request per call, with autograd on. A merged graph could serve each slice's
backward only by back-propagating through the whole merged batch once per slice, or by holding every
slice's backward until all of them arrived; a graph per request costs one more kernel launch per
request instead, which is little next to the recomputation it saves. Forwards without a micro-batch id
(evaluation, spot checks, every forward of the last stage), and every forward when the cache is off, are
merged.

**Backwards** (``--merge_backward true``; off by default). Every micro-batch's parameter gradient must
be clipped and accounted on its own (:mod:`swarm.policy.poisoning`), so a merged backward cannot simply
sum the requests' gradients. :mod:`swarm.server.merged_backward` runs the requests of one shape as one
vectorised call (``torch.func.vmap`` over per-request copies of the parameters) that still yields each
micro-batch's own parameter gradient, grad_inputs and loss; the runner then clips, weighs and accounts
each one exactly as alone (:meth:`StageRunner.backward_batch`). Backwards that find their forward's
graph cached, duplicates, and requests of a shape no other request shares run alone.

Measured with ``python benchmarks/batching.py`` on this project's 2-core CPU machine (the examples'
model: 4 layers, hidden 128, seq 64, 2 stages; micro-batches of 8; one torch thread; CPU ms per
micro-batch, best of 10, while other tests shared the machine), one by one / merged:

=========================  ===========  ===========  ===========
requests merged            2            4            8
=========================  ===========  ===========  ===========
last-stage forward         8.58 / 8.84  8.43 / 7.95  7.59 / 7.30
backward, stage 0          23.5 / 27.6  21.8 / 24.7  21.3 / 26.4
backward, stage 1 (last)   24.9 / 29.4  23.2 / 24.6  23.2 / 26.3
=========================  ===========  ===========  ===========

The vectorised backward costs 6-24% more CPU than one request per call here (vmap has no batching
rule for CPU attention and loops over the requests there), although a plain summed backward, which
the per-micro-batch clip rules out, would cost 17-20% less (18.4-18.8 ms). The backward merge
therefore stays off by default; it is meant for accelerators, where a small micro-batch leaves most
of the device idle. On CUDA it computes what one request per call computes (``tests/test_cuda.py``, run on
an H100); its speed there is not measured.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Callable, Hashable, List, Optional, Sequence

import torch

__all__ = ["ForwardBatcher", "BackwardBatcher"]


@dataclass
class _Queued:
    key: Hashable  # requests merge only with requests of an equal key
    samples: int
    payload: Any
    future: asyncio.Future


class _Batcher:
    """Queue requests; each run on the compute thread takes everything queued by then that fits one batch.

    ``run_batch`` runs on the compute executor with the payloads of one batch and returns one result per
    payload, in order: a value, or the exception that request failed with."""

    def __init__(self, run_batch: Callable[[List[Any]], List[object]], executor: Executor, max_samples: int):
        self._run_batch, self.executor, self.max_samples = run_batch, executor, max_samples
        self._queue: List[_Queued] = []
        self._lock = threading.Lock()
        self.num_requests = 0
        self.num_batches = 0  # batches taken off the queue: fewer than requests when merging happened

    def __len__(self) -> int:
        return len(self._queue)

    async def _submit(self, key: Hashable, samples: int, payload: Any) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._queue.append(_Queued(key, samples, payload, future))
            self.num_requests += 1
        loop.run_in_executor(self.executor, self._run_once, loop)
        return await future

    def _take_batch(self) -> List[_Queued]:
        with self._lock:
            if not self._queue:
                return []
            key = self._queue[0].key
            batch: List[_Queued] = []
            rest: List[_Queued] = []
            samples = 0
            for item in self._queue:
                if not batch or (item.key == key and samples + item.samples <= self.max_samples):
                    batch.append(item)
                    samples += item.samples
                else:
                    rest.append(item)
            self._queue = rest
            return batch

    def _run_once(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the compute thread: run whatever is queued now (possibly nothing: an earlier run took it)."""
        batch = self._take_batch()
        if not batch:
            return
        self.num_batches += 1
        try:
            results = self._run_batch([item.payload for item in batch])
        except Exception as e:  # run_batch reports per-request failures itself; this is a failure of all
            results = [e] * len(batch)
        for item, result in zip(batch, results):
            loop.call_soon_threadsafe(_resolve, item.future, result)


class ForwardBatcher(_Batcher):
    """Merges forward requests of equal shape past the batch dimension into one ``forward_fn`` call.

    ``forward_fn(inputs)`` (or ``forward_fn(inputs, targets)`` for requests that carry targets) returns
    one output row per sample: hidden states, or the last stage's per-token losses."""

    def __init__(self, forward_fn: Callable[..., torch.Tensor], executor: Executor, max_samples: int):
        super().__init__(self._forward_batch, executor, max_samples)
        self.forward_fn = forward_fn
        self.num_calls = 0  # forward_fn calls made: fewer than requests when merging happened

    async def forward(self, inputs: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        key = (tuple(inputs.shape[1:]), inputs.dtype, None if targets is None else tuple(targets.shape[1:]))
        return await self._submit(key, int(inputs.shape[0]), (inputs, targets))

    def _call(self, inputs: torch.Tensor, targets: Optional[torch.Tensor]) -> torch.Tensor:
        self.num_calls += 1
        return self.forward_fn(inputs) if targets is None else self.forward_fn(inputs, targets)

    def _forward_batch(self, requests: List[Any]) -> List[object]:
        if len(requests) == 1:
            return [self._call(*requests[0])]
        try:
            inputs = torch.cat([x for x, _ in requests])
            targets = None if requests[0][1] is None else torch.cat([t for _, t in requests])
            outputs = self._call(inputs, targets)
        except Exception:  # one request broke the merged call: find which, by running each alone
            return [_outcome(self._call, x, t) for x, t in requests]
        return list(torch.split(outputs, [int(x.shape[0]) for x, _ in requests]))


class BackwardBatcher(_Batcher):
    """Merges backward requests of one shape; ``backward_batch`` (:meth:`StageRunner.backward_batch`)
    gets a list of argument tuples for :meth:`StageRunner.backward` and returns one result per request."""

    def __init__(self, backward_batch: Callable[[Sequence[tuple]], List[object]], executor: Executor, max_samples: int):
        super().__init__(backward_batch, executor, max_samples)

    async def backward(self, micro_batch_id: str, inputs: Any, grad_outputs: Any, targets: Any) -> Any:
        """The result of ``StageRunner.backward(micro_batch_id, inputs, grad_outputs, targets)``."""
        if isinstance(inputs, torch.Tensor):
            key: Hashable = (tuple(inputs.shape), inputs.dtype)
            samples = int(inputs.shape[0]) if inputs.ndim else 1
        else:  # malformed: it runs alone and fails there
            key, samples = object(), 1
        return await self._submit(key, samples, (micro_batch_id, inputs, grad_outputs, targets))


def _outcome(fn: Callable[..., Any], *args: Any) -> object:
    try:
        return fn(*args)
    except Exception as e:
        return e


def _resolve(future: asyncio.Future, result: object) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
