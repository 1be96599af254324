"""Export a live run's model: download every stage's parameters from its replicas and write one checkpoint.

A replica's record announces its step and the digest of its parameters, but a record is a claim, as it is
for a joining replica (:mod:`swarm.policy.joining`): the exporter keeps only the (step, digest) that a strict
majority of a stage's online replicas announce, downloads the parameters from a replica that announced it,
and keeps them only if they hash to that digest (:func:`~swarm.server.runner.parameter_digest`). A replica
that serves other parameters than it announces is distrusted and the next one is asked. Stages step one
after the other, so the exporter reads the swarm again (a bounded number of rounds) until every stage is at
the same global step; a model whose stages come from different steps is written only when asked for.

Decisions (which replicas to trust, whether a reply is the announced state, whether the steps agree) are
pure functions over plain data; :func:`collect_stage_states` and :func:`write_export` do the I/O.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_logger

from swarm.config.settings import NetworkConfig, RunConfig
from swarm.dht.agreement import RunFilter
from swarm.dht.directory import Directory
from swarm.dht.records import PeerRecord
from swarm.model.finite import all_finite
from swarm.model.gpt import ModelConfig
from swarm.model.hf_checkpoint import export_checkpoint
from swarm.model.stages import stage_skeleton
from swarm.net.rpc import call_peer
from swarm.policy.joining import StateClaim, StateSources, StateVerdict, check_downloaded_state, trusted_state_sources
from swarm.server.runner import parameter_digest
from swarm.training.tokenizer import DEFAULT_CACHE_DIR, DOCUMENT_SEPARATOR_TOKEN

__all__ = [
    "DTYPES",
    "ExportConfig",
    "ExportError",
    "StageState",
    "stage_claims",
    "choose_sources",
    "expected_parameters",
    "judge_parameters",
    "mixed_steps_reason",
    "read_run_records",
    "collect_stage_states",
    "write_tokenizer_files",
    "write_export",
]

logger = get_logger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
REPLY_SLACK_BYTES = 2**20  # bytes a parameters reply may take beyond its tensors (names, step, envelope)


@dataclass
class ExportConfig:
    """``swarm export``: which run to export, where to, and how long to wait for its replicas to agree."""

    out: str = ""  # directory to write the checkpoint into (created; must not hold a checkpoint already)
    dtype: str = "float32"  # dtype of the written tensors: float32, bfloat16 or float16
    allow_mixed_steps: bool = False  # write the model even when its stages are at different global steps
    max_rounds: int = 10  # reads of the swarm before giving up waiting for agreeing replicas and one global step
    retry_period_s: float = 2.0  # seconds between those reads
    call_timeout_s: float = 120.0  # seconds one replica may take to send its stage's parameters
    tokenizer_cache_dir: str = DEFAULT_CACHE_DIR  # where tokenizers fetched from organisers are kept
    run: RunConfig = field(default_factory=RunConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)

    def __post_init__(self) -> None:
        if not self.out:
            raise ValueError("out must name the directory to write the checkpoint into (--out DIR)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if isinstance(self.max_rounds, bool) or not isinstance(self.max_rounds, int) or self.max_rounds < 1:
            raise ValueError(f"max_rounds must be a positive integer, got {self.max_rounds!r}")
        for name in ("retry_period_s", "call_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")


class ExportError(RuntimeError):
    """The run's model cannot be exported as asked; the message says which stage and why."""


@dataclass(frozen=True)
class StageState:
    """One stage's downloaded parameters, checked against the digest its replicas' majority announces."""

    stage: int
    step: int
    digest: str
    peer_id: str  # the replica that sent them
    parameters: Dict[str, torch.Tensor]  # by the stage's parameter names


# ---- decisions (pure) ----


def stage_claims(records: Mapping[str, PeerRecord], stage: int) -> List[StateClaim]:
    """What the replicas of ``stage`` announce about their state."""
    return [StateClaim(r.peer_id, r.state, r.step, r.digest) for r in records.values() if r.stage == stage]


def choose_sources(claims: Sequence[StateClaim], distrusted: Collection[str], seed: int = 0) -> StateSources:
    """The replicas to download a stage from: those announcing the (step, digest) of a strict majority of its
    online replicas that are not ``distrusted`` (the exporter is none of them, so every online replica votes).
    No majority, no source: ``reason`` says what the replicas announce."""
    return trusted_state_sources(claims, own_id="", distrusted=distrusted, rng=random.Random(seed))


Shapes = Sequence[Tuple[str, Tuple[int, ...]]]  # (name, shape) of each parameter of a stage, in its order


def expected_parameters(model: ModelConfig, stage: int, num_stages: int) -> List[Tuple[str, Tuple[int, ...]]]:
    """(name, shape) of the parameters a replica of ``stage`` exports, in its order."""
    skeleton = stage_skeleton(model, stage, num_stages)
    return [(name, tuple(p.shape)) for name, p in skeleton.named_parameters() if p.requires_grad]


def _complete(reply: Any, expected: Shapes) -> Optional[str]:
    """Why ``reply`` is not a complete export of a stage with ``expected`` parameters, or None."""
    if not isinstance(reply, Mapping):
        return f"the reply is a {type(reply).__name__}, not a map"
    names, parameters = reply.get("names"), reply.get("parameters")
    if not isinstance(names, list) or not isinstance(parameters, list):
        return "the reply lacks the lists 'names' and 'parameters'"
    if names != [name for name, _ in expected]:
        return f"the reply names {len(names)} parameters that are not the stage's {len(expected)}"
    if len(parameters) != len(expected):
        return f"the reply holds {len(parameters)} tensors for {len(expected)} names"
    for (name, shape), tensor in zip(expected, parameters):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.float32 or tuple(tensor.shape) != shape:
            return f"parameter {name!r} is not a float32 tensor of shape {shape}"
    return None


def judge_parameters(
    sources: StateSources, reply: Any, expected: Shapes
) -> Tuple[StateVerdict, Optional[Dict[str, torch.Tensor]]]:
    """Whether a ``parameters`` reply is the state ``sources`` names (complete, finite, at its step, hashing to
    its digest), as a joining replica judges a downloaded state; with the parameters by name when it is."""
    reason = _complete(reply, expected)
    if reason is not None:
        return StateVerdict(False, reason=f"the state is incomplete: {reason}"), None
    parameters = list(reply["parameters"])
    finite = all(all_finite(p) for p in parameters)
    step = reply.get("step")
    step = step if isinstance(step, int) and not isinstance(step, bool) else None
    verdict = check_downloaded_state(sources, True, finite, step, parameter_digest(parameters) if finite else "")
    if not verdict.accept:
        return verdict, None
    return verdict, dict(zip(reply["names"], parameters))


def mixed_steps_reason(steps: Mapping[int, int]) -> Optional[str]:
    """None when every stage (``steps``: stage -> global step) is at one step; otherwise what differs."""
    if len(set(steps.values())) <= 1:
        return None
    listed = ", ".join(f"stage {stage} at step {step}" for stage, step in sorted(steps.items()))
    return f"the stages are at different global steps ({listed})"


# ---- I/O ----


async def read_run_records(dht: Any, run: RunConfig, timeout: float = 10.0) -> Dict[str, PeerRecord]:
    """Every peer record of ``run`` (all shards of all stages), without peers that announce other settings."""
    directory = Directory(dht, run.run_id, run.num_stages, home=str(dht.peer_id), rotate=-1)
    await directory.read(timeout=timeout, strict=True)
    return RunFilter(run)(directory.records())


class _NotYet(Exception):
    """A stage cannot be downloaded in this round; the next read of the swarm may change that."""


async def _download_stage(
    p2p: P2P, records: Mapping[str, PeerRecord], run: RunConfig, stage: int, distrusted: Set[str], timeout: float
) -> StageState:
    sources = choose_sources(stage_claims(records, stage), distrusted)
    if not sources.peer_ids:
        raise _NotYet(f"stage {stage}: {sources.reason}")
    expected = expected_parameters(run.model, stage, run.num_stages)
    limit = 2 * sum(4 * torch.Size(shape).numel() for _, shape in expected) + REPLY_SLACK_BYTES
    reasons = []
    for peer_id in sources.peer_ids:
        try:
            reply = await call_peer(
                p2p, PeerID.from_base58(peer_id), "parameters", {}, timeout=timeout, max_reply_bytes=limit
            )
        except Exception as e:  # timeouts, dead peers, error replies: ask the next replica
            reasons.append(f"{peer_id}: {type(e).__name__}: {e}")
            continue
        verdict, parameters = judge_parameters(sources, reply, expected)
        if verdict.accept and parameters is not None:
            return StageState(stage, sources.step, sources.digest, peer_id, parameters)
        if verdict.distrust:
            distrusted.add(peer_id)
            logger.warning(
                f"stage {stage}: replica {peer_id} serves parameters other than it announces: "
                f"{verdict.reason}; not trusting it"
            )
        reasons.append(f"{peer_id}: {verdict.reason}")
    raise _NotYet(
        f"stage {stage}: no replica sent the state its majority announces (step {sources.step}, "
        f"digest {sources.digest}): {'; '.join(reasons)}"
    )


async def collect_stage_states(dht: Any, p2p: P2P, config: ExportConfig) -> List[StageState]:
    """Every stage's checked parameters, all at one global step (or, with ``allow_mixed_steps``, at whatever
    steps they are); reads the swarm up to ``max_rounds`` times. :class:`ExportError` with the last reason."""
    run = config.run
    distrusted: Set[str] = set()  # replicas caught serving a state other than they announce
    reason = "no round completed"
    for round_index in range(config.max_rounds):
        if round_index:
            await asyncio.sleep(config.retry_period_s)
        try:
            records = await read_run_records(dht, run)
            states = [
                await _download_stage(p2p, records, run, stage, distrusted, config.call_timeout_s)
                for stage in range(run.num_stages)
            ]
        except (_NotYet, LookupError) as e:
            reason = str(e)
            logger.info(f"export round {round_index + 1}/{config.max_rounds}: {reason}")
            continue
        mixed = mixed_steps_reason({state.stage: state.step for state in states})
        if mixed is None:
            return states
        if config.allow_mixed_steps:
            logger.warning(f"{mixed}: writing them anyway, as --allow_mixed_steps asks")
            return states
        reason = mixed
        logger.info(f"export round {round_index + 1}/{config.max_rounds}: {reason}; reading the swarm again")
    hint = " (pass --allow_mixed_steps to write it anyway)" if "different global steps" in reason else ""
    raise ExportError(f"cannot export run {run.run_id!r} after {config.max_rounds} reads of the swarm: {reason}{hint}")


def write_tokenizer_files(out_dir: Path, data: bytes, seq_len: int) -> List[Path]:
    """The run's ``tokenizer.json`` as it is, and a ``tokenizer_config.json`` that lets
    ``transformers.AutoTokenizer`` load it as a fast tokenizer whose end-of-text token separates documents."""
    tokenizer_path, config_path = out_dir / "tokenizer.json", out_dir / "tokenizer_config.json"
    tokenizer_path.write_bytes(data)
    config_path.write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": seq_len,
                "eos_token": DOCUMENT_SEPARATOR_TOKEN,
                "add_bos_token": False,
                "add_eos_token": False,
            },
            indent=2,
            sort_keys=True,
        )
    )
    return [tokenizer_path, config_path]


def write_export(config: ExportConfig, states: Sequence[StageState], tokenizer: Optional[bytes]) -> List[Path]:
    """Write the checkpoint of ``states`` (one per stage, in order) and the run's tokenizer files, if any."""
    if [state.stage for state in states] != list(range(config.run.num_stages)):
        raise ExportError(
            f"need one state per stage 0..{config.run.num_stages - 1}, got stages {[state.stage for state in states]}"
        )
    if bool(tokenizer) != bool(config.run.tokenizer_sha256):
        raise ExportError("a run with a tokenizer needs its file, and a byte-token run has none")
    out = Path(config.out).expanduser()
    written = export_checkpoint(
        config.run.model, [state.parameters for state in states], out, dtype=DTYPES[config.dtype]
    )
    if tokenizer:
        written += write_tokenizer_files(out, tokenizer, config.run.model.seq_len)
    return written
