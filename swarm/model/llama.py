"""A Llama-class decoder LM cut into contiguous pipeline stages.

Read top to bottom: RMSNorm, rotary position embeddings, the SwiGLU MLP, grouped-query attention,
the decoder layer, one stage, and the deterministic stage builder. Like the GPT of
:mod:`swarm.model.gpt` there is no dropout, and a stage is a plain ``nn.Module`` with the interface
of :class:`~swarm.model.gpt.PipelineStage`.

Parameter names are those of Hugging Face's ``LlamaForCausalLM``: ``model.embed_tokens``,
``model.layers.{i}.self_attn.{q,k,v,o}_proj``, ``model.layers.{i}.mlp.{gate,up,down}_proj``,
``model.layers.{i}.{input,post_attention}_layernorm``, ``model.norm``, ``lm_head``, where ``i`` is
the layer's global index (a stage keeps its layers in a ``ModuleDict`` keyed by it). A stage's
``state_dict`` is therefore exactly its slice of an HF checkpoint, and the projections use HF's
layout (rotary embeddings rotate the two halves of each head, not interleaved pairs).

Tied embeddings put one matrix in the first and the last stage; with several stages those are
different peers, which would each step their own copy, so :class:`LlamaStage` refuses
``tie_embeddings`` unless the whole model is one stage.
"""

from __future__ import annotations

import math
from typing import Dict, Tuple, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from swarm.model.gpt import ModelConfig, PipelineStage, check_seed, seeded_generator

__all__ = [
    "RMSNorm",
    "rotary_tables",
    "apply_rotary",
    "SwiGLU",
    "GroupedQueryAttention",
    "DecoderLayer",
    "LlamaStage",
    "hf_parameters",
    "build_stage",
]

_INIT_STD = 0.02  # the initialisation scale of Llama's embeddings and linear weights (HF initializer_range)


class RMSNorm(nn.Module):
    """Scale by the root mean square (no mean subtraction, no bias), computed in float32 as Llama does."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotary_tables(
    length: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype
) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [length, head_dim] of the rotation angles ``position / theta ** (2j / head_dim)``.

    Computed per call (a few thousand values) rather than cached in a buffer, so that a stage built on
    the meta device and materialised with ``to_empty`` needs no extra initialisation."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles = torch.arange(length, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head of ``x`` [B, heads, T, head_dim]: dimension ``j`` pairs with ``j + head_dim / 2``."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class SwiGLU(nn.Module):
    """Llama's MLP: ``down(silu(gate(x)) * up(x))``, ``config.ffn_size`` wide, no biases."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.ffn_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.ffn_size, bias=False)
        self.down_proj = nn.Linear(config.ffn_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GroupedQueryAttention(nn.Module):
    """Causal self-attention with rotary positions, where each key/value head serves
    ``num_heads / kv_heads`` consecutive query heads (multi-head attention when they are equal)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.kv_heads, self.head_dim = config.num_heads, config.kv_heads, config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        # [B, T, heads * head_dim] -> [B, heads, T, head_dim]
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        groups = self.num_heads // self.kv_heads
        if groups > 1:  # repeated by expand + reshape (no copy until SDPA needs one); works under vmap
            k, v = (
                t[:, :, None]
                .expand(batch, self.kv_heads, groups, length, self.head_dim)
                .reshape(batch, self.num_heads, length, self.head_dim)
                for t in (k, v)
            )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    """Pre-norm Llama layer: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.self_attn = GroupedQueryAttention(config)
        self.mlp = SwiGLU(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Trunk(nn.Module):
    """The part of the stage that HF calls ``model``: the embedding (first stage), the layers keyed by
    their global index, and the final norm (last stage). A container; the stage runs it."""

    def __init__(self, config: ModelConfig, layer_range: Tuple[int, int], is_first: bool, is_last: bool):
        super().__init__()
        if is_first:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleDict({str(layer): DecoderLayer(config) for layer in range(*layer_range)})
        if is_last:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaStage(PipelineStage):
    """One contiguous slice of the Llama. The first stage holds the token embedding, the last the final norm,
    the LM head and the loss.

    A freshly constructed module is initialised as ``build_stage(config, stage_index, num_stages, seed=0)``
    would; ``empty=True`` leaves it a meta-device skeleton (names and shapes only).
    """

    def __init__(self, config: ModelConfig, stage_index: int, num_stages: int, empty: bool = False):
        super().__init__(config, stage_index, num_stages)
        if config.architecture != "llama":
            raise ValueError(
                f"LlamaStage builds architecture llama, got {config.architecture!r} "
                "(swarm.model.stages.build_stage picks the architecture's stage)"
            )
        if config.tie_embeddings and num_stages > 1:
            raise ValueError(
                f"tie_embeddings needs the token embedding and the LM head on one peer, but the model "
                f"is cut into {num_stages} stages (the first and last would each step their own copy): "
                "use num_stages 1 or tie_embeddings false"
            )
        with torch.device("meta"):
            self.model = _Trunk(config, self.layer_range, self.is_first, self.is_last)
            if self.is_last:
                self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._tie_weights()
        self._materialise(empty)

    def _tie_weights(self) -> None:
        if self.config.tie_embeddings:  # one stage, so it holds both ends
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def _reset_layers(self, seed: int) -> None:
        """Normal(0, 0.02) weights and unit norms, drawn from generators local to (seed, component) as the GPT's
        are: each layer keyed by its global index, so the same seed gives the same network however it is cut.
        The residual projections (o_proj, down_proj) are scaled by 1/sqrt(2 * layers), as in GPT-2, so the
        residual stream's variance does not grow with depth."""
        residual_std = _INIT_STD / math.sqrt(2 * self.config.num_layers)
        if self.is_first:
            self.model.embed_tokens.weight.normal_(0.0, _INIT_STD, generator=seeded_generator(seed, "embeddings"))
        for name, module in self.model.layers.items():
            layer = cast(DecoderLayer, module)
            gen = seeded_generator(seed, f"block.{name}")
            attn, mlp = layer.self_attn, layer.mlp
            for linear, std in (
                (attn.q_proj, _INIT_STD),
                (attn.k_proj, _INIT_STD),
                (attn.v_proj, _INIT_STD),
                (attn.o_proj, residual_std),
                (mlp.gate_proj, _INIT_STD),
                (mlp.up_proj, _INIT_STD),
                (mlp.down_proj, residual_std),
            ):
                linear.weight.normal_(0.0, std, generator=gen)
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        if self.is_last:
            self.model.norm.weight.fill_(1.0)
            if not self.config.tie_embeddings:
                self.lm_head.weight.normal_(0.0, _INIT_STD, generator=seeded_generator(seed, "lm_head"))

    def _hidden(self, inputs: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(inputs) if self.is_first else inputs
        cos, sin = rotary_tables(x.shape[1], self.config.head_dim, self.config.rope_theta, x.device, x.dtype)
        for layer in self.model.layers.values():
            x = self._run_block(layer, x, cos, sin)
        return x

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden))

    def checkpoint_names(self) -> Dict[str, str]:
        """The stage's names are HF's already (the boundaries of a run with ``boundary_dim``, which HF's Llama has
        no place for, take the names of :meth:`_boundary_names`); a tied LM head is stored as the embedding, as HF
        stores it."""
        names = {key: key for key in self.state_dict(keep_vars=True)} | self._boundary_names()
        if self.config.tie_embeddings and "lm_head.weight" in names:
            names["lm_head.weight"] = "model.embed_tokens.weight"
        return names


def hf_parameters(stage: LlamaStage) -> Dict[str, nn.Parameter]:
    """The stage's parameters under their ``LlamaForCausalLM`` names (global layer indices). With tied embeddings
    both ``model.embed_tokens.weight`` and ``lm_head.weight`` are listed, as the same parameter."""
    if not isinstance(stage, LlamaStage):
        raise ValueError(f"hf_parameters needs a LlamaStage, got {type(stage).__name__}")
    return {name: param for name, param in stage.state_dict(keep_vars=True).items()}


def build_stage(config: ModelConfig, stage_index: int, num_stages: int, seed: int) -> LlamaStage:
    """The Llama stage, deterministic from (seed, stage_index) without touching the global RNG: replicas of a stage
    start identical. :func:`swarm.model.stages.build_stage` picks the architecture; this builds the Llama."""
    check_seed(seed)
    stage = LlamaStage(config, stage_index, num_stages)
    if seed != 0:  # the constructor already initialised with seed 0
        stage.reset_parameters(seed)
    return stage
