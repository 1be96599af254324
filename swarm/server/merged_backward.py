"""Several backward requests of one shape in one vectorised call, each keeping its own parameter gradient.

A replica clips and accounts every micro-batch's parameter gradient on its own
(:mod:`swarm.policy.poisoning`), so merging backward requests must not sum their gradients. Here every
request gets its own copy of the parameters (an ``expand``: no memory) and ``torch.func.vmap`` runs the
stage on all requests at once; ``torch.func.vjp`` then gives, for request ``i``, the gradient with
respect to copy ``i`` -- exactly request ``i``'s own parameter gradient -- and its grad_inputs. The
cotangents are chosen after the forward (``cotangents``): on the last stage they are the loss weights,
which depend on each request's loss and on the model's predictive entropy for its samples; elsewhere
the requests' grad_outputs, checked against the outputs' shape.

Runs on the peer's compute thread under the runner's lock; knows nothing of accounting.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, List, Optional

import torch
from torch.func import functional_call, vjp, vmap

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _CHOOSES_KERNEL = True
except ImportError:  # torch before 2.3 has no choice of attention kernel to make
    _CHOOSES_KERNEL = False

from swarm.model.stages import PipelineStage

__all__ = ["MergedBackward", "merged_backward", "predictive_entropy"]

# (stage outputs [N, ...] or losses [N], predictive entropies [N] on the last stage else None) -> cotangents
Cotangents = Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


@dataclass
class MergedBackward:
    """Per-request results, indexed by request along the first dimension."""

    param_grads: List[torch.Tensor]  # one [N, *parameter shape] tensor per trainable parameter, in module order
    grad_inputs: Optional[torch.Tensor]  # [N, *input shape]; None on the first stage (token inputs)
    losses: Optional[torch.Tensor]  # [N] mean loss of each request on the last stage, else None


def predictive_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Mean entropy (nats) of the model's next-token distributions over all positions of ``logits``."""
    log_p = torch.log_softmax(logits.detach().float(), dim=-1)
    return -(log_p.exp() * log_p).sum(-1).mean()


def _attention_for_vmap(device: torch.device) -> ContextManager:
    """Attention kernels that work under ``vmap`` on ``device``. On CUDA, the memory-efficient kernel's backward
    fails on the vmapped batch ('LSE is not correctly aligned'); the math kernel handles it as one more
    batch dimension. The CPU keeps torch's choice."""
    if device.type == "cpu" or not _CHOOSES_KERNEL:
        return contextlib.nullcontext()
    return sdpa_kernel(SDPBackend.MATH)


def merged_backward(
    module: PipelineStage, inputs: torch.Tensor, targets: Optional[torch.Tensor], cotangents: Cotangents
) -> MergedBackward:
    """Backward of ``N`` requests stacked along a new first dimension of ``inputs`` (and ``targets``)."""
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    names = [name for name, _ in named]
    copies = tuple(p.detach().unsqueeze(0).expand(inputs.shape[0], *p.shape) for _, p in named)
    captured: List[torch.Tensor] = []

    def one_request(params: tuple, x: torch.Tensor, t: Optional[torch.Tensor]):
        output = functional_call(module, dict(zip(names, params)), (x, t))
        if not module.is_last:
            return output
        return output, predictive_entropy(captured.pop())

    vectorised = vmap(one_request, in_dims=(0, 0, None if targets is None else 0))
    hook = (
        module.lm_head.register_forward_hook(lambda m, i, logits: captured.append(logits)) if module.is_last else None
    )
    try:
        with torch.enable_grad(), _attention_for_vmap(inputs.device):
            if module.is_first:
                result = vjp(lambda params: vectorised(params, inputs, targets), copies, has_aux=module.is_last)
            else:
                result = vjp(lambda params, x: vectorised(params, x, targets), copies, inputs, has_aux=module.is_last)
    finally:
        if hook is not None:
            hook.remove()
    outputs, pullback, *aux = result  # aux: the entropies on the last stage (has_aux)
    entropies = aux[0] if module.is_last else None
    with _attention_for_vmap(inputs.device):
        grads = pullback(cotangents(outputs.detach(), entropies).to(outputs.dtype))
    return MergedBackward(
        list(grads[0]), None if module.is_first else grads[1], outputs.detach() if module.is_last else None
    )
