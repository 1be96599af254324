"""What the attack benchmark (``attacks.py``) needs beyond :mod:`_swarm`: the attack table, a swarm
whose bootstrap enforces the run's record schema, reading the roles' logs (losses, exclusions),
accounting that leaves the attacker out, and a held-out loss of the honest replicas' parameters.

Everything here runs in the benchmark's own process. Network waits are bounded: parameter
downloads by ``timeout`` (plus a margin), DHT reads by :func:`swarm.dht.store.fetch_records`.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import re
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from _swarm import LOOPBACK, TINY_MODEL, LiveSwarm, online
from swarm.training.data import load_corpus, validation_batches
from swarm.training.single_process import evaluate
from swarm.model.gpt import ModelConfig
from swarm.model.stages import FullModel
from swarm.dht.records import PeerRecord
from tests.utils.probe import Probe

__all__ = ["Attack", "ATTACKS", "AttackSwarm", "LogLine", "read_log", "trainer_losses", "tail_mean", "first_exclusion",
           "first_warning", "excludes",
           "honest_accounted", "tiny_model_config", "heldout_batches", "initial_loss", "heldout_losses", "finite_or_none"]

Batches = List[Tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Attack:
    """One attack: a faulty replica of ``stage`` (``fault``) or a faulty trainer (``trainer_attack``)."""

    name: str
    stage: int  # the stage with the attacked replicas; trainer attacks use stage 0's shape
    fault: Optional[str] = None  # the attacker peer's --fault
    trainer_attack: Optional[str] = None  # the attacker trainer's --attack
    late_joiner: bool = False  # one honest replica of ``stage`` joins late and must download the stage's state
    replicas: int = 0  # replicas of ``stage``, the attackers included; 0 = the benchmark's --attacked_replicas
    attackers: int = 1  # faulty replicas among them (with ``fault``), all acting alike

    @property
    def by_trainer(self) -> bool:
        return self.trainer_attack is not None


ATTACKS: Dict[str, Attack] = {a.name: a for a in (
    Attack("sign_flip_x1000", 1, fault="sign_flip_gradients"),
    Attack("random_direction_x1000", 1, fault="random_gradients"),
    Attack("nan_gradients", 0, fault="nan_gradients"),
    Attack("little_is_enough", 0, fault="little_is_enough"),
    Attack("same_norm_sign_flip", 0, fault="same_norm_sign_flip", replicas=3),
    Attack("colluding_pair_sign_flip", 0, fault="same_norm_sign_flip", replicas=5, attackers=2),
    Attack("colluding_pair_little_is_enough", 0, fault="little_is_enough", replicas=5, attackers=2),
    Attack("noisy_activations", 0, fault="noisy_outputs"),
    Attack("zeroed_activations", 0, fault="zero_outputs"),
    Attack("poisoned_state", 0, fault="poisoned_state", late_joiner=True),
    Attack("wrong_loss", 1, fault="wrong_loss"),
    Attack("non_numeric_loss", 1, fault="non_numeric_loss"),
    Attack("scaled_grad_outputs", 0, trainer_attack="scaled_grad_outputs"),
    Attack("shuffled_targets", 0, trainer_attack="shuffled_targets"),
)}


class AttackSwarm(LiveSwarm):
    """A :class:`LiveSwarm` whose bootstrap is given the run's id and stage count, so that its DHT storage
    refuses records that are not the run's (as every other node of the run does)."""

    def __init__(self, *args, num_stages: int = 2, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_stages = num_stages

    def bootstrap(self, timeout: float = 60.0) -> None:
        args = ["--host_maddrs", LOOPBACK, "--run_id", self.run_id, "--num_stages", str(self.num_stages)]
        process = self._start("bootstrap", args, f"{self.run_id}-bootstrap")
        self.initial_peers = process.wait_event("bootstrap_ready", timeout)["maddrs"]
        self.probe = Probe(self.initial_peers, self.run_id, num_stages=self.num_stages)


# ---- role logs (hivemind's format: "Mar 05 12:34:56.789 [WARN] [caller] message") ----

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_HEADER = re.compile(r"^(\w{3} +\d{1,2} \d{2}:\d{2}:\d{2})\.(\d+) \[(\w+)\](?: \[[^\]]*\])? (.*)$")
_PROGRESS = re.compile(r"samples\s+(\d+)\s+loss (\S+)")


@dataclass(frozen=True)
class LogLine:
    t: float  # seconds since the epoch
    level: str  # INFO, WARN, ERROR, ...
    message: str


def _epoch(stamp: str, millis: str, now: float) -> float:
    """Seconds since the epoch of a year-less local time stamp, taken as the latest such time not after ``now``."""
    year = datetime.fromtimestamp(now).year
    when = datetime.strptime(f"{year} {' '.join(stamp.split())}", "%Y %b %d %H:%M:%S")
    if when.timestamp() > now + 86400:  # a log from last December read in January
        when = when.replace(year=year - 1)
    return when.timestamp() + int(millis) / 10 ** len(millis)


def read_log(path: Path) -> Iterator[LogLine]:
    """The log's records; continuation lines (tracebacks) are skipped."""
    now = time.time()
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return
    for raw in text.splitlines():
        match = _HEADER.match(_ANSI.sub("", raw))
        if match is not None:
            yield LogLine(_epoch(match.group(1), match.group(2), now), match.group(3), match.group(4))


def trainer_losses(path: Path) -> List[Tuple[float, float]]:
    """(time, loss) of a trainer's progress lines: each loss is the mean over its last 20 micro-batches."""
    found = []
    for line in read_log(path):
        match = _PROGRESS.search(line.message) if line.level == "INFO" else None
        if match is not None and match.group(2) != "None":
            try:
                found.append((line.t, float(match.group(2))))
            except ValueError:
                continue
    return found


def tail_mean(series: Sequence[Tuple[float, float]], start: float, end: float, fraction: float) -> Optional[float]:
    """Mean of the values logged within the last ``fraction`` of [start, end] (NaN if any is not finite)."""
    cutoff = end - fraction * (end - start)
    values = [v for t, v in series if cutoff <= t <= end]
    return sum(values) / len(values) if values else None


# What an honest role logs when it bans or refuses a peer (see :func:`excludes`); ``{id}`` is the attacker's id.
_EXCLUSIONS = (
    r"banning peer {id}\b",  # a trainer bans a replica (a bad reply, outvoted, or checks it could not compare)
    r"excluding {id} from averaging",  # a replica bans a stage-mate from averaging
    r"refus\w* .*\b{id}\b",  # its state, its calls or its DHT traffic refused
    r"down-weighting trainer {id} to 0(?:\.0+)?(?![\d.])",  # a last-stage replica gives its micro-batches no weight
)


def excludes(message: str, attacker_id: str) -> bool:
    """Whether a log line says that the attacker is banned or refused: not merely named in a warning. A clipped
    micro-batch, a down-weighting above zero, claims ignored for a while, or a failed call are not exclusions."""
    ident = re.escape(attacker_id)
    return any(re.search(pattern.format(id=ident), message, re.IGNORECASE) for pattern in _EXCLUSIONS)


def _first(paths: Sequence[Path], attacker_id: str, matches) -> Optional[Tuple[LogLine, str]]:
    best: Optional[Tuple[LogLine, str]] = None
    for path in paths:
        for line in read_log(path):
            if line.level in ("INFO", "DEBUG") or attacker_id not in line.message or not matches(line.message):
                continue
            if best is None or line.t < best[0].t:
                best = (line, path.stem)
            break  # a log's lines are in time order: its first match is its earliest
    return best


def first_exclusion(paths: Sequence[Path], attacker_id: str) -> Optional[Tuple[LogLine, str]]:
    """The earliest WARN (or worse) line of the honest roles' logs that bans or refuses the attacker
    (:func:`excludes`), and the log's name; None if no honest role ever did."""
    return _first(paths, attacker_id, lambda message: excludes(message, attacker_id))


def first_warning(paths: Sequence[Path], attacker_id: str) -> Optional[Tuple[LogLine, str]]:
    """The earliest WARN (or worse) line of the honest roles' logs that names the attacker, whatever it says:
    when the attacker was first noticed, which may be long before (or without) its exclusion."""
    return _first(paths, attacker_id, lambda message: True)


# ---- accounting ----

def honest_accounted(records: Dict[str, PeerRecord], stage: int, exclude: Sequence[str]) -> int:
    """Samples the stage's honest online replicas account for: the largest samples_applied among them plus
    their samples pending and frozen (what a faulty replica holds is not counted)."""
    replicas = [r for r in online(records, stage) if r.peer_id not in exclude]
    if not replicas:
        return 0
    return max(r.samples_applied for r in replicas) + sum(r.samples_pending + r.samples_frozen for r in replicas)


# ---- held-out loss of the honest replicas' parameters ----

def tiny_model_config() -> ModelConfig:
    """The ModelConfig that :data:`TINY_MODEL`'s flags describe."""
    return ModelConfig(**{flag.lstrip("-"): int(value) for flag, value in zip(TINY_MODEL[::2], TINY_MODEL[1::2])})


def heldout_batches(model: ModelConfig, max_data_mb: float, batch_size: int = 32, num_batches: int = 8) -> Batches:
    """Fixed windows of the validation split of the corpus the trainers read (disjoint from their training data)."""
    corpus = load_corpus(None, max_bytes=int(max_data_mb * 2**20))
    return validation_batches(corpus.validation, model.seq_len, batch_size, num_batches)


def initial_loss(model: ModelConfig, num_stages: int, seed: int, batches: Batches) -> float:
    """Held-out loss of the run's initialisation: what a run that learned nothing ends at."""
    with torch.no_grad():
        return evaluate(FullModel(model, num_stages, seed), batches)


async def _parameters(probe: Probe, peer_id: str, timeout: float) -> Dict[str, torch.Tensor]:
    reply = await asyncio.wait_for(probe.call(peer_id, "parameters", {}, timeout=timeout), timeout + 5.0)
    return dict(zip(reply["names"], reply["parameters"]))


def _load(module: torch.nn.Module, parameters: Dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, param in module.named_parameters():
            if param.requires_grad:
                if name not in parameters or parameters[name].shape != param.shape:
                    raise ValueError(f"the exported parameters do not match the model at {name!r}")
                param.copy_(parameters[name])


def parameters_hash(parameters: Dict[str, torch.Tensor]) -> str:
    """One replica's exported parameters as a short hash: equal hashes, bit-identical parameters."""
    digest = hashlib.sha256()
    for name in sorted(parameters):
        digest.update(name.encode())
        digest.update(parameters[name].contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


async def heldout_losses(probe: Probe, model: ModelConfig, num_stages: int, seed: int, stage: int,
                         honest: Dict[int, List[str]], batches: Batches, timeout: float = 30.0
                         ) -> Tuple[Dict[str, float], List[str], Dict[str, str]]:
    """Held-out loss through each honest replica of ``stage`` (the other stages: their first honest replica
    that answers), computed here from the replicas' exported parameters; returns (loss by peer id, errors,
    :func:`parameters_hash` by peer id of ``stage``)."""
    full, errors, hashes = FullModel(model, num_stages, seed), [], {}
    for other in (s for s in range(num_stages) if s != stage):
        for peer_id in honest.get(other, []):
            try:
                _load(full.stages[other], await _parameters(probe, peer_id, timeout))
                break
            except Exception as e:  # a replica that died or answers garbage: try the next
                errors.append(f"stage {other} {peer_id[-6:]}: {type(e).__name__}: {e}")
        else:
            return {}, errors + [f"no honest replica of stage {other} exported its parameters"], hashes
    losses: Dict[str, float] = {}
    for peer_id in honest.get(stage, []):
        try:
            parameters = await _parameters(probe, peer_id, timeout)
            _load(full.stages[stage], parameters)
        except Exception as e:
            errors.append(f"stage {stage} {peer_id[-6:]}: {type(e).__name__}: {e}")
            continue
        hashes[peer_id] = parameters_hash(parameters)
        with torch.no_grad():
            losses[peer_id] = evaluate(full, batches)
    return losses, errors, hashes


def finite_or_none(value: Optional[float], digits: int = 4) -> Optional[float]:
    """A float for JSON: None for a missing or non-finite value (JSON has no NaN)."""
    return round(value, digits) if value is not None and math.isfinite(value) else None
