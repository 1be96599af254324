"""Attack benchmark: a live loopback swarm trained with a Byzantine attacker (or a colluding pair), defences on and off.

Why: a volunteer swarm must keep training when a replica or a trainer lies. This script measures, on
real subprocesses, how much each attack harms training with the defences off, how much of that the
defences (``--defences``, a run setting every role of a run gets) take away, what they cost in
throughput, and how fast the attacker is excluded.

What runs (every address 127.0.0.1; the tests' TINY_MODEL and fast announce periods FAST_PEER), one
swarm per run, runs one after another:
  * a bootstrap DHT; 2 stages; the attacked stage has ``--attacked_replicas`` (4) replicas, one of them
    the attacker (``swarm peer --fault NAME``); the other stage ``--other_replicas`` (1). Attacks on
    stage 0: stage 0 x4, stage 1 x1. Attacks on stage 1 (``wrong_loss``, ``non_numeric_loss``, and the two
    x1000 gradient attacks, aimed at the stage that holds the output layer, where a step up the gradient
    raises the loss directly, with no honest stage after it to adapt): stage 1 x4, stage 0 x1. Trainer
    attacks use the stage-0 shape with no faulty replica. Attacks that set their own shape: ``same_norm_sign_flip``
    (stage 0 x3, one replica negating its gradient at its own norm), ``colluding_pair_sign_flip`` and
    ``colluding_pair_little_is_enough`` (stage 0 x5, two of them attacking alike); each is compared with clean
    runs of its own shape (``--clean_without_alignment`` adds clean runs with the alignment check off, for its cost);
  * 2 trainers, each sending ``--samples_per_trainer`` samples (so every run compares the model after
    the same data; ``--duration_s`` bounds the time, and is the only limit with ``--samples_per_trainer 0``);
    trainer0 is always honest, trainer1 is the attacker for trainer attacks (``swarm train --attack NAME``);
  * ``poisoned_state``: the attacked stage starts with 2 honest replicas and the attacker; the 4th
    (honest) replica starts once the stage has applied 1/3 of the run's global steps (1/3 of
    ``--duration_s`` without a sample limit) and must download the stage's state; the attacker
    serves it poisoned state, which the joiner must refuse with the defences on;
  * per attack: a run with the defences on and one with ``--defences false`` (same seed and samples),
    and clean runs (the attacker's slot taken by an honest role), defences on and off, reused by every
    attack of that swarm shape: ``--clean_repeats`` (5) of each, on and off taking turns, because one
    run's throughput moves by 10-40% with what else the shared cores do.

Measured, per run:
  loss             the mean of trainer0's logged losses (each the mean over its last 20 micro-batches, logged
                   every second) over the last 25% of the training time: what the honest trainer sees
                   (a replica lying about the loss lies to this figure too).
  heldout_loss     the held-out loss of the model the honest replicas hold at the end, computed in this process
                   from their exported parameters on fixed windows of the validation split: the largest over the
                   honest replicas of the attacked stage (the other stage: its first honest replica). Attacks on
                   replies cannot lie to it. ``heldout_loss_initial`` is the same for the run's initialisation.
  throughput       trainer0's samples sent per second of its training time (``train_s`` of its done event: from
                   its first micro-batch to its last, without the drain; the same honest trainer in every run).
  peer_cpu_ms_per_sample   CPU the stage peers and the bootstrap (with their p2pd daemons and helpers) spent from
                   trainers ready to trainers done, per sample sent: what the defences cost on a machine whose
                   cores are the limit, steadier between runs than samples/s (``clean_peer_cpu_ratio_off_vs_on``:
                   the median without the defences over the median with them; 1 = they cost nothing).
                   ``peer_cpu_ms_per_sample_by_kind`` splits it into the peers' own processes ("python"), the
                   hivemind helpers they fork ("helpers": DHT and averager) and their p2pd daemons ("p2pd").
  samples_lost     samples the trainers sent minus the samples the stages account for once the swarm settled:
                   MIN over stages of (largest samples_applied + samples pending + frozen) over the stage's honest
                   online replicas (the attacker's share is not counted). For trainer attacks it includes the
                   attacker trainer's own samples that the stages refused (``samples_sent_by_attacker`` bounds it).
                   ``samples_counted_twice``: how far the most generous stage's accounting exceeds the samples sent.
  honest_states_at_end   distinct parameter sets among the attacked stage's honest replicas, from the parameters they
                   export for ``heldout_loss``: 1 when they are all bit-identical, more when they split (or one
                   is still catching up).
  loss_first, loss_peak   trainer0's first logged loss and the largest it logged: a run the attack sends backwards
                   peaks above where it started, even where the honest replicas pull it back later.
  attacker_rounds  averaging rounds the attacking replica completed (its log), beside ``global_steps``: an attack
                   only acts on the steps whose round it joined.
  rounds_sat_out   robust averaging rounds an honest replica sat out (it lacked a gradient most of its group held,
                   or no majority of the group confirmed the inputs it decided on), over all honest replicas' logs.
  honest_excluded  honest replicas that an honest replica's log excludes from averaging ("excluding <id> from
                   averaging"), with the line: empty in every run, clean or attacked, or a defence misfired.
  attacker_excluded_after_s   seconds from the moment the attacker could first act (a replica: once it was ready
                   and a trainer was training; a trainer: once it was ready; ``poisoned_state``: once the
                   joiner was started, or 0 if a resyncing honest replica refused its state even earlier) to
                   the first line of an honest role's log that bans or refuses it: a trainer's "banning peer
                   <id>", a replica's WARN "excluding <id> from averaging", a WARN refusing its state, calls or
                   DHT traffic, or a last-stage replica down-weighting the attacker trainer to 0. A warning that
                   only names it (a clipped micro-batch, a down-weighting above 0, claims ignored for a while) is
                   not an exclusion: an attack that is only bounded stays null ("never excluded").
                   ``attacker_excluded_after_online_s`` counts from the attacker's own ready line instead;
                   ``attacker_first_warning_after_s`` from the same moment to the first warning naming it at all.
                   Resolution: log stamps (ms) and polling (0.2 s).
Per attack: ``loss_*`` and ``heldout_loss_*`` of the clean (defences on; the repeat of median held-out loss), defended
and undefended runs, ``loss_ratio_defended_vs_clean``, ``throughput_ratio_defended_vs_clean`` (defended attack
run over the median of the clean defended runs of the same shape), ``undefended_diverged`` (the undefended
run's held-out loss is not finite or no better than the initialisation's, or its trainer loss is not finite),
``undefended_progress_lost`` (the share of the clean run's held-out improvement over the initialisation that
the undefended run did not make: 0 as good as clean, 1 no better than the initialisation; a NaN run counts 1),
and ``clean_throughput_ratio_on_vs_off``: the median clean throughput with the defences on over the median
without them, for the attack's swarm shape (every clean throughput is in ``clean_throughputs``).

Output: progress lines, a table, a summary line (clean throughput, defences on vs off), then one JSON list.
Every process's log is kept in ``--log_dir`` (a fresh temporary directory by default).

Usage: python benchmarks/attacks.py [--samples_per_trainer 3072] [--attacks a,b] [--clean_repeats 5] [--skip_undefended]
                                  [--log_dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _roles import cpu_seconds_by_kind  # noqa: E402
from _swarm import FAST_PEER, TINY_MODEL, counts, install_signal_handlers, log, make_log_dir  # noqa: E402
from _records import add_record_arguments, write_record  # noqa: E402
from _attacks_roles import (ATTACKS, Attack, AttackSwarm, finite_or_none, first_exclusion, first_warning,  # noqa: E402
                            heldout_batches,
                            heldout_losses, honest_accounted, initial_loss, read_log, tail_mean,
                            tiny_model_config, trainer_losses)
from peers.launcher import RoleProcess  # noqa: E402

NUM_STAGES = 2
NUM_TRAINERS = 2
MAX_DATA_MB = 2.0  # corpus the trainers read (MiB); the held-out windows come from its validation split
LOSS_TAIL = 0.25  # the final loss is the mean over this last fraction of the training time
READY_TIMEOUT_S = 180.0  # seconds a role may take to start: minutes when the 2 cores are shared
STOP_TIMEOUT_S = 10.0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples_per_trainer", type=int, default=3072,
                   help="samples each trainer sends per run (0: train for --duration_s)")
    p.add_argument("--duration_s", type=float, default=240.0, help="seconds each trainer trains at most, per run")
    p.add_argument("--attacks", default=",".join(ATTACKS), help=f"comma-separated, from: {', '.join(ATTACKS)}")
    p.add_argument("--seed", type=int, default=0, help="the run's --seed (initialisation); trainers draw with seed+1, seed+2")
    p.add_argument("--skip_undefended", action="store_true", help="no --defences false runs (quicker; no harm figures)")
    p.add_argument("--clean_repeats", type=int, default=5,
                   help="clean runs per swarm shape and defence setting (their median throughput is compared)")
    p.add_argument("--attacked_replicas", type=int, default=4,
                   help="replicas of the attacked stage, the attacker included (where the attack does not set its own)")
    p.add_argument("--clean_without_alignment", action="store_true",
                   help="also run the clean shapes with the defences on but their alignment check off "
                        "(--alignment_rounds 0), to measure what the check costs")
    p.add_argument("--other_replicas", type=int, default=1, help="replicas of the other stage")
    p.add_argument("--target_batch_size", type=int, default=256, help="samples per global step")
    p.add_argument("--batch_size", type=int, default=8, help="samples per micro-batch")
    p.add_argument("--max_in_flight", type=int, default=4, help="micro-batches in flight per trainer")
    p.add_argument("--lr", type=float, default=0.003, help="learning rate (as tests/test_convergence.py)")
    p.add_argument("--settle_timeout_s", type=float, default=20.0, help="after training, wait at most this long for the accounting to settle")
    p.add_argument("--log_dir", default=None, help="where every process writes its log (default: a new temp dir)")
    add_record_arguments(p)
    args = p.parse_args(argv)
    unknown = [a for a in args.attacks.split(",") if a not in ATTACKS]
    if unknown:
        p.error(f"unknown attacks {unknown}; known: {list(ATTACKS)}")
    if args.samples_per_trainer < 0:
        p.error("--samples_per_trainer must be 0 (no limit) or positive")
    if args.clean_repeats < 1:
        p.error("--clean_repeats must be at least 1")
    if args.attacked_replicas < 3:
        p.error("--attacked_replicas must be at least 3 (an attacker and two honest replicas)")
    return args


@dataclass(frozen=True)
class RunSpec:
    """One run: an attack (None: clean) on the swarm shape of ``stage`` with ``replicas`` replicas there,
    defences on or off; ``alignment`` False turns the defences' alignment check off (``--alignment_rounds 0``)."""

    stage: int
    replicas: int
    defences: bool
    attack: Optional[Attack] = None
    alignment: bool = True

    @property
    def label(self) -> str:
        name = self.attack.name if self.attack else f"clean_s{self.stage}x{self.replicas}"
        return f"{name}_{'on' if self.defences else 'off'}{'' if self.alignment or not self.defences else '_noalign'}"

    @property
    def mode(self) -> str:
        """How the defences ran: "on", "off", or "on_noalign"."""
        return "off" if not self.defences else ("on" if self.alignment else "on_noalign")


@dataclass
class Role:
    """A started role and what its ready event said."""

    process: RoleProcess
    peer_id: str = ""
    ready_at: float = 0.0  # time.time() when its ready event arrived


class Run:
    """The roles of one run and the times the metrics are measured from."""

    def __init__(self, spec: RunSpec, swarm: AttackSwarm):
        self.spec, self.swarm = spec, swarm
        self.peers: Dict[int, List[Role]] = {}
        self.attackers: List[Role] = []  # faulty replicas, or the attacking trainer
        self.trainers: List[Role] = []
        self.joiner: Optional[Role] = None
        self.joiner_started_at: Optional[float] = None
        self.train_start = 0.0  # time.time() when the first trainer was ready: each trains from its own ready line
        self.errors: List[str] = []

    @property
    def attacker(self) -> Optional[Role]:
        """The first attacker (the only one, but for colluding replicas)."""
        return self.attackers[0] if self.attackers else None

    def is_attacker(self, role: Role) -> bool:
        return any(role is a for a in self.attackers)

    def honest_peers(self) -> Dict[int, List[str]]:
        honest = {s: [r.peer_id for r in roles if not self.is_attacker(r) and r.peer_id] for s, roles in self.peers.items()}
        if self.joiner is not None and self.joiner.peer_id:
            honest.setdefault(self.spec.stage, []).append(self.joiner.peer_id)
        return honest


async def _ready(swarm: AttackSwarm, role: Role, event: str, id_field: str) -> Role:
    ready = await swarm.event(role.process, event, READY_TIMEOUT_S)
    role.peer_id, role.ready_at = ready[id_field], time.time()
    return role


async def start_peers(run: Run, args) -> None:
    """Every replica at once (the late joiner of poisoned_state excepted); wait until all are online."""
    spec, swarm = run.spec, run.swarm
    fault = spec.attack.fault if spec.attack else None
    for stage in range(NUM_STAGES):
        wanted = spec.replicas if stage == spec.stage else args.other_replicas
        attackers = spec.attack.attackers if fault is not None else 0
        if stage == spec.stage and spec.attack is not None and spec.attack.late_joiner:
            wanted -= 1
        roles = []
        for i in range(wanted):
            if stage == spec.stage and i < attackers:
                run.attackers.append(Role(swarm.peer(stage, f"attacker{i if i else ''}", ["--fault", fault])))
                roles.append(run.attackers[-1])
            else:
                roles.append(Role(swarm.peer(stage, f"s{stage}p{i}")))
        run.peers[stage] = roles
    await asyncio.gather(*(_ready(swarm, r, "peer_ready", "peer_id") for roles in run.peers.values() for r in roles))
    shape = tuple(len(run.peers[s]) for s in range(NUM_STAGES))
    await swarm.wait_for(lambda r: counts(r, NUM_STAGES) == shape, 60.0, f"{shape} replicas online")


async def start_trainers(run: Run, args) -> None:
    attack = run.spec.attack
    run.trainers = [Role(run.swarm.trainer("trainer0", ["--trainer_seed", str(args.seed + 1)]))]
    if attack is not None and attack.by_trainer:
        run.attackers.append(Role(run.swarm.trainer("attacker", ["--trainer_seed", str(args.seed + 2),
                                                                 "--attack", attack.trainer_attack])))
        run.trainers.append(run.attackers[-1])
    else:
        run.trainers.append(Role(run.swarm.trainer("trainer1", ["--trainer_seed", str(args.seed + 2)])))
    await asyncio.gather(*(_ready(run.swarm, t, "trainer_ready", "trainer_id") for t in run.trainers))
    run.train_start = min(t.ready_at for t in run.trainers)


async def late_join(run: Run, args) -> None:
    """The honest replica that joins the attacked stage mid-run and downloads its state: once the stage
    applied a third of the run's global steps, or after a third of ``--duration_s`` without a sample limit."""
    if args.samples_per_trainer:
        steps = NUM_TRAINERS * args.samples_per_trainer // args.target_batch_size
        try:
            await run.swarm.wait_for(lambda r: max((x.step for x in r.values() if x.stage == run.spec.stage), default=0)
                                     >= steps // 3, args.duration_s / 3, f"stage {run.spec.stage} at step {steps // 3}")
        except TimeoutError:
            pass  # a slow run: join anyway, after a third of the time limit
    else:
        await asyncio.sleep(args.duration_s / 3)
    run.joiner_started_at = time.time()
    run.joiner = Role(run.swarm.peer(run.spec.stage, "joiner"))
    log(f"  [{run.spec.label}] an honest replica joins stage {run.spec.stage}")
    try:
        await _ready(run.swarm, run.joiner, "peer_ready", "peer_id")
        log(f"  [{run.spec.label}] the joiner serves after {run.joiner.ready_at - run.joiner_started_at:.1f}s")
    except TimeoutError as e:
        run.errors.append(f"joiner: {str(e).splitlines()[0]}")
        log(f"  [{run.spec.label}] the joiner did not become ready: {str(e).splitlines()[0]}")


async def report_progress(run: Run, period_s: float = 10.0) -> None:
    """A progress line every ``period_s``: replicas per stage, honest replicas' steps, trainers' samples and losses."""
    while True:
        await asyncio.sleep(period_s)
        try:
            snap = await asyncio.wait_for(run.swarm.snapshot(), timeout=10.0)
        except Exception as e:  # a slow or failed read only costs a progress line
            log(f"  [{run.spec.label}] DHT read failed: {type(e).__name__}")
            continue
        steps = {s: sorted({r.step for r in snap.peers.values() if r.peer_id in ids and r.stage == s})
                 for s, ids in run.honest_peers().items()}
        trainers = [f"{r.samples_sent}@{r.loss:.3f}" if r.loss is not None else f"{r.samples_sent}@-"
                    for r in snap.trainers.values()]
        log(f"  [{run.spec.label}] {time.time() - run.train_start:5.0f}s  replicas {counts(snap.peers, NUM_STAGES)}"
            f"  honest replicas' steps by stage {steps}  trainers sent@loss {trainers}")


async def settle(run: Run, total_sent: int, timeout: float) -> Tuple[int, ...]:
    """Wait until the honest replicas account for every sample sent, or their accounting stays put for 3 s
    with nothing frozen (an attacker's share may never arrive), at most ``timeout``; returns it per stage."""
    exclude = [a.peer_id for a in run.attackers]
    deadline, last, since = time.monotonic() + timeout, None, time.monotonic()
    accounted: Tuple[int, ...] = (0,) * NUM_STAGES
    while time.monotonic() < deadline:
        records = await run.swarm.probe.records()
        if records:
            accounted = tuple(honest_accounted(records, s, exclude) for s in range(NUM_STAGES))
            frozen = any(r.samples_frozen for r in records.values() if r.peer_id not in exclude)
            if min(accounted) == total_sent and not frozen:
                break
            if accounted != last or frozen:
                last, since = accounted, time.monotonic()
            elif time.monotonic() - since >= 3.0:
                break
        await asyncio.sleep(0.5)
    return accounted


def exclusion(run: Run) -> Dict[str, Any]:
    """When the honest roles' logs first exclude the attacker (see the module's docstring); with colluding
    replicas, when the last of them was excluded (None while one never was) and first warned of."""
    if not run.attackers or not all(a.peer_id for a in run.attackers):
        return {}
    figures = [_exclusion_of(run, attacker) for attacker in run.attackers]
    if len(figures) == 1:
        return figures[0]
    combined = dict(max(figures, key=lambda f: math.inf if f["attacker_excluded_after_s"] is None
                        else f["attacker_excluded_after_s"]))
    for key in ("attacker_excluded_after_s", "attacker_excluded_after_online_s", "attacker_first_warning_after_s"):
        values = [f[key] for f in figures]
        combined[key] = None if None in values else max(values)
    combined["attackers_excluded_after_s"] = [f["attacker_excluded_after_s"] for f in figures]
    return combined


def _exclusion_of(run: Run, attacker: Role) -> Dict[str, Any]:
    by_trainer = run.spec.attack.by_trainer
    honest = [r for roles in run.peers.values() for r in roles if not run.is_attacker(r)]
    if not by_trainer:
        honest += [t for t in run.trainers if not run.is_attacker(t)]
    if run.joiner is not None:
        honest.append(run.joiner)
    paths = [r.process.log_path for r in honest]
    found, warned = first_exclusion(paths, attacker.peer_id), first_warning(paths, attacker.peer_id)

    def since(line) -> Optional[float]:
        """Seconds from the moment the attacker could first act to ``line`` (see the module's docstring)."""
        if run.spec.attack.late_joiner:
            # any replica that downloads the stage's state is its victim: a resyncing one may refuse its state before
            # the joiner starts, and was then its first victim, refusing it as the download ended (0 s, not negative)
            start = None if run.joiner_started_at is None else min(run.joiner_started_at, line.t)
        else:
            start = attacker.ready_at if by_trainer else max(attacker.ready_at, run.train_start)
        return None if start is None else round(line.t - start, 2)

    figures: Dict[str, Any] = {"attacker_excluded_after_s": None, "attacker_excluded_after_online_s": None,
                               "attacker_first_warning_after_s": None}
    if warned is not None:
        figures["attacker_first_warning_after_s"] = since(warned[0])
        figures["first_warning_evidence"] = f"{warned[1]}: {warned[0].message[:200]}"
    if found is not None and since(found[0]) is not None:
        line, name = found
        figures.update(attacker_excluded_after_s=since(line),
                       attacker_excluded_after_online_s=round(line.t - attacker.ready_at, 2),
                       exclusion_evidence=f"{name}: {line.message[:200]}")
    return figures


def peers_cpu_seconds(swarm: AttackSwarm) -> Dict[str, float]:
    """CPU seconds used so far by every role but the trainers, by kind of process: "python" (the peers' own
    processes: compute, request handling, verification re-runs, clipping), "helpers" (the hivemind DHT and
    averager processes they fork: averaging rounds), "p2pd" (their daemons). Trainers are left out because
    they exit as soon as they are done, and the CPU of an exited process can no longer be read."""
    roles = {p.name: p.pid for p in swarm.processes if p.role != "train"}
    kinds: Dict[str, float] = {}
    for key, seconds in cpu_seconds_by_kind(roles).items():
        kind = key.rsplit(" ", 1)[-1]
        kinds[kind] = kinds.get(kind, 0.0) + seconds
    return kinds


async def train_and_measure(run: Run, args, batches) -> Dict[str, Any]:
    """From trainers ready to the figures of the run: trainers' results, accounting, held-out loss, logs."""
    spec, swarm = run.spec, run.swarm
    cpu_start = peers_cpu_seconds(swarm)
    tasks = [asyncio.create_task(report_progress(run))]
    if spec.attack is not None and spec.attack.late_joiner:
        tasks.append(asyncio.create_task(late_join(run, args)))
    try:
        done = [await swarm.event(t.process, "trainer_done", args.duration_s + 120.0) for t in run.trainers]
    finally:
        for task in tasks:
            task.cancel()
    cpu_end = peers_cpu_seconds(swarm)
    peer_cpu_s = {kind: cpu_end[kind] - cpu_start.get(kind, 0.0) for kind in cpu_end}
    sent, train_s = [d["samples_sent"] for d in done], done[0]["train_s"]
    log(f"[{spec.label}] trainers done: sent {sent}, failed {[d['failed'] for d in done]}, "
        f"drained {[d['drained'] for d in done]}, resent {[d.get('resent') for d in done]}")
    accounted = await settle(run, sum(sent), args.settle_timeout_s)
    losses, errors, hashes = await heldout_losses(swarm.probe, tiny_model_config(), NUM_STAGES, args.seed,
                                                  spec.stage, run.honest_peers(), batches)
    run.errors += errors
    honest_trainer = run.trainers[0]
    series = trainer_losses(honest_trainer.process.log_path)
    loss = tail_mean(series, honest_trainer.ready_at, honest_trainer.ready_at + train_s, LOSS_TAIL)
    attacker_rounds = None
    if run.attacker is not None and not spec.attack.by_trainer:
        attacker_rounds = sum(ROUND_DONE.search(line.message) is not None
                              for line in read_log(run.attacker.process.log_path))
    heldout = None if not losses else (max(losses.values()) if all(map(math.isfinite, losses.values())) else math.nan)
    honest = {p for ids in run.honest_peers().values() for p in ids}
    records = await swarm.probe.records()
    return {
        "label": spec.label, "defences": spec.defences,
        "loss": loss, "heldout_loss": heldout,
        "loss_first": series[0][1] if series else None, "loss_peak": max((v for _, v in series), default=None),
        "attacker_rounds": attacker_rounds,
        "heldout_losses": {p[-6:]: finite_or_none(v) for p, v in losses.items()},
        "throughput_samples_per_s": round(sent[0] / train_s, 2) if train_s > 0 else None, "train_s": train_s,
        "samples_sent": sum(sent),
        "peer_cpu_ms_per_sample": round(1000 * sum(peer_cpu_s.values()) / sum(sent), 2) if sum(sent) else None,
        "peer_cpu_ms_per_sample_by_kind": {kind: round(1000 * seconds / sum(sent), 2)
                                           for kind, seconds in sorted(peer_cpu_s.items())} if sum(sent) else None,
        "samples_sent_by_attacker": sent[1] if spec.attack is not None and spec.attack.by_trainer else 0,
        "samples_accounted_by_stage": list(accounted), "samples_lost": sum(sent) - min(accounted),
        "samples_counted_twice": max(0, max(accounted) - sum(sent)),
        "global_steps": max((r.step for r in records.values() if r.peer_id in honest), default=None),
        "honest_states_at_end": len(set(hashes.values())) if hashes else None,
        "rounds_sat_out": sum(SAT_OUT in line.message for roles in run.peers.values() for role in roles
                              if not run.is_attacker(role) for line in read_log(role.process.log_path)),
        "honest_excluded": honest_excluded(run, honest),
        "replicas_at_end": list(counts(records, NUM_STAGES)),
        "load_average_1m": round(os.getloadavg()[0], 2),  # the machine's load: throughput figures move with it
        **exclusion(run),
    }


SAT_OUT = "sitting this averaging round out"
EXCLUDING = re.compile(r"excluding (\S+) from averaging")


def honest_excluded(run: Run, honest: set) -> List[str]:
    """Honest replicas that an honest replica's log excludes from averaging (must stay empty), with the reason."""
    found = {}
    for roles in run.peers.values():
        for role in roles:
            if run.is_attacker(role):
                continue
            for line in read_log(role.process.log_path):
                match = EXCLUDING.search(line.message)
                if match is not None and match.group(1) in honest:
                    found.setdefault(match.group(1), line.message[:200])
    return [f"{peer}: {why}" for peer, why in sorted(found.items())]
ROUND_DONE = re.compile(r"averaging step \d+ done")


async def run_once(spec: RunSpec, args, log_dir: Path, batches) -> Dict[str, Any]:
    """One live swarm from bootstrap to figures; every process it started is stopped before it returns."""
    run_id = f"atk_{spec.label}_{uuid.uuid4().hex[:6]}"
    model = [*TINY_MODEL, "--lr", str(args.lr), *([] if spec.alignment else ["--alignment_rounds", "0"])]
    swarm = AttackSwarm(
        log_dir, run_id,
        run_args=["--num_stages", str(NUM_STAGES), "--seed", str(args.seed), "--target_batch_size",
                  str(args.target_batch_size), "--defences", "true" if spec.defences else "false", *model],
        peer_args=FAST_PEER,
        trainer_args=["--max_data_mb", str(MAX_DATA_MB), "--refresh_period_s", "0.5", "--log_period_s", "1",
                      "--batch_size", str(args.batch_size), "--max_in_flight", str(args.max_in_flight),
                      "--duration_s", str(args.duration_s),
                      *(["--max_samples", str(args.samples_per_trainer)] if args.samples_per_trainer else [])],
        num_stages=NUM_STAGES)
    run = Run(spec, swarm)
    started = time.monotonic()
    try:
        log(f"[{spec.label}] starting (run {run_id})")
        await asyncio.to_thread(swarm.bootstrap, 60.0)
        await start_peers(run, args)
        await start_trainers(run, args)
        limit = f"{args.samples_per_trainer} samples each" if args.samples_per_trainer else f"{args.duration_s:.0f}s"
        log(f"[{spec.label}] {len(run.trainers)} trainers ready after {time.monotonic() - started:.0f}s; "
            f"training for {limit}")
        result = await train_and_measure(run, args, batches)
    except (TimeoutError, asyncio.TimeoutError, RuntimeError, OSError) as e:
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        log(f"[{spec.label}] FAILED: {type(e).__name__}: {message}")
        result = {"label": spec.label, "defences": spec.defences, "error": f"{type(e).__name__}: {message}"}
    finally:
        await asyncio.to_thread(swarm.close, STOP_TIMEOUT_S)
    if run.errors:
        result["errors"] = run.errors
    result["wall_s"] = round(time.monotonic() - started, 1)
    log(f"[{spec.label}] loss {_fmt(result.get('loss'))} held-out {_fmt(result.get('heldout_loss'))} "
        f"steps {result.get('global_steps')} lost {result.get('samples_lost')} "
        f"excluded after {_fmt(result.get('attacker_excluded_after_s'), 2)} s ({result['wall_s']}s wall)")
    return result


# ---- combining the runs ----

def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if math.isfinite(value) else "nan"
    return str(value)


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)) or b == 0:
        return None
    return round(a / b, 3)


def _diverged(run: Optional[Dict[str, Any]], initial: float) -> Optional[bool]:
    """Not finite, or no better than the initialisation on held-out data; None when the run gave no loss."""
    if run is None or (run.get("heldout_loss") is None and run.get("loss") is None):
        return None
    heldout, loss = run.get("heldout_loss"), run.get("loss")
    return bool((heldout is not None and not (math.isfinite(heldout) and heldout < initial))
                or (loss is not None and not math.isfinite(loss)))


def _progress_lost(heldout: Optional[float], clean: Optional[float], initial: float) -> Optional[float]:
    """The share of the clean run's held-out improvement over the initialisation that a run did not make:
    0 = as good as clean, 1 = no better than the initialisation, above 1 = worse (1 if not finite)."""
    if heldout is None or clean is None or not math.isfinite(clean) or initial - clean <= 0:
        return None
    return 1.0 if not math.isfinite(heldout) else round((heldout - clean) / (initial - clean), 3)


def replicas_of(attack: Attack, args) -> int:
    """Replicas of the attacked stage in the attack's runs and in the clean runs it is compared with."""
    return attack.replicas or args.attacked_replicas


def shape(attack: Attack, args) -> str:
    other = 1 - attack.stage
    attacker = "no faulty replica" if attack.by_trainer else f"{attack.attackers} attacker{'s' * (attack.attackers > 1)}"
    if attack.late_joiner:
        attacker += ", 1 joining at 1/3"
    trainers = "trainer1 attacker" if attack.by_trainer else "2 honest trainers"
    return (f"stage {attack.stage} x{replicas_of(attack, args)} ({attacker}), stage {other} x{args.other_replicas}, "
            f"{trainers}")


def median_throughput(runs: List[Dict[str, Any]]) -> Optional[float]:
    """The median of the runs' throughputs (the upper one of an even count); None if no run measured one."""
    return median_of(runs, "throughput_samples_per_s")


def median_of(runs: List[Dict[str, Any]], key: str) -> Optional[float]:
    """The median of the runs' ``key`` (the upper one of an even count); None if no run measured it."""
    values = sorted(r[key] for r in runs if r.get(key) is not None)
    return values[len(values) // 2] if values else None


def median_run(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The run of median held-out loss (the upper one of an even count; a run without a finite one counts as
    worst): the clean reference, so that one unlucky or lucky clean run does not set the bar."""
    def key(run: Dict[str, Any]) -> float:
        value = run.get("heldout_loss")
        return value if value is not None and math.isfinite(value) else math.inf
    return sorted(runs, key=key)[len(runs) // 2] if runs else {}


def combine(attack: Attack, args, clean: Dict[str, List[Dict[str, Any]]], on: Dict[str, Any],
            off: Optional[Dict[str, Any]], initial: float) -> Dict[str, Any]:
    """One attack's row: its defended and undefended runs beside the clean runs of its swarm shape (by mode:
    "on", "off", "on_noalign")."""
    runs_on, runs_off, runs_noalign = clean["on"], clean.get("off") or [], clean.get("on_noalign") or []
    clean_on, clean_off, off_ = median_run(runs_on), median_run(runs_off), off or {}
    throughput_on, throughput_off = median_throughput(runs_on), median_throughput(runs_off)
    return {
        "attack": attack.name, "shape": shape(attack, args),
        "loss_clean": clean_on.get("loss"), "loss_defended": on.get("loss"), "loss_undefended": off_.get("loss"),
        "loss_clean_undefended": clean_off.get("loss"),
        "loss_ratio_defended_vs_clean": _ratio(on.get("loss"), clean_on.get("loss")),
        "heldout_loss_initial": initial, "heldout_loss_clean": clean_on.get("heldout_loss"),
        "heldout_loss_defended": on.get("heldout_loss"), "heldout_loss_undefended": off_.get("heldout_loss"),
        "attacker_excluded_after_s": on.get("attacker_excluded_after_s"),
        "attacker_excluded_after_online_s": on.get("attacker_excluded_after_online_s"),
        "attacker_excluded_after_s_undefended": off_.get("attacker_excluded_after_s"),
        "attacker_first_warning_after_s": on.get("attacker_first_warning_after_s"),
        "samples_lost": on.get("samples_lost"), "samples_lost_undefended": off_.get("samples_lost"),
        "samples_lost_clean": clean_on.get("samples_lost"),
        "honest_states_defended": on.get("honest_states_at_end"), "honest_states_clean": clean_on.get("honest_states_at_end"),
        "rounds_sat_out_defended": on.get("rounds_sat_out"), "rounds_sat_out_clean": clean_on.get("rounds_sat_out"),
        "honest_excluded_defended": on.get("honest_excluded"),
        "honest_excluded_clean": sorted({e for r in runs_on + runs_noalign for e in r.get("honest_excluded") or []}),
        "samples_sent_by_attacker": on.get("samples_sent_by_attacker"),
        "throughput_ratio_defended_vs_clean": _ratio(on.get("throughput_samples_per_s"), throughput_on),
        "clean_throughput_ratio_on_vs_off": _ratio(throughput_on, throughput_off),
        "clean_throughput_ratio_alignment_on_vs_off": _ratio(throughput_on, median_throughput(runs_noalign)),
        "clean_peer_cpu_ratio_alignment_off_vs_on": _ratio(median_of(runs_noalign, "peer_cpu_ms_per_sample"),
                                                           median_of(runs_on, "peer_cpu_ms_per_sample")),
        "clean_peer_cpu_ratio_off_vs_on": _ratio(median_of(runs_off, "peer_cpu_ms_per_sample"),
                                                 median_of(runs_on, "peer_cpu_ms_per_sample")),
        "clean_peer_cpu_ms_per_sample": {"on": [r.get("peer_cpu_ms_per_sample_by_kind") for r in runs_on],
                                         "off": [r.get("peer_cpu_ms_per_sample_by_kind") for r in runs_off]},
        "clean_heldout_losses": {"on": [r.get("heldout_loss") for r in runs_on],
                                 "off": [r.get("heldout_loss") for r in runs_off]},
        "clean_throughputs": {"on": [r.get("throughput_samples_per_s") for r in runs_on],
                              "off": [r.get("throughput_samples_per_s") for r in runs_off],
                              "on_noalign": [r.get("throughput_samples_per_s") for r in runs_noalign]},
        "undefended_diverged": _diverged(off, initial),
        "undefended_progress_lost": _progress_lost(off_.get("heldout_loss"), clean_on.get("heldout_loss"), initial),
        "loss_first_undefended": off_.get("loss_first"), "loss_peak_undefended": off_.get("loss_peak"),
        "global_steps_undefended": off_.get("global_steps"), "attacker_rounds_undefended": off_.get("attacker_rounds"),
        "runs": {"defended": on, "undefended": off},
    }


def _json_safe(value: Any) -> Any:
    """JSON has no NaN or infinity: such floats become null (``*_diverged`` says why a loss is missing)."""
    if isinstance(value, float):
        return round(value, 4) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


TABLE = (("attack", "attack", 22), ("loss clean", "loss_clean", 10), ("loss def", "loss_defended", 9),
         ("loss undef", "loss_undefended", 10), ("held-out clean", "heldout_loss_clean", 14),
         ("held-out def", "heldout_loss_defended", 12), ("held-out undef", "heldout_loss_undefended", 14),
         ("excluded s", "attacker_excluded_after_s", 10), ("warned s", "attacker_first_warning_after_s", 8),
         ("lost", "samples_lost", 6),
         ("states", "honest_states_defended", 6),
         ("thr ratio", "throughput_ratio_defended_vs_clean", 9), ("undef diverged", "undefended_diverged", 14))


def print_table(rows: List[Dict[str, Any]]) -> None:
    print("  ".join(title.rjust(width) for title, _, width in TABLE), flush=True)
    for row in rows:
        print("  ".join(_fmt(row.get(key)).rjust(width) for _, key, width in TABLE), flush=True)


def summary(clean: Dict[Tuple[int, int, str], List[Dict[str, Any]]]) -> str:
    parts = []
    for stage, replicas in sorted({(s, r) for s, r, _ in clean}):
        by_mode = {mode: runs for (s, r, mode), runs in clean.items() if (s, r) == (stage, replicas)}
        on, off = median_throughput(by_mode["on"]), median_throughput(by_mode.get("off") or [])
        runs = "; ".join(f"{mode} " + ", ".join(_fmt(r.get("throughput_samples_per_s"), 1) for r in runs)
                         for mode, runs in by_mode.items())
        cpu = {mode: median_of(runs, "peer_cpu_ms_per_sample") for mode, runs in by_mode.items()}
        parts.append(f"stage-{stage} x{replicas} shape: median defences on {_fmt(on, 1)} / off {_fmt(off, 1)} samples/s "
                     f"= {_fmt(_ratio(on, off))} (runs: {runs}); peers' CPU ms per sample "
                     + ", ".join(f"{mode} {_fmt(value, 1)}" for mode, value in cpu.items()))
    return "clean throughput of trainer0, defended/undefended: " + "; ".join(parts)


async def main(args) -> List[Dict[str, Any]]:
    log_dir = make_log_dir(args.log_dir, "bench_attacks_")
    attacks = [ATTACKS[name] for name in args.attacks.split(",")]
    model = tiny_model_config()
    batches = heldout_batches(model, MAX_DATA_MB)
    initial = initial_loss(model, NUM_STAGES, args.seed, batches)
    modes = (True,) if args.skip_undefended else (True, False)
    limit = (f"{args.samples_per_trainer} samples per trainer (at most {args.duration_s:.0f}s)" if args.samples_per_trainer
             else f"{args.duration_s:.0f}s")
    log(f"{len(attacks)} attacks, defences {'on' if args.skip_undefended else 'on and off'}, {limit} "
        f"each; held-out loss of the initialisation {initial:.4f}; logs in {log_dir}")
    clean: Dict[Tuple[int, int, str], List[Dict[str, Any]]] = {}
    for stage, replicas in sorted({(a.stage, replicas_of(a, args)) for a in attacks}):
        specs = [RunSpec(stage, replicas, defences) for defences in modes]
        if args.clean_without_alignment:
            specs.append(RunSpec(stage, replicas, True, alignment=False))
        for _ in range(args.clean_repeats):  # the modes take turns, so a slow spell of the machine hits all
            for spec in specs:
                clean.setdefault((stage, replicas, spec.mode), []).append(await run_once(spec, args, log_dir, batches))
    rows = []
    for attack in attacks:
        replicas = replicas_of(attack, args)
        on = await run_once(RunSpec(attack.stage, replicas, True, attack), args, log_dir, batches)
        off = (None if args.skip_undefended
               else await run_once(RunSpec(attack.stage, replicas, False, attack), args, log_dir, batches))
        shape_runs = {mode: runs for (s, r, mode), runs in clean.items() if (s, r) == (attack.stage, replicas)}
        rows.append(combine(attack, args, shape_runs, on, off, initial))
    print_table(rows)
    print(summary(clean), flush=True)
    result = [_json_safe({**row, "log_dir": str(log_dir)}) for row in rows]
    record(args, result, [run for runs in clean.values() for run in runs]
           + [run for row in rows for run in row["runs"].values() if run is not None])
    return result


RAW_FIGURES = ("heldout_loss", "loss", "throughput_samples_per_s", "peer_cpu_ms_per_sample", "samples_lost",
               "attacker_excluded_after_s", "attacker_first_warning_after_s")


def record(args, rows: List[Dict[str, Any]], runs: List[Dict[str, Any]]) -> None:
    """The run's record: every run's figures by its label (clean runs repeat; attack runs are one each)."""
    raw: Dict[str, List[Any]] = {}
    for run in runs:
        for key in RAW_FIGURES:
            if key.startswith("attacker_") and key not in run:
                continue  # a clean run has no attacker to time
            value = run.get(key)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            raw.setdefault(f"{key}[{run['label']}]", []).append(value if number else None)
    headline = [{"attack": r["attack"], "heldout_clean": r["heldout_loss_clean"],
                 "heldout_defended": r["heldout_loss_defended"], "heldout_undefended": r["heldout_loss_undefended"],
                 "excluded_after_s": r["attacker_excluded_after_s"],
                 "first_warning_after_s": r["attacker_first_warning_after_s"],
                 "throughput_defended_vs_clean": r["throughput_ratio_defended_vs_clean"],
                 "undefended_diverged": r["undefended_diverged"]} for r in rows]
    write_record("attacks", args, rows, raw=raw, headline=headline, notes=[
        "One live swarm per run; clean runs (no attacker) repeat --clean_repeats times per swarm shape and defence "
        "setting, taking turns; the headline's clean figures are the clean run of median held-out loss.",
        "excluded_after_s counts only a ban or a refusal of the attacker in an honest role's log (a trainer banning "
        "it, replicas excluding it from averaging, its state, calls or DHT traffic refused, its micro-batches "
        "weighted 0); first_warning_after_s is the first warning naming it at all. '-' = never.",
        "Raw values are keyed <figure>[<run label>]: clean_s<stage>x<replicas>_on/off/on_noalign or <attack>_on/off."])


if __name__ == "__main__":
    install_signal_handlers()
    print(json.dumps(asyncio.run(main(parse_args()))), flush=True)
