"""The torch side of a stage peer: one stage's module, optimizer and gradient accumulator.

Runs on the peer's single compute thread (see :class:`swarm.server.peer.StagePeer`); a lock
guards the state against the averager's state-sharing thread. Knows nothing about networks.

Backward needs no state (as in SWARM): a backward request carries the stage's input again, so any
replica can serve it by recomputing the forward, and a peer that dies between a micro-batch's forward
and backward costs one recomputation elsewhere, nothing more. The replica that ran the micro-batch's
training forward (:meth:`StageRunner.forward_train`) keeps its graph in a byte-bounded
:class:`~swarm.server.forward_cache.ForwardCache` and skips the recomputation when the backward comes
back to it, on the same parameters and with the very same inputs; everything else recomputes.

The optimizer steps host copies of the parameters (on the CPU, the parameters themselves) and a
replica on a GPU copies the result back after each global step. CUDA's float32 kernels round differently
from the CPU's: replicas on both kinds of device that stepped on their own devices would end a step with
different bits, take each other for diverged and download each other's state at every step. Adam's
moments stay in host memory too, off the GPU.

Gradients are double-buffered: when the swarm reaches the global batch, the accumulated sum
is *frozen* for averaging and a fresh accumulator starts for the next step, so compute never
waits for the all-reduce (backward passes computed meanwhile see parameters one step old).

What one trainer's micro-batch adds is bounded (decisions in :mod:`swarm.policy.poisoning`): its
gradient is clipped to a per-sample bound derived from recent norms, and on the last stage a trainer
whose targets cost persistently more than the model expects is down-weighted. With ``run.defences``
off every micro-batch is added as sent.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, ContextManager, Dict, List, Mapping, Optional, Sequence, Set, Tuple, overload

import torch
from hivemind.utils import get_logger

from swarm.config.settings import RunConfig
from swarm.model.devices import synchronize
from swarm.model.finite import all_finite
from swarm.model.footprint import COMPUTE_DTYPES
from swarm.model.stages import PipelineStage, build_stage, stage_skeleton
from swarm.training.optimizer import batch_share, make_optimizer, optimizer_step
from swarm.policy.poisoning import ContributionGuard, PoisoningConfig, trainer_of
from swarm.server.forward_cache import CachedForward, ForwardCache, measure_saved_bytes
from swarm.server.merged_backward import merged_backward, predictive_entropy
from swarm.server.throughput import ThroughputMeter

__all__ = ["StageRunner", "FrozenStep", "ThroughputMeter", "parameter_digest", "LossScale"]

logger = get_logger(__name__)
SPEED_TEST_ROUNDS = 5  # timed rounds of a replica's speed test at most (the fastest counts)
SPEED_TEST_BUDGET_S = 1.0  # no further round once the timed ones took this long (a slow device: one round)
MAX_MEASURED_SHAPES = 64  # input shapes whose graph size is remembered (measuring costs a hook call per saved tensor)


def parameter_digest(params: Sequence[torch.Tensor]) -> str:
    """A hash of parameter values (their raw bytes, in order): replicas at the same step must
    announce the same one, and a downloaded state must hash to what its sender announced."""
    h = hashlib.blake2b(digest_size=8)
    for p in params:
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


@dataclass
class FrozenStep:
    """The gradients of one global step, taken out of the accumulator for averaging."""

    step: int
    samples: int
    mean_grads: List[torch.Tensor]
    micro_batch_ids: Set[str] = field(default_factory=set)


def _check_grad_outputs(grad_outputs: Any, outputs: torch.Tensor, where: str) -> torch.Tensor:
    """``grad_outputs``, once it proves to be a tensor fit for ``outputs``. Compares shape and dtype only (wherever
    ``outputs`` live: no copy), then checks the values."""
    if not isinstance(grad_outputs, torch.Tensor):
        raise ValueError(f"{where}: grad_outputs must be a tensor")
    if grad_outputs.shape != outputs.shape or grad_outputs.dtype != outputs.dtype:
        raise ValueError(
            f"{where}: grad_outputs must be {outputs.dtype} of shape {tuple(outputs.shape)}, "
            f"got {grad_outputs.dtype} of shape {tuple(grad_outputs.shape)}"
        )
    if not all_finite(grad_outputs):
        raise ValueError(f"{where}: grad_outputs contain NaN or inf values")
    return grad_outputs


@dataclass
class LossScale:
    """Dynamic loss scaling for float16 compute, whose gradients underflow below 6e-8: backward runs on the
    cotangents times :attr:`scale` and divides the parameter gradients by it before they are accumulated. A
    micro-batch whose gradients overflow is not accumulated and halves the scale; ``growth_interval`` clean
    micro-batches in a row double it."""

    scale: float = 2.0**16
    growth_interval: int = 200  # clean micro-batches in a row before the scale doubles
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    clean: int = 0  # clean micro-batches since the scale last changed

    def update(self, overflowed: bool) -> None:
        """Record one micro-batch's outcome."""
        if overflowed:
            self.scale, self.clean = max(self.scale / 2, self.min_scale), 0
            return
        self.clean += 1
        if self.clean >= self.growth_interval:
            self.scale, self.clean = min(self.scale * 2, self.max_scale), 0


def _check_compute_dtype(dtype: str, device: torch.device) -> None:
    """ValueError unless ``device`` can compute in ``dtype`` under autocast."""
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {dtype!r}")
    if dtype == "fp16" and device.type != "cuda":
        raise ValueError(f"dtype fp16 needs a CUDA device (loss-scaled CUDA autocast), got {device}; use bf16 or fp32")
    if dtype == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"{device} has no bfloat16 support; use --dtype fp16 (loss-scaled) or fp32")
    if dtype != "fp32" and device.type == "mps":
        raise ValueError(f"dtype {dtype} is not supported on {device}; use fp32")


class StageRunner:
    """One replica of one stage: compute, accumulate, step, and export/import its state."""

    def __init__(
        self,
        run: RunConfig,
        stage_index: int,
        device: str = "cpu",
        poisoning: Optional[PoisoningConfig] = None,
        forward_cache_bytes: int = 0,
        dtype: str = "fp32",
        checkpoint_activations: bool = False,
        initial: Optional[Mapping[str, torch.Tensor]] = None,
    ):
        self.run, self.stage_index, self.device = run, stage_index, torch.device(device)
        _check_compute_dtype(dtype, self.device)
        # the module's weights and gradients stay float32; autocast computes in ``dtype`` (fp16 loss-scaled)
        self.dtype = dtype
        self.loss_scale: Optional[LossScale] = LossScale() if dtype == "fp16" else None
        self.samples_processed = 0  # samples this replica ran backward for: its share of the work
        # ``initial``: the stage's tensors (keyed as its state_dict) to start from instead of its seeded initialisation
        self.module: PipelineStage = self._build_module(initial).to(self.device)
        self.module.checkpoint_activations = checkpoint_activations
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        # the optimizer steps host copies of the parameters on every device (the same tensors on the CPU)
        self.masters = (
            self.params
            if self.device.type == "cpu"
            else [torch.nn.Parameter(p.detach().cpu().clone()) for p in self.params]
        )
        self.optimizer = make_optimizer(self.masters, run.optimizer)
        self._init_optimizer_state()
        self.lock = threading.RLock()
        self.meter = ThroughputMeter()
        self.step = 0  # global steps applied to the parameters
        self.accum_step = 0  # the step that new gradients accumulate into
        self.samples_applied = 0  # samples inside all applied steps
        # states adopted so far, and the lowest step whose gradients the latest adoption dropped: a trainer
        # whose micro-batch this replica took before an adoption learns from these whether it may be gone
        self.resets, self.reset_from = 0, 0
        self.samples_pending = 0
        self.pending_ids: Set[str] = set()
        self.grad_sum = [torch.zeros_like(p) for p in self.params]
        self.frozen: Optional[FrozenStep] = None
        # (step, digest of the parameters) as one value: other threads read the pair from it, never torn between a
        # step applied and its parameters hashed (the two change one after the other on the compute thread)
        self.version: Tuple[int, str] = (self.step, self._digest())
        self.params_version = 0  # bumped whenever the parameters change: a cached graph must match it
        # the last stage's training forward is its backward call: nothing to cache there
        self.forward_cache = ForwardCache(0 if self.module.is_last else forward_cache_bytes)
        self.num_forwards = 0  # module forward passes run, recomputations included
        self.num_recomputed = 0  # backward passes that recomputed their forward
        self._saved_bytes: Dict[Tuple[Tuple[int, ...], torch.dtype], int] = {}  # input shape -> bytes autograd saves
        # bounds on what one trainer's micro-batches contribute (swarm.policy.poisoning); None = defences off
        self.guard = ContributionGuard(poisoning or PoisoningConfig()) if run.defences else None
        self._deferred: List[
            Tuple[str, int, Sequence[torch.Tensor], float]
        ] = []  # (trainer, batch, grads, norm) not added yet
        self._entropy: Optional[float] = None  # mean entropy of the last stage's latest predictions (nats)
        self._merging = False  # a merged backward runs: it measures each request's entropy itself
        if self.guard is not None and self.module.is_last:
            self.module.lm_head.register_forward_hook(self._capture_entropy)

    def _build_module(self, initial: Optional[Mapping[str, torch.Tensor]]) -> PipelineStage:
        run = self.run
        if initial is None:
            return build_stage(run.model, self.stage_index, run.num_stages, run.seed)
        module = stage_skeleton(run.model, self.stage_index, run.num_stages)
        module.allocate("cpu")
        module.load_state_dict(dict(initial), strict=True)
        return module

    @property
    def where(self) -> str:
        return f"stage {self.stage_index}"

    def _init_optimizer_state(self) -> None:
        # AdamW initialises its state lazily; creating it now gives the state a fixed schema to share
        for p in self.masters:
            self.optimizer.state[p] = {
                "step": torch.zeros((), dtype=torch.float32),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }

    def _autocast(self) -> ContextManager:
        """Where the module computes: in float32, or under autocast in the compute dtype (float32 weights)."""
        if self.dtype == "fp32":
            return nullcontext()
        return torch.autocast(self.device.type, dtype=COMPUTE_DTYPES[self.dtype])

    @overload
    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor: ...

    @overload
    def _to_device(self, tensor: None) -> None: ...

    @overload
    def _to_device(self, tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]: ...

    def _to_device(self, tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if tensor is None else tensor.to(self.device)

    @torch.no_grad()
    def forward(
        self, inputs: torch.Tensor, targets: Optional[torch.Tensor] = None, reduction: str = "mean"
    ) -> torch.Tensor:
        """Stage output (hidden states, or the loss on the last stage: the mean, or with ``reduction="none"``
        one per token) without touching gradients."""
        self.module.check_inputs(inputs, targets)
        start = time.perf_counter()
        with self.lock:
            self.num_forwards += 1
            with self._autocast():
                output = self.module(self._to_device(inputs), self._to_device(targets), reduction)
            output = output.float().cpu()
        if not self.module.is_last:
            self.meter.update("forward", inputs.shape[0], time.perf_counter() - start)
        return output

    def forward_per_sample(self, inputs: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """What merged forwards run: an output row per sample (hidden states, or the last stage's per-token
        losses, whose mean over a request's own tokens is that request's loss, merged or alone)."""
        return self.forward(inputs, targets, reduction="none")

    @torch.no_grad()
    def last_logits(self, inputs: torch.Tensor) -> torch.Tensor:
        """The last stage's next-token logits at each sample's last position, [batch, vocab] float32: what a
        generating client samples from (one row per sample keeps the reply small). Nothing is accumulated,
        cached or counted as served work beyond the forward itself."""
        if not self.module.is_last:
            raise ValueError(f"{self.where} has no LM head: only the last stage computes logits")
        # logits need no targets: zero ids stand in for them, so that the module's checks of the inputs run unchanged
        stand_in = (
            torch.zeros(tuple(inputs.shape[:2]), dtype=torch.long)
            if isinstance(inputs, torch.Tensor) and inputs.ndim >= 2
            else None
        )
        self.module.check_inputs(inputs, stand_in)
        with self.lock:
            self.num_forwards += 1
            logits = self.module.logits(inputs.to(self.device))
            return logits[:, -1, :].float().cpu()

    def forward_train(self, micro_batch_id: str, inputs: torch.Tensor) -> torch.Tensor:
        """The stage output of a training forward, keeping its graph for the micro-batch's backward
        (when the cache is on and the graph fits); the same values as :meth:`forward`."""
        if not self.forward_cache.enabled:
            return self.forward(inputs)
        self.module.check_inputs(inputs, None)
        start = time.perf_counter()
        shape = (tuple(inputs.shape), inputs.dtype)
        with self.lock:
            saved = self._saved_bytes.get(shape)
            leaf, outputs, measured = self._graph(inputs, None, measure=saved is None)
            if saved is None:  # the same module saves the same tensors for the same input shape: measure once
                if len(self._saved_bytes) >= MAX_MEASURED_SHAPES:
                    self._saved_bytes.clear()
                saved = self._saved_bytes[shape] = measured
            io_bytes = outputs.numel() * outputs.element_size() + inputs.numel() * inputs.element_size()
            entry = CachedForward(inputs, leaf, outputs, self.params_version, saved + io_bytes)
            self.forward_cache.put(micro_batch_id, entry)
            result = outputs.detach().cpu()
        self.meter.update("forward", inputs.shape[0], time.perf_counter() - start)
        return result

    def _graph(
        self, inputs: torch.Tensor, targets: Optional[torch.Tensor], measure: bool = False, count: bool = True
    ) -> Tuple[Optional[torch.Tensor], torch.Tensor, int]:
        """Run the forward with autograd on: (the input leaf gradients flow to, or None on the first
        stage; the outputs; bytes autograd saved for backward, when ``measure``). ``count``: a forward
        of served work (``num_forwards``), not of the replica's speed test."""
        if count:
            self.num_forwards += 1
        x = self._to_device(inputs)
        leaf = None if self.module.is_first else x.detach().requires_grad_(True)

        def run() -> torch.Tensor:  # outputs leave (and cotangents arrive) in float32 whatever the compute dtype
            with self._autocast():
                return self.module(x if leaf is None else leaf, self._to_device(targets)).float()

        with torch.enable_grad():
            if measure:
                outputs, saved = measure_saved_bytes(run, iter(self.params))
            else:
                outputs, saved = run(), 0
        return leaf, outputs, saved

    def backward(
        self,
        micro_batch_id: str,
        inputs: torch.Tensor,
        grad_outputs: Optional[torch.Tensor],
        targets: Optional[torch.Tensor] = None,
        accumulate: bool = True,
    ) -> Tuple[Optional[torch.Tensor], Optional[float], int]:
        """Accumulate parameter gradients of one micro-batch; return (grad_inputs, loss, accum_step).

        The forward's graph comes from the cache when this replica ran the micro-batch's training
        forward on the current parameters from exactly ``inputs``; otherwise the forward is recomputed.
        With ``accumulate=False`` (a trainer checking another replica's reply) the forward is always
        recomputed and nothing is accumulated or counted: the same grad_inputs and loss, no change to
        the replica's state.

        On the last stage ``grad_outputs`` is None and the loss is the objective. A micro-batch id
        already accumulated into this replica's current or frozen step is not counted again.
        """
        self.module.check_inputs(inputs, targets)
        batch = int(inputs.shape[0])
        start = time.perf_counter()
        with self.lock:
            cached = (
                self.forward_cache.take(micro_batch_id, self.params_version, inputs)
                if accumulate and self.forward_cache.enabled
                else None
            )
            if cached is not None:
                leaf, outputs = cached.leaf, cached.outputs
            else:
                self.num_recomputed += 1
                leaf, outputs, _ = self._graph(inputs, targets)
            with torch.enable_grad():
                if self.module.is_last:  # a down-weighted trainer's loss counts with its weight, here and below
                    grad_outputs = torch.full_like(outputs, self._loss_weight(micro_batch_id, outputs))
                else:
                    grad_outputs = _check_grad_outputs(grad_outputs, outputs, self.where)
                wrt = self.params if leaf is None else [leaf, *self.params]
                grads = self._scaled_grad(outputs, wrt, self._to_device(grad_outputs))
            grad_inputs = None if leaf is None else grads[0].cpu()
            param_grads = grads if leaf is None else grads[1:]
            if not all(all_finite(g) for g in (grads if self.loss_scale is not None else param_grads)):
                self._overflowed(accumulate)
            if accumulate:
                accum_step = self._accumulate(micro_batch_id, batch, param_grads)
                self.samples_processed += batch
                if self.loss_scale is not None:
                    self.loss_scale.update(overflowed=False)
            else:
                accum_step = self.accum_step
        self._after_backward_compute(batch)
        kind = "forward_backward" if self.module.is_last else "backward"
        self.meter.update(kind, batch, time.perf_counter() - start)
        loss = float(outputs.detach()) if self.module.is_last else None
        return grad_inputs, loss, accum_step

    def _after_backward_compute(self, samples: int) -> None:
        """Runs on the compute thread once backward work on ``samples`` samples is computed, outside the lock:
        within the time the meter takes of a served backward or of a timed round of the speed test, after the
        timing of a merged backward. Nothing is left to do here; a runner that emulates a slower device
        (:class:`swarm.server.slow_device.SlowDeviceRunner`) waits in it."""

    def _scaled_grad(
        self, outputs: torch.Tensor, wrt: Sequence[torch.Tensor], cotangents: torch.Tensor
    ) -> Sequence[torch.Tensor]:
        """Gradients of ``outputs`` along ``cotangents``; under fp16, computed on scaled cotangents and unscaled
        (in float32: the parameters are float32) before anyone reads them."""
        if self.loss_scale is None:
            return torch.autograd.grad(outputs, wrt, cotangents)
        scale = self.loss_scale.scale
        return [g / scale for g in torch.autograd.grad(outputs, wrt, cotangents * scale)]

    def _overflowed(self, accumulate: bool) -> None:
        """A micro-batch's gradients are not finite: under fp16 the loss scale was too large (halve it, and the
        trainer sends the micro-batch again); otherwise the request itself is at fault. Raises either way."""
        if self.loss_scale is not None:
            scale = self.loss_scale.scale
            if accumulate:
                self.loss_scale.update(overflowed=True)
            raise ValueError(
                f"{self.where}: float16 gradients overflowed at loss scale {scale:g} (now "
                f"{self.loss_scale.scale:g}); not accumulated, send it again"
            )
        raise ValueError(f"{self.where}: this request produces non-finite gradients; not accumulated")

    def measure_speed(self, samples: int) -> float:
        """Time forward and backward passes of ``samples`` made-up samples, as served calls are timed
        (:meth:`_after_backward_compute` included), set the meter's figures to the fastest round's, and return
        the samples/s the meter then gives.

        A replica that has served nothing yet, or nothing for the meter's ``stale_s``, would otherwise
        announce 0 (unknown), and trainers would learn its speed only by sending it micro-batches: on
        a replica 50x slower than its stage-mates each such probe holds a trainer's slot for 50x a
        normal call. One untimed round warms up first; then up to ``SPEED_TEST_ROUNDS`` rounds, fewer
        once they took ``SPEED_TEST_BUDGET_S``. The fastest counts: a busy machine or the event loop
        only ever slows a round down, and a replica that looks slower than it is stands by for nothing.
        Nothing else of the replica changes: no gradient is accumulated, no graph cached, no counter moved."""
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise ValueError(f"samples must be a positive int, got {samples!r}")
        inputs, targets = self._made_up_batch(samples)
        self._speed_round(inputs, targets, timed=False)
        fastest: Dict[str, float] = {}
        spent = 0.0
        for _ in range(SPEED_TEST_ROUNDS):
            seconds = self._speed_round(inputs, targets, timed=True)
            fastest = {kind: min(fastest.get(kind, math.inf), value) for kind, value in seconds.items()}
            spent += sum(seconds.values())
            if spent >= SPEED_TEST_BUDGET_S:
                break
        for kind, value in fastest.items():
            self.meter.set(kind, samples, value)
        return self.meter.samples_per_s

    def _speed_round(self, inputs: torch.Tensor, targets: Optional[torch.Tensor], timed: bool) -> Dict[str, float]:
        """Seconds of one forward and one backward pass on made-up samples (the last stage: one
        forward_backward), by the meter's kinds of work. Only a ``timed`` round ends its backward work as a
        served one does (:meth:`_after_backward_compute`): the warm-up round's figures are thrown away."""
        samples, last, seconds = int(inputs.shape[0]), self.module.is_last, {}
        with self.lock:
            entropy = self._entropy  # the last stage's hook records every forward's; keep the served one
            if not last:
                start = time.perf_counter()
                with torch.no_grad(), self._autocast():
                    self.module(self._to_device(inputs), None)
                synchronize(self.device)  # served forwards are timed up to their copy back to the CPU
                seconds["forward"] = time.perf_counter() - start
            start = time.perf_counter()
            leaf, outputs, _ = self._graph(inputs, targets, count=False)
            with torch.enable_grad():
                wrt = self.params if leaf is None else [leaf, *self.params]
                torch.autograd.grad(outputs, wrt, None if last else torch.ones_like(outputs))
            synchronize(self.device)
            self._entropy = entropy
        if timed:
            self._after_backward_compute(samples)
        seconds["forward_backward" if last else "backward"] = time.perf_counter() - start
        return seconds

    def _made_up_batch(self, samples: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Inputs (and the last stage's targets) of the shapes and dtypes this stage serves."""
        config = self.run.model
        tokens = lambda: torch.randint(0, config.vocab_size, (samples, config.seq_len))  # noqa: E731
        if self.module.is_first:
            inputs = tokens()
        else:
            dtype = self.params[0].dtype if self.params else torch.float32
            inputs = torch.randn(samples, config.seq_len, config.wire_width, dtype=dtype)
        targets = tokens() if self.module.is_last else None
        self.module.check_inputs(inputs, targets)
        return inputs, targets

    def backward_batch(self, requests: Sequence[Tuple[str, Any, Any, Any]]) -> List[object]:
        """Several backward requests (``backward``'s first four arguments each); one result per request, in
        order: ``backward``'s return value, or the exception that request failed with.

        Requests that can share one vectorised pass (:mod:`swarm.server.merged_backward`) run merged; a
        request whose forward graph is cached here, a micro-batch already accumulated or repeated in the
        batch, and a malformed request run alone through :meth:`backward`."""
        results: List[object] = [None] * len(requests)
        with self.lock:
            merged = self._mergeable(requests)
            if len(merged) >= 2:
                self._backward_merged(requests, merged, results)
            else:
                merged = []
        if merged:
            self._after_backward_compute(sum(int(requests[i][1].shape[0]) for i in merged))
        for i, request in enumerate(requests):
            if i not in merged:
                try:
                    results[i] = self.backward(*request)
                except Exception as e:
                    results[i] = e
        return results

    def _mergeable(self, requests: Sequence[Tuple[str, Any, Any, Any]]) -> List[int]:
        # merging runs the stage under torch.func, which refuses activation checkpointing's saved-tensor hooks and
        # bypasses autocast's casts (attention then meets mixed dtypes): such requests run alone
        if self.dtype != "fp32" or self.module.checkpoint_activations:
            return []
        frozen_ids = self.frozen.micro_batch_ids if self.frozen is not None else ()
        chosen: List[int] = []
        seen: Set[str] = set()
        for i, (micro_batch_id, inputs, _, targets) in enumerate(requests):
            try:
                self.module.check_inputs(inputs, targets)
            except ValueError:
                continue
            if (
                micro_batch_id in seen
                or micro_batch_id in self.pending_ids
                or micro_batch_id in frozen_ids
                or micro_batch_id in self.forward_cache
                or (chosen and inputs.shape != requests[chosen[0]][1].shape)
            ):
                continue
            chosen.append(i)
            seen.add(micro_batch_id)
        return chosen

    def _backward_merged(
        self, requests: Sequence[Tuple[str, Any, Any, Any]], chosen: List[int], results: List[object]
    ) -> None:
        """One vectorised backward for ``requests[chosen]``; each is checked, weighed, clipped and accounted
        as :meth:`backward` would do it alone. Fills ``results``."""
        start = time.perf_counter()
        ids = [requests[i][0] for i in chosen]
        batch = int(requests[chosen[0]][1].shape[0])
        inputs = torch.stack([self._to_device(requests[i][1]) for i in chosen])
        targets = torch.stack([self._to_device(requests[i][3]) for i in chosen]) if self.module.is_last else None
        errors: Dict[int, Exception] = {}

        def cotangents(outputs: torch.Tensor, entropies: Optional[torch.Tensor]) -> torch.Tensor:
            if self.module.is_last:  # each request's loss weight, from its own loss and entropy
                if entropies is None:
                    raise RuntimeError(f"{self.where}: the merged backward gave the last stage no predictive entropies")
                weights = []
                for k, micro_batch_id in enumerate(ids):
                    self._entropy = float(entropies[k])
                    weights.append(self._loss_weight(micro_batch_id, outputs[k]))
                return torch.tensor(weights, device=outputs.device)
            rows = []
            for k, i in enumerate(chosen):
                try:
                    _check_grad_outputs(requests[i][2], outputs[k], self.where)
                    rows.append(self._to_device(requests[i][2]))
                except ValueError as e:  # that request fails; the others go on
                    errors[k] = e
                    rows.append(torch.zeros_like(outputs[k]))
            return torch.stack(rows)

        self.num_forwards += 1
        self.num_recomputed += len(chosen)
        self._merging = True
        try:
            merged = merged_backward(self.module, inputs, targets, cotangents)
        finally:
            self._merging = False
        for k, i in enumerate(chosen):
            results[i] = errors[k] if k in errors else self._account_merged(ids[k], batch, merged, k)
        kind = "forward_backward" if self.module.is_last else "backward"
        self.meter.update(kind, batch * len(chosen), time.perf_counter() - start)

    def _account_merged(self, micro_batch_id: str, batch: int, merged: Any, k: int) -> object:
        param_grads = [g[k] for g in merged.param_grads]
        if not all(all_finite(g) for g in param_grads):
            return ValueError(f"{self.where}: this request produces non-finite gradients; not accumulated")
        accum_step = self._accumulate(micro_batch_id, batch, param_grads)
        self.samples_processed += batch
        grad_inputs = None if merged.grad_inputs is None else merged.grad_inputs[k].cpu()
        loss = float(merged.losses[k]) if merged.losses is not None else None
        return grad_inputs, loss, accum_step

    def _accumulate(self, micro_batch_id: str, batch: int, param_grads: Sequence[torch.Tensor]) -> int:
        frozen, guard = self.frozen, self.guard
        if micro_batch_id in self.pending_ids:
            return self.accum_step
        if frozen is not None and micro_batch_id in frozen.micro_batch_ids:
            return frozen.step
        if guard is None:
            for acc, grad in zip(self.grad_sum, param_grads):
                acc.add_(
                    grad, alpha=batch
                )  # a sum of per-sample-mean gradients; divided by the global count at the step
        else:
            self._add_guarded(guard, trainer_of(micro_batch_id), batch, param_grads)
        self.samples_pending += batch
        self.pending_ids.add(micro_batch_id)
        return self.accum_step

    def freeze(self) -> FrozenStep:
        """Take the accumulator out for averaging; new gradients go to the next step."""
        with self.lock:
            if self.frozen is not None:
                return self.frozen
            self._settle_deferred()
            samples = self.samples_pending
            mean = [g / samples if samples else torch.zeros_like(g) for g in self.grad_sum]
            self.frozen = FrozenStep(self.accum_step, samples, mean, set(self.pending_ids))
            self.grad_sum = [torch.zeros_like(p) for p in self.params]
            self.samples_pending, self.pending_ids = 0, set()
            self.accum_step += 1
            if self.guard is not None:
                self._log_clips(*self.guard.start_step(self.accum_step))
            return self.frozen

    # ---- bounding each trainer's contribution (decisions in swarm.policy.poisoning) ----

    def _add_guarded(
        self, guard: ContributionGuard, trainer: str, batch: int, param_grads: Sequence[torch.Tensor]
    ) -> None:
        """Add a micro-batch's gradient clipped to the per-sample bound. A fresh replica holds its first
        micro-batches back until they come from enough trainers to fix a bound that no one of them sets."""
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in param_grads])))
        if guard.weight(trainer) == 1.0:  # a down-weighted micro-batch's norm says nothing of honest ones
            guard.record_norm(trainer, norm)
        self._deferred.append((trainer, batch, param_grads, norm))
        if guard.ready(len(self._deferred)):
            self._settle_deferred()

    def _settle_deferred(self) -> None:
        """End a warm-up: add the held-back micro-batches, each clipped to the bound they establish together."""
        if self.guard is None or not self._deferred:
            return
        self.guard.settle()
        for trainer, batch, param_grads, norm in self._deferred:
            scale = batch * self.guard.clip_factor(trainer, norm)
            for acc, grad in zip(self.grad_sum, param_grads):
                acc.add_(grad, alpha=scale)
        self._deferred = []

    def _log_clips(self, clips: Dict[str, float], new_offenders: Set[str]) -> None:
        for trainer, ratio in sorted(clips.items()):
            level = logging.WARNING if trainer in new_offenders else logging.INFO
            logger.log(
                level,
                f"{self.where}: clipped micro-batches of trainer {trainer} in step {self.accum_step - 1}: "
                f"the largest had {ratio:.3g} times the per-sample bound's gradient norm",
            )

    def _capture_entropy(self, module: torch.nn.Module, inputs: Tuple[torch.Tensor, ...], logits: torch.Tensor) -> None:
        if self._merging:
            return
        with torch.no_grad():
            self._entropy = float(predictive_entropy(logits))

    def _loss_weight(self, micro_batch_id: str, loss: torch.Tensor) -> float:
        """The weight of a last-stage micro-batch: records how far its loss exceeds the model's own
        predictive entropy, and down-weights a trainer whose excess is a persistent outlier."""
        if self.guard is None or self._entropy is None:
            return 1.0
        trainer = trainer_of(micro_batch_id)
        frozen_ids = self.frozen.micro_batch_ids if self.frozen is not None else ()
        if micro_batch_id not in self.pending_ids and micro_batch_id not in frozen_ids:
            flagged, cleared = self.guard.record_excess(trainer, float(loss.detach()) - self._entropy)
            for outlier in sorted(flagged):
                logger.warning(
                    f"{self.where}: down-weighting trainer {outlier} to {self.guard.config.outlier_weight}: "
                    f"its targets cost persistently more than the model expects"
                )
            for outlier in sorted(cleared):
                logger.info(f"{self.where}: trainer {outlier} is weighted normally again")
        weight = self.guard.weight(trainer)
        self.guard.down_weighted += weight < 1.0
        return weight

    def apply(self, mean_grads: Sequence[torch.Tensor], total_samples: int) -> None:
        """Step the optimizer with the swarm-wide mean gradient of the frozen step, at a learning rate scaled
        by the share of the global batch the step applies (:func:`~swarm.training.optimizer.batch_share`)."""
        with self.lock:
            assert self.frozen is not None, "apply() needs a frozen step"
            if total_samples > 0:  # a step that got no samples here keeps the step count aligned, nothing more
                for p, g in zip(self.masters, mean_grads):
                    p.grad = g.to(device=p.device, dtype=p.dtype).clone()
                optimizer_step(
                    self.masters,
                    self.optimizer,
                    self.run.optimizer,
                    lr_scale=batch_share(total_samples, self.run.target_batch_size),
                )
                self._copy_masters_to_device()
            digest = self._digest()  # before the step moves: no reader sees the new step beside the old digest
            self.step = self.frozen.step + 1
            self.samples_applied += total_samples
            self.frozen = None
            self._parameters_changed(digest)

    @property
    def digest(self) -> str:
        """The digest of the parameters at :attr:`version`'s step."""
        return self.version[1]

    def _digest(self) -> str:
        return parameter_digest(self.masters)

    def _copy_masters_to_device(self) -> None:
        if self.masters is not self.params:
            with torch.no_grad():
                for p, master in zip(self.params, self.masters):
                    p.copy_(master)

    def _parameters_changed(self, digest: str) -> None:
        """After a step or a loaded state (``digest``: of the new parameters, hashed before the step number
        moved): no graph built on the old parameters survives, and :attr:`version` names the new pair."""
        self.params_version += 1
        self.forward_cache.invalidate()
        self.version = (self.step, digest)

    def drop_cached_forwards(self) -> None:
        """Free every cached graph (the replica leaves its stage)."""
        with self.lock:
            self.forward_cache.clear()

    # ---- state: shared with joining replicas and written to checkpoints ----

    def state_tensors(self) -> List[torch.Tensor]:
        with self.lock:
            tensors = [p.detach().cpu().clone() for p in self.masters]
            for p in self.masters:
                state = self.optimizer.state[p]
                tensors += [state["exp_avg"].cpu().clone(), state["exp_avg_sq"].cpu().clone()]
            tensors.append(torch.tensor([float(self.optimizer.state[self.masters[0]]["step"])]))
            return tensors

    def export(self, with_gradients: bool = False) -> Dict[str, object]:
        with self.lock:
            names = [name for name, p in self.module.named_parameters() if p.requires_grad]
            reply: Dict[str, object] = {
                "step": self.step,
                "names": names,
                "parameters": [p.detach().cpu().clone() for p in self.masters],
            }
            if with_gradients:
                self._settle_deferred()
                n = max(self.samples_pending, 1)
                reply["gradients"] = [(g / n).cpu() for g in self.grad_sum]
                reply["samples_pending"] = self.samples_pending
            return reply

    def state_metadata(self) -> Dict[str, int]:
        return {"stage": self.stage_index, "step": self.step, "samples_applied": self.samples_applied}

    def state(self) -> Tuple[Dict[str, int], List[torch.Tensor]]:
        """(metadata, tensors) taken under one hold of the lock: a step applied between reading the step and
        copying the tensors would pair step *s* with the parameters of *s + 1*, which a downloader that checks
        the announced digest takes for a lie."""
        with self.lock:
            return self.state_metadata(), self.state_tensors()

    def load_state(
        self, metadata: Dict[str, int], tensors: Sequence[torch.Tensor], dropped_from: Optional[int] = None
    ) -> None:
        """Adopt another replica's (or a checkpoint's) parameters, optimizer state and step; drop local gradients.

        Counts the adoption in ``resets`` and sets ``reset_from`` to the lowest step whose gradients it drops:
        those accumulated or frozen here, the steps from the adopted one on (applied on another lineage),
        and ``dropped_from`` (the caller's applied steps that the adopted state does not hold)."""
        num = len(self.params)
        if metadata.get("stage") != self.stage_index or len(tensors) != 3 * num + 1:
            raise ValueError(
                f"{self.where}: state of stage {metadata.get('stage')} with {len(tensors)} tensors does not fit"
            )
        for i, p in enumerate(self.params):  # check everything before changing anything
            for what, t in (
                ("parameter", tensors[i]),
                ("exp_avg", tensors[num + 2 * i]),
                ("exp_avg_sq", tensors[num + 2 * i + 1]),
            ):
                if t.shape != p.shape:
                    raise ValueError(f"{self.where}: {what} {i} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
        if tensors[-1].numel() != 1:
            raise ValueError(f"{self.where}: the optimizer step count must be one number")
        with self.lock:
            for i, p in enumerate(self.masters):
                state = self.optimizer.state[p]
                p.data.copy_(tensors[i])
                state["exp_avg"].copy_(tensors[num + 2 * i])
                state["exp_avg_sq"].copy_(tensors[num + 2 * i + 1])
                state["step"].fill_(float(tensors[-1][0]))
            self._copy_masters_to_device()
            digest = self._digest()
            new_step = int(metadata["step"])
            lowest = [self.accum_step, new_step] + ([self.frozen.step] if self.frozen is not None else [])
            self.resets, self.reset_from = (
                self.resets + 1,
                min(lowest + ([dropped_from] if dropped_from is not None else [])),
            )
            # what we accumulated was computed on parameters we give up: drop it (trainers re-send it); zeroed in
            # place, so that adopting a state never allocates another copy of the parameters' size
            for accumulated in self.grad_sum:
                accumulated.zero_()
            self.samples_pending, self.pending_ids = 0, set()
            self._deferred = []
            self.step = self.accum_step = new_step
            self.samples_applied = int(metadata["samples_applied"])
            self.frozen = None
            self._parameters_changed(digest)
