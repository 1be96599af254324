"""Whole-model checkpoints in Hugging Face's layout: export a run's stages, start stages from one, and hash a
stage's tensors so that a manifest can sign them.

A checkpoint is a directory holding ``config.json`` and either ``model.safetensors`` or, when the tensors
exceed ``max_shard_bytes``, shards ``model-00001-of-0000N.safetensors`` listed by
``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``).

- architecture llama: ``config.json`` is a ``LlamaConfig`` and the tensors carry ``LlamaForCausalLM``'s
  names, so ``transformers.AutoModelForCausalLM.from_pretrained(dir)`` loads it and an HF Llama
  checkpoint can seed a run. A tied LM head is stored once, as ``model.embed_tokens.weight`` (as HF does).
- architecture gpt: the same files, in our own format: ``config.json`` is
  ``{"architectures": ["SwarmGPT"], "model_type": "swarm_gpt", "swarm_model_config": {ModelConfig fields},
  "torch_dtype": ...}`` and the tensors carry the GPT stage names with global block indices
  (``token_embedding.weight``, ``position_embedding.weight``, ``blocks.{i}.attn.qkv.weight``, ...,
  ``ln_f.weight``, ``lm_head.weight``). Only this module reads it back.

A stage reads only its own tensors: ``safetensors.safe_open`` maps a file and reads a tensor when asked,
and files holding none of the stage's tensors are never opened. Everything read is checked (names,
shapes, floating dtype, finite values) before it reaches a module, with the offending name in the error.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from swarm.model.finite import all_finite
from swarm.model.gpt import ModelConfig, PipelineStage, layer_ranges
from swarm.model.stages import stage_skeleton

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "CONFIG_FILE",
    "SINGLE_FILE",
    "INDEX_FILE",
    "CheckpointError",
    "checkpoint_config",
    "export_checkpoint",
    "config_from_hf",
    "read_stage_tensors",
    "load_stage_from_checkpoint",
    "tensor_digest",
    "stage_digest",
]

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30  # bytes of tensors per safetensors file before the export shards
CONFIG_FILE, SINGLE_FILE, INDEX_FILE = "config.json", "model.safetensors", "model.safetensors.index.json"
_MAX_CONFIG_BYTES = 1 << 20  # a config.json or index larger than this is not a model's
_GPT_MODEL_TYPE = "swarm_gpt"
_DIGEST_DOMAIN = b"swarm stage tensors v1\n"
PathLike = Union[str, Path]


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or used as asked; the message names the file, tensor or setting."""


# ---- config.json ----


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def checkpoint_config(config: ModelConfig, dtype: torch.dtype = torch.float32) -> Dict[str, Any]:
    """The ``config.json`` of ``config``'s checkpoint: a ``LlamaConfig`` for llama, our own dict for gpt.

    The dtype is written both as ``torch_dtype`` (what transformers 4 reads) and ``dtype`` (transformers 5); the
    rotary base both as ``rope_theta`` and inside ``rope_parameters``, for the same reason."""
    if config.architecture == "gpt":
        return {
            "architectures": ["SwarmGPT"],
            "model_type": _GPT_MODEL_TYPE,
            "swarm_model_config": dataclasses.asdict(config),
            "torch_dtype": _dtype_name(dtype),
        }
    if config.boundary_dim:
        raise CheckpointError(
            f"a llama run with boundary_dim {config.boundary_dim} passes its residual stream through learned "
            "projections between stages, which LlamaForCausalLM has no place for: such a run cannot start from "
            "or be exported as a Hugging Face checkpoint (runs that do keep boundary_dim 0)"
        )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.seq_len,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "torch_dtype": _dtype_name(dtype),
        "dtype": _dtype_name(dtype),
    }


def _read_json(path: Path) -> Dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    if path.stat().st_size > _MAX_CONFIG_BYTES:
        raise CheckpointError(f"{path} is larger than {_MAX_CONFIG_BYTES} bytes")
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _rope_theta(hf: Mapping[str, Any], where: str) -> float:
    """The rotary base of an HF config, refusing every RoPE variant but the original (transformers 4 writes
    ``rope_theta`` and ``rope_scaling``, transformers 5 ``rope_parameters``)."""
    if hf.get("rope_scaling") is not None:
        raise CheckpointError(f"{where}: rope_scaling {hf['rope_scaling']!r} is not supported (only plain RoPE)")
    params = hf.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise CheckpointError(f"{where}: rope_parameters must be an object, got {params!r}")
    if params.get("rope_type", "default") != "default":
        raise CheckpointError(
            f"{where}: rope_parameters.rope_type {params['rope_type']!r} is not supported (only default RoPE)"
        )
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if factor not in (None, 1, 1.0):
        raise CheckpointError(f"{where}: partial_rotary_factor {factor!r} is not supported (RoPE on every dimension)")
    return params.get("rope_theta", hf.get("rope_theta", 10000.0))


def _check_llama_features(hf: Mapping[str, Any], where: str) -> None:
    """Refuse settings our Llama does not compute, rather than load weights into a different network."""
    if hf.get("model_type") != "llama":
        raise CheckpointError(
            f"{where}: model_type {hf.get('model_type')!r} is not supported: only llama "
            f"(and {_GPT_MODEL_TYPE}, this package's own GPT export)"
        )
    architectures = hf.get("architectures") or ["LlamaForCausalLM"]
    if "LlamaForCausalLM" not in architectures:
        raise CheckpointError(
            f"{where}: architectures {architectures!r} has no LlamaForCausalLM (a language-model head)"
        )
    refused = {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu"}
    for key, supported in refused.items():
        if hf.get(key, supported) != supported:
            raise CheckpointError(f"{where}: {key} {hf[key]!r} is not supported (only {supported!r})")
    if hf.get("attention_dropout") not in (None, 0, 0.0):
        raise CheckpointError(
            f"{where}: attention_dropout {hf['attention_dropout']!r} is not supported: stages have "
            "no dropout (the pipeline must compute what one process computes)"
        )
    heads, hidden = hf.get("num_attention_heads"), hf.get("hidden_size")
    head_dim = hf.get("head_dim")
    if (
        head_dim is not None
        and isinstance(heads, int)
        and isinstance(hidden, int)
        and heads > 0
        and head_dim * heads != hidden
    ):
        raise CheckpointError(
            f"{where}: head_dim {head_dim} times num_attention_heads {heads} must equal hidden_size {hidden}"
        )


def config_from_hf(path: PathLike, seq_len: Optional[int] = None) -> ModelConfig:
    """The :class:`ModelConfig` of the checkpoint in directory ``path`` (an HF ``LlamaForCausalLM`` config, or our
    GPT export). ``seq_len`` defaults to the checkpoint's ``max_position_embeddings``; a run may train shorter
    samples. Unsupported settings (rope_scaling, attention or MLP biases, another activation, dropout) are refused."""
    where = str(Path(path) / CONFIG_FILE)
    hf = _read_json(Path(path) / CONFIG_FILE)
    if hf.get("model_type") == _GPT_MODEL_TYPE:
        fields = dict(hf.get("swarm_model_config") or {})
        if seq_len is not None:
            fields["seq_len"] = seq_len
        return _model_config(fields, where)
    _check_llama_features(hf, where)
    missing = [
        key
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        if key not in hf
    ]
    if missing:
        raise CheckpointError(f"{where}: missing {', '.join(missing)}")
    return _model_config(
        {
            "architecture": "llama",
            "vocab_size": hf["vocab_size"],
            "hidden_size": hf["hidden_size"],
            "intermediate_size": hf["intermediate_size"],
            "num_layers": hf["num_hidden_layers"],
            "num_heads": hf["num_attention_heads"],
            "num_kv_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
            "seq_len": seq_len if seq_len is not None else hf.get("max_position_embeddings", 2048),
            "rope_theta": _rope_theta(hf, where),
            "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
            "tie_embeddings": hf.get("tie_word_embeddings", False),
        },
        where,
    )


def _model_config(fields: Mapping[str, Any], where: str) -> ModelConfig:
    known = {field.name for field in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise CheckpointError(f"{where}: unknown model setting {unknown[0]!r}")
    try:
        return ModelConfig(**fields)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: {e}") from None


# compared by their resolved values (0 means a default) or not at all (how a run cuts the model into stages)
_LAYOUT_FIELDS = {"stage_layers", "num_kv_heads", "intermediate_size"}


def _check_config_matches(path: Path, config: ModelConfig) -> None:
    """CheckpointError naming the first setting in which the checkpoint's config.json differs from ``config``.

    Shapes alone would miss a different rope_theta or rms_norm_eps, which load fine and compute another model."""
    theirs = config_from_hf(path, seq_len=config.seq_len if config.architecture == "llama" else None)
    pairs = [
        (name, getattr(theirs, name), getattr(config, name))
        for name in (f.name for f in dataclasses.fields(ModelConfig))
        if name not in _LAYOUT_FIELDS
    ]
    pairs += [
        ("num_kv_heads", theirs.kv_heads, config.kv_heads),
        ("intermediate_size", theirs.ffn_size, config.ffn_size),
    ]
    for name, expected, actual in pairs:
        if expected != actual:
            raise CheckpointError(
                f"{path / CONFIG_FILE}: the checkpoint has {name} {expected!r}, the run's model {actual!r}"
            )


# ---- export ----


def _gather_stage(
    config: ModelConfig, stage_index: int, num_stages: int, state: Mapping[str, torch.Tensor]
) -> Dict[str, torch.Tensor]:
    """Stage ``stage_index``'s tensors under their checkpoint names, checked against the stage's names and shapes."""
    skeleton = stage_skeleton(config, stage_index, num_stages)
    names, shapes = skeleton.checkpoint_names(), {k: v.shape for k, v in skeleton.state_dict(keep_vars=True).items()}
    where = f"stage {stage_index}/{num_stages}"
    unknown = sorted(set(state) - set(names))
    if unknown:
        raise CheckpointError(f"{where}: unexpected tensor {unknown[0]!r}; the stage holds {sorted(names)[:4]}...")
    gathered: Dict[str, torch.Tensor] = {}
    for local, name in names.items():
        if local not in state:
            if any(other in state for other, same in names.items() if same == name):
                continue  # a tied weight, given under its other name
            raise CheckpointError(f"{where}: tensor {local!r} is missing")
        tensor = _checked_tensor(state[local], shapes[local], f"{where}: tensor {local!r}")
        if name in gathered and not torch.equal(gathered[name], tensor):
            raise CheckpointError(f"{where}: tied tensors stored as {name!r} differ")
        gathered[name] = tensor
    return gathered


def _checked_tensor(tensor: Any, shape: torch.Size, where: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointError(f"{where} must be a torch.Tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != tuple(shape):
        raise CheckpointError(f"{where} has shape {tuple(tensor.shape)}, the model needs {tuple(shape)}")
    if not tensor.is_floating_point():
        raise CheckpointError(f"{where} must hold floating-point values, got dtype {tensor.dtype}")
    if not all_finite(tensor):
        raise CheckpointError(f"{where} holds NaN or infinite values")
    return tensor.detach()


def _plan_shards(sizes: Sequence[Tuple[str, int]], max_shard_bytes: int) -> List[List[str]]:
    """Consecutive names packed greedily into shards of at most ``max_shard_bytes`` (a larger tensor alone in one)."""
    shards: List[List[str]] = [[]]
    filled = 0
    for name, size in sizes:
        if shards[-1] and filled + size > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += size
    return shards


def _refuse_existing(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"{out_dir} exists and is not a directory")
    existing = (
        [
            p.name
            for p in out_dir.iterdir()
            if p.name in (CONFIG_FILE, SINGLE_FILE, INDEX_FILE)
            or (p.name.startswith("model-") and p.name.endswith(".safetensors"))
        ]
        if out_dir.exists()
        else []
    )
    if existing:
        raise CheckpointError(
            f"{out_dir} already holds a checkpoint ({sorted(existing)[0]}): export into a new "
            "directory, so that no stale shard is mistaken for part of this one"
        )


def export_checkpoint(
    config: ModelConfig,
    stage_state_dicts: Sequence[Mapping[str, torch.Tensor]],
    out_dir: PathLike,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: Optional[torch.dtype] = None,
) -> List[Path]:
    """Write the model whose stage ``k`` holds ``stage_state_dicts[k]`` (keys as in the stage's ``state_dict()``, or
    its ``named_parameters()``) to ``out_dir``; returns the files written. ``dtype`` casts every tensor (e.g.
    torch.bfloat16 for release); None keeps each tensor's own, which must then be the same for all."""
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise CheckpointError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
    if not stage_state_dicts:
        raise CheckpointError("stage_state_dicts must hold one state dict per stage, got none")
    num_stages = len(stage_state_dicts)
    tensors: Dict[str, torch.Tensor] = {}
    for index, state in enumerate(stage_state_dicts):
        tensors.update(_gather_stage(config, index, num_stages, state))
    dtypes = {t.dtype for t in tensors.values()} if dtype is None else {dtype}
    if len(dtypes) != 1:
        raise CheckpointError(f"the stages' tensors mix dtypes {sorted(map(_dtype_name, dtypes))}: pass dtype")
    dtype = dtypes.pop()
    out = Path(out_dir)
    _refuse_existing(out)
    out.mkdir(parents=True, exist_ok=True)
    element = torch.empty((), dtype=dtype).element_size()
    shards = _plan_shards([(name, t.numel() * element) for name, t in tensors.items()], max_shard_bytes)
    files = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for file, names in zip(files, shards):  # one shard's copies in memory at a time
        save_file(
            {n: tensors[n].to("cpu", dtype).contiguous().clone() for n in names},
            str(out / file),
            metadata={"format": "pt"},
        )
    written = [out / file for file in files]
    if len(shards) > 1:
        index_json = {
            "metadata": {"total_size": sum(t.numel() * element for t in tensors.values())},
            "weight_map": {n: file for file, names in zip(files, shards) for n in names},
        }
        (out / INDEX_FILE).write_text(json.dumps(index_json, indent=2, sort_keys=True))
        written.append(out / INDEX_FILE)
    (out / CONFIG_FILE).write_text(json.dumps(checkpoint_config(config, dtype), indent=2, sort_keys=True))
    return written + [out / CONFIG_FILE]


# ---- import ----


def _weight_map(path: Path) -> Dict[str, str]:
    """Tensor name -> file within ``path``, from the index, or from the single file's header."""
    if (path / INDEX_FILE).is_file():
        index = _read_json(path / INDEX_FILE)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{path / INDEX_FILE}: weight_map must map tensor names to file names")
        for file in set(weight_map.values()):
            if Path(file).name != file or not file.endswith(".safetensors"):
                raise CheckpointError(
                    f"{path / INDEX_FILE}: {file!r} is not a .safetensors file in the checkpoint directory"
                )
        return dict(weight_map)
    if (path / SINGLE_FILE).is_file():
        with safe_open(str(path / SINGLE_FILE), framework="pt") as f:  # reads the header only
            return {name: SINGLE_FILE for name in f.keys()}
    raise CheckpointError(f"{path} holds neither {SINGLE_FILE} nor {INDEX_FILE}")


def read_stage_tensors(
    path: PathLike, config: ModelConfig, stage_index: int, num_stages: int
) -> Dict[str, torch.Tensor]:
    """Stage ``stage_index``'s tensors from the checkpoint in ``path``, keyed as the stage's ``state_dict()`` and in
    its dtype (float32), ready for ``load_state_dict``. Reads no other tensor; checks the config, every name,
    shape and value first."""
    path = Path(path)
    _check_config_matches(path, config)
    skeleton = stage_skeleton(config, stage_index, num_stages)
    names, params = skeleton.checkpoint_names(), skeleton.state_dict(keep_vars=True)
    weight_map = _weight_map(path)
    where = f"{path}: stage {stage_index}/{num_stages}"
    _check_boundaries_match(weight_map, config, num_stages, where)
    missing = sorted({name for name in names.values() if name not in weight_map})
    if missing:
        raise CheckpointError(f"{where}: tensor {missing[0]!r} is missing from the checkpoint")
    by_file: Dict[str, List[str]] = {}
    for name in dict.fromkeys(names.values()):
        by_file.setdefault(weight_map[name], []).append(name)
    loaded: Dict[str, torch.Tensor] = {}
    shapes = {name: params[local].shape for local, name in names.items()}
    for file, file_names in by_file.items():
        if not (path / file).is_file():
            raise CheckpointError(f"{where}: {file} (named by {INDEX_FILE}) does not exist")
        with safe_open(str(path / file), framework="pt") as f:
            for name in file_names:
                loaded[name] = _read_tensor(f, name, shapes[name], f"{where}: tensor {name!r} in {file}")
    return {local: loaded[name].to(params[local].dtype) for local, name in names.items()}


def _check_boundaries_match(weight_map: Mapping[str, str], config: ModelConfig, num_stages: int, where: str) -> None:
    """CheckpointError unless the checkpoint's stage boundaries (``boundaries.{layer}.*``, written by a run with
    ``boundary_dim``) sit where this run cuts the model: a narrowed residual stream is part of the model, so the
    same tensors cut elsewhere would compute another one."""
    present = sorted({int(name.split(".")[1]) for name in weight_map if name.startswith("boundaries.")})
    starts = [start for start, _ in layer_ranges(config.num_layers, num_stages, config.stage_layers)[1:]]
    expected = starts if config.boundary_dim else []
    if present != expected:
        raise CheckpointError(
            f"{where}: the checkpoint narrows the residual stream before layers {present}, this run's cut "
            f"({num_stages} stages, boundary_dim {config.boundary_dim}) before layers {expected}: load it with the "
            "cut it was trained with"
        )


def _read_tensor(handle: Any, name: str, shape: torch.Size, where: str) -> torch.Tensor:
    """One tensor, its shape checked from the file's header before its bytes are read."""
    try:
        found = tuple(handle.get_slice(name).get_shape())
    except Exception as e:  # safetensors raises its own error type for a name the file lacks
        raise CheckpointError(f"{where}: not in the file ({type(e).__name__}: {e})") from None
    if found != tuple(shape):
        raise CheckpointError(f"{where} has shape {found}, the model needs {tuple(shape)}")
    return _checked_tensor(handle.get_tensor(name), shape, where)


def load_stage_from_checkpoint(path: PathLike, config: ModelConfig, stage_index: int, num_stages: int) -> PipelineStage:
    """Stage ``stage_index`` of ``num_stages`` with its weights from the checkpoint in ``path`` (see
    :func:`read_stage_tensors`), on the CPU; nothing is randomly initialised."""
    tensors = read_stage_tensors(path, config, stage_index, num_stages)
    stage = stage_skeleton(config, stage_index, num_stages)
    stage.allocate("cpu")
    stage.load_state_dict(tensors, strict=True)
    return stage


# ---- hashing ----


def tensor_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 (hex) over named tensors, in sorted name order: for each, a length-prefixed JSON header with its
    name, dtype and shape, then its bytes (little-endian, as every platform torch runs on stores them).
    Independent of device and memory layout; any changed name, dtype, shape or bit changes it."""
    digest = hashlib.sha256(_DIGEST_DOMAIN)
    for name in sorted(tensors):
        tensor = tensors[name]
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"tensor {name!r} must be a torch.Tensor, got {type(tensor).__name__}")
        tensor = tensor.detach().to("cpu").contiguous()
        header = json.dumps(
            {"name": name, "dtype": _dtype_name(tensor.dtype), "shape": list(tensor.shape)},
            sort_keys=True,
            separators=(",", ":"),
        ).encode()
        data = tensor.reshape(-1).view(torch.uint8).numpy().data
        for part, size in ((header, len(header)), (data, int(data.nbytes))):
            digest.update(size.to_bytes(8, "little"))
            digest.update(part)
    return digest.hexdigest()


def stage_digest(stage: PipelineStage) -> str:
    """:func:`tensor_digest` of the stage's tensors under their checkpoint names (global layer indices, a tied
    weight once): replicas of a stage built from the same seed or checkpoint agree on it, whoever computes it."""
    state = stage.state_dict(keep_vars=True)
    return tensor_digest({name: state[local] for local, name in stage.checkpoint_names().items()})
