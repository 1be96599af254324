"""Merging concurrent forward requests into one module call.

A stage serves many trainers; while its compute thread is busy, forward requests queue up. Running
those that queued meanwhile as one batch (concatenated along the batch dimension) costs one kernel
launch and one pass over the weights instead of many, which pays on GPUs and for small
micro-batches. Only forward passes of non-final stages are merged: their outputs are per-sample,
so splitting the batch's output gives each request exactly what it would have got alone. (Backward
passes stay one request per call: their gradients are accounted per micro-batch.)

Training forwards whose graph the replica keeps for their backward (:mod:`swarm.server.forward_cache`)
are not merged: they run one request per call, with autograd on. A merged graph could serve each
slice's backward only by back-propagating through the whole merged batch once per slice (autograd has
no cheaper way to reach one slice's share of the weights' gradients), or by holding every slice's
backward until all of them arrived; a graph per request costs one more kernel launch per request
instead, which is little next to the recomputation it saves. Forwards without a micro-batch id
(evaluation, spot checks), and every forward when the cache is off, are merged as before.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Executor
from typing import Callable, Dict, List, Tuple

import torch

__all__ = ["ForwardBatcher"]


class ForwardBatcher:
    """Queue forward requests; each run on the compute thread takes everything queued by then.

    ``forward_fn`` runs on the compute executor with one concatenated input tensor. Requests are
    grouped by their shape past the batch dimension; a batch holds at most ``max_samples`` samples.
    """

    def __init__(self, forward_fn: Callable[[torch.Tensor], torch.Tensor], executor: Executor, max_samples: int):
        self.forward_fn, self.executor, self.max_samples = forward_fn, executor, max_samples
        self._queue: List[Tuple[torch.Tensor, asyncio.Future]] = []
        self._lock = threading.Lock()
        self.num_calls = 0  # module calls made: fewer than requests when batching happened
        self.num_requests = 0

    def __len__(self) -> int:
        return len(self._queue)

    async def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._queue.append((inputs, future))
            self.num_requests += 1
        loop.run_in_executor(self.executor, self._run_once, loop)
        return await future

    def _take_batch(self) -> List[Tuple[torch.Tensor, asyncio.Future]]:
        with self._lock:
            if not self._queue:
                return []
            shape = tuple(self._queue[0][0].shape[1:])
            batch, rest, samples = [], [], 0
            for item in self._queue:
                fits = tuple(item[0].shape[1:]) == shape and samples + item[0].shape[0] <= self.max_samples
                if fits or not batch:
                    batch.append(item)
                    samples += item[0].shape[0]
                else:
                    rest.append(item)
            self._queue = rest
            return batch

    def _run_once(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the compute thread: run whatever is queued now (possibly nothing: an earlier run took it)."""
        batch = self._take_batch()
        if not batch:
            return
        self.num_calls += 1
        try:
            outputs = self.forward_fn(torch.cat([inputs for inputs, _ in batch]))
            results: Dict[int, object] = {}
            offset = 0
            for i, (inputs, _) in enumerate(batch):
                results[i] = outputs[offset: offset + inputs.shape[0]]
                offset += inputs.shape[0]
        except Exception as e:
            results = {i: e for i in range(len(batch))}
        for i, (_, future) in enumerate(batch):
            loop.call_soon_threadsafe(_resolve, future, results[i])


def _resolve(future: asyncio.Future, result: object) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
