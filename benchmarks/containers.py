"""Containers benchmark: build the image, run docker/compose.yaml's swarm, check that it trains, tear it down.

Why: the image and the compose file are how most volunteers will run a peer; this script proves on a
Docker engine that they build and that the swarm they describe trains, and measures what that costs.

What runs:
  * the base image (``--base_image``, by default swarm-base from docker/build_base.sh, built here if it
    is missing) and, with ``--install_from wheels`` (the default), a wheel directory made on this machine
    (``pip wheel --wheel-dir docker/wheels . torch==2.13.0``), so no registry is needed in the build;
  * ``docker build`` of docker/Dockerfile into the image compose.yaml names (``--use_cache`` keeps the
    engine's layer cache; without it the build is measured from the base image up);
  * ``compose up`` of docker/compose.yaml as its own project: a bootstrap, 2 stages x 2 peers, a trainer
    and the dashboard, each in its own container on one bridge network; the trainer trains for
    ``--train_s`` seconds after its first loss;
  * the dashboard's page and ``/api/state`` fetched inside its container and through the published host port,
    when this tree has a ``swarm dashboard`` command ('dashboard: not available' otherwise);
  * every service's log is saved to ``--log_dir``, then ``compose down -v`` removes the containers, the
    network and the volumes, also on Ctrl-C, SIGTERM or an error; the images it built are removed unless
    ``--keep_images``.

Measured:
  wheels_s, base_build_s, build_s   seconds to make the wheels, the base image (null if it existed) and the image
  image_mb                          size of the image
  up_s                              seconds for ``compose up -d`` (the bootstrap's health check included)
  first_loss_s                      seconds from ``compose up`` to the first loss in the trainer's log (the
                                    trainer logs every 5 s and the log is read every 2 s)
  loss_start, loss_end              the first and the last loss the trainer logged; loss_fell = end < start
  samples, global_steps             samples the trainer sent; global steps stage 1's replicas logged
The last line is one JSON object; progress lines come before it. Exit status 0 when the loss fell and
the dashboard answered (or is not available in this tree), 1 otherwise, 2 when Docker cannot be used.

Needs a running Docker engine, root for debootstrap (only if the base image is missing) and a Compose
implementation (docker-compose or the docker compose plugin).

Usage: python benchmarks/containers.py [--train_s 90] [--use_cache] [--keep_images] [--install_from index]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _records import add_record_arguments, write_record  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DOCKER_DIR = REPO / "docker"
COMPOSE_FILE = DOCKER_DIR / "compose.yaml"
WHEELS_DIR = DOCKER_DIR / "wheels"
INSTALL_STAGE_LABEL = "org.swarm.stage=install"  # set by docker/Dockerfile on its install stage
DASHBOARD_CONTAINER_PORT = 8080
COMMAND_TIMEOUT_S = 120.0  # seconds for a docker command that builds nothing
BUILD_TIMEOUT_S = 1800.0  # seconds for building the wheels, the base image or the image
POLL_PERIOD_S = 2.0  # seconds between reads of the trainer's log

_LOSS_LINE = re.compile(r"samples\s+(\d+)\s+loss\s+(\d+(?:\.\d+)?)")
_GLOBAL_STEP = re.compile(r"stage (\d+): global step (\d+)")


def log(message: str) -> None:
    print(f"[containers] {message}", flush=True)


# ---- pure: what the logs say ----

@dataclass(frozen=True)
class LossPoint:
    samples: int  # samples the trainer had sent
    loss: float  # its recent training loss


def parse_losses(text: str) -> List[LossPoint]:
    """The trainer's progress lines that carry a loss (lines before its first loss say ``loss None``)."""
    return [LossPoint(int(m.group(1)), float(m.group(2))) for m in _LOSS_LINE.finditer(text)]


def last_global_step(text: str, stage: int) -> int:
    """The highest global step a stage's peers logged; 0 before the first one."""
    return max((int(m.group(2)) for m in _GLOBAL_STEP.finditer(text) if int(m.group(1)) == stage), default=0)


def verdict(losses: Sequence[LossPoint], dashboard: str) -> Dict[str, Any]:
    """The run's result: whether the loss fell from the first to the last report, and whether the dashboard
    answered (a tree without the dashboard passes with 'not available')."""
    fell = len(losses) >= 2 and losses[-1].loss < losses[0].loss
    return {"loss_start": losses[0].loss if losses else None, "loss_end": losses[-1].loss if losses else None,
            "samples": losses[-1].samples if losses else 0, "loss_fell": fell,
            "ok": fell and dashboard in ("ok", "not available")}


# ---- I/O: docker and compose ----

def run(argv: Sequence[str], timeout: float = COMMAND_TIMEOUT_S, check: bool = True, **kwargs: Any) -> subprocess.CompletedProcess:
    """One command with a timeout; its output is captured unless the caller redirects it."""
    kwargs.setdefault("capture_output", True)
    result = subprocess.run(list(argv), timeout=timeout, text=True, **kwargs)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {result.returncode}: {(result.stderr or '').strip()[-2000:]}")
    return result


def compose_command() -> List[str]:
    """docker-compose, else the docker compose plugin."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker") and run(["docker", "compose", "version"], check=False).returncode == 0:
        return ["docker", "compose"]
    raise RuntimeError("no Compose implementation: install docker-compose or the docker compose plugin")


def image_exists(name: str) -> bool:
    return run(["docker", "image", "inspect", name], check=False).returncode == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(what: str, argv: Sequence[str], log_file: Path, **kwargs: Any) -> float:
    """Run a build step with its output in ``log_file``; seconds it took."""
    log(f"{what} (log: {log_file})")
    started = time.monotonic()
    with open(log_file, "w") as out:
        result = run(argv, timeout=BUILD_TIMEOUT_S, check=False, capture_output=False, stdout=out,
                     stderr=subprocess.STDOUT, **kwargs)
    if result.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {result.returncode}); see {log_file}")
    return time.monotonic() - started


class ComposeSwarm:
    """The compose project this benchmark starts; :meth:`down` always leaves nothing of it running."""

    def __init__(self, project: str, env: Dict[str, str]):
        self.base = [*compose_command(), "-p", project, "-f", str(COMPOSE_FILE)]
        self.env = {**os.environ, **env}

    def __call__(self, *args: str, timeout: float = COMMAND_TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess:
        return run([*self.base, *args], timeout=timeout, check=check, env=self.env, cwd=REPO)

    def container(self, service: str) -> Optional[str]:
        ids = self("ps", "-q", service, check=False).stdout.split()
        return ids[0] if ids else None

    def logs(self, service: str) -> str:
        container = self.container(service)
        if container is None:
            return ""
        result = run(["docker", "logs", container], check=False)
        return result.stdout + result.stderr

    def save_logs(self, log_dir: Path) -> None:
        result = self("logs", "--no-color", timeout=COMMAND_TIMEOUT_S, check=False)
        (log_dir / "compose.log").write_text(result.stdout + result.stderr)

    def down(self) -> None:
        self("down", "-v", "--remove-orphans", "-t", "20", timeout=300.0, check=False)


def wait_for_losses(swarm: ComposeSwarm, started: float, timeout_s: float, train_s: float) -> tuple:
    """Poll the trainer's log: seconds to its first loss, and the losses after ``train_s`` more seconds."""
    first_loss_s, deadline = None, started + timeout_s
    while True:
        losses = parse_losses(swarm.logs("trainer"))
        now = time.monotonic()
        if losses and first_loss_s is None:
            first_loss_s = now - started
            log(f"first loss {losses[0].loss:.4f} after {first_loss_s:.1f} s; training {train_s:.0f} s more")
            deadline = now + train_s
        if now >= deadline:
            return first_loss_s, losses
        time.sleep(POLL_PERIOD_S)


def has_dashboard(image: str) -> bool:
    """Whether the image's ``swarm`` command has a ``dashboard`` subcommand."""
    probe = "from peers.cli import SUBCOMMANDS; print('dashboard' in SUBCOMMANDS)"
    result = run(["docker", "run", "--rm", "--entrypoint", "python3", image, "-c", probe], check=False)
    return result.stdout.strip() == "True"


def check_dashboard(swarm: ComposeSwarm, image: str, host_port: int) -> Dict[str, Any]:
    """Fetch / and /api/state inside the dashboard's container, and /api/state through the host's published port."""
    if not has_dashboard(image):
        return {"dashboard": "not available"}
    container = swarm.container("dashboard")
    if container is None:
        return {"dashboard": "failed: no dashboard container"}
    base = f"http://127.0.0.1:{DASHBOARD_CONTAINER_PORT}"
    probe = (f"import json, urllib.request; page = urllib.request.urlopen('{base}/', timeout=10).read(); "
             f"assert b'<html' in page.lower(), 'no page at /'; "
             f"print(','.join(sorted(json.load(urllib.request.urlopen('{base}/api/state', timeout=10)))))")
    inside = run(["docker", "exec", container, "python3", "-c", probe], check=False)
    result: Dict[str, Any] = {"dashboard": "ok", "dashboard_keys": inside.stdout.strip()}
    if inside.returncode != 0:
        reason = (inside.stderr.strip().splitlines() or [f"exit {inside.returncode}"])[-1]
        result = {"dashboard": f"failed: {reason}", "dashboard_keys": None}
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{host_port}/api/state", timeout=10) as response:
            json.load(response)
        result["dashboard_host_port"] = "ok"
    except (OSError, ValueError) as e:
        result["dashboard_host_port"] = f"failed: {e}"
    return result


def remove_images(names: Sequence[str]) -> None:
    for name in names:
        run(["docker", "rmi", name], check=False)
    stages = run(["docker", "images", "-q", "--filter", "dangling=true", "--filter", f"label={INSTALL_STAGE_LABEL}"],
                 check=False).stdout.split()
    if stages:
        run(["docker", "rmi", *stages], check=False)


def build(args: argparse.Namespace, image: str, log_dir: Path, made: List[str]) -> Dict[str, Any]:
    figures: Dict[str, Any] = {"wheels_s": None, "base_build_s": None}
    if args.install_from == "wheels":
        figures["wheels_s"] = round(timed("building wheels", [sys.executable, "-m", "pip", "wheel", "-q", "--wheel-dir",
                                                               str(WHEELS_DIR), ".", args.torch_spec],
                                          log_dir / "wheels.log", cwd=REPO), 1)
    if not image_exists(args.base_image):
        if args.base_image != "swarm-base":
            raise RuntimeError(f"the base image {args.base_image} does not exist")
        figures["base_build_s"] = round(timed("building the base image", [str(DOCKER_DIR / "build_base.sh")],
                                              log_dir / "base.log"), 1)
        made.append(args.base_image)
    argv = ["docker", "build", "-f", str(DOCKER_DIR / "Dockerfile"), "-t", image,
            "--build-arg", f"BASE_IMAGE={args.base_image}", "--build-arg", f"INSTALL_FROM={args.install_from}",
            *([] if args.use_cache else ["--no-cache"]), str(REPO)]
    made.append(image)
    figures["build_s"] = round(timed(f"building {image}", argv, log_dir / "build.log"), 1)
    size = run(["docker", "image", "inspect", image, "--format", "{{.Size}}"]).stdout.strip()
    figures["image_mb"] = round(int(size) / 2**20)
    return figures


def measure(args: argparse.Namespace, log_dir: Path) -> Dict[str, Any]:
    image = yaml.safe_load(COMPOSE_FILE.read_text())["services"]["bootstrap"]["image"]
    made: List[str] = []
    figures: Dict[str, Any] = {"image": image, "install_from": args.install_from, "base_image": args.base_image}
    port = args.dashboard_port or free_port()
    swarm = ComposeSwarm(args.project, {"SWARM_DASHBOARD_PORT": str(port)})
    try:
        figures.update(build(args, image, log_dir, made))
        log(f"built {image} ({figures['image_mb']} MB) in {figures['build_s']} s")
        started = time.monotonic()
        swarm("up", "-d", "--no-build", timeout=600.0)
        figures["up_s"] = round(time.monotonic() - started, 1)
        log(f"compose up took {figures['up_s']} s")
        first_loss_s, losses = wait_for_losses(swarm, started, args.startup_timeout_s, args.train_s)
        figures["first_loss_s"] = None if first_loss_s is None else round(first_loss_s, 1)
        figures.update(check_dashboard(swarm, image, port))
        figures["global_steps"] = last_global_step(swarm.logs("peer_s1_a") + swarm.logs("peer_s1_b"), stage=1)
        figures.update(verdict(losses, figures["dashboard"]))
        return figures
    finally:
        swarm.save_logs(log_dir)
        log(f"compose down (logs: {log_dir / 'compose.log'})")
        swarm.down()
        if not args.keep_images:
            remove_images(made)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train_s", type=float, default=90.0, help="seconds of training after the trainer's first loss")
    p.add_argument("--startup_timeout_s", type=float, default=300.0, help="seconds from compose up to the first loss")
    p.add_argument("--base_image", default="swarm-base", help="the image the Dockerfile builds on")
    p.add_argument("--install_from", choices=("wheels", "index"), default="wheels")
    p.add_argument("--torch_spec", default="torch==2.13.0", help="the torch requirement put in the wheel directory")
    p.add_argument("--use_cache", action="store_true", help="let docker build reuse cached layers")
    p.add_argument("--keep_images", action="store_true", help="keep the images this run built")
    p.add_argument("--project", default="swarm_bench", help="the compose project name (prefix of every container)")
    p.add_argument("--dashboard_port", type=int, default=0, help="host port for the dashboard; 0 = a free one")
    p.add_argument("--log_dir", type=Path, default=None, help="where to keep the logs; default a new temporary directory")
    add_record_arguments(p)
    return p.parse_args(argv)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_interrupt)  # the finally blocks tear the swarm down
    if run(["docker", "info"], check=False, timeout=30).returncode != 0:
        print("error: no Docker engine answers (start dockerd, see docker/README.md)", file=sys.stderr)
        return 2
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="swarm-containers-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log(f"logs in {log_dir}")
    try:
        figures = measure(args, log_dir)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"error: {e}", file=sys.stderr)
        failed = {"ok": False, "error": str(e)}
        write_record("containers", args, failed, raw={}, headline=failed, notes=["The run failed before its figures."])
        print(json.dumps(failed))
        return 1
    except KeyboardInterrupt:
        print(json.dumps({"ok": False, "error": "interrupted"}))
        return 130
    log(f"wheels {figures['wheels_s']} s, base {figures['base_build_s']} s, image build {figures['build_s']} s, "
        f"up {figures['up_s']} s, first loss after {figures['first_loss_s']} s")
    log(f"loss {figures['loss_start']} -> {figures['loss_end']} over {figures['samples']} samples, "
        f"{figures['global_steps']} global steps; dashboard: {figures['dashboard']}")
    write_record("containers", args, figures, raw={key: [figures.get(key)] for key in RECORD_FIGURES},
                 headline={key: figures.get(key) for key in ("ok", *RECORD_FIGURES, "loss_start", "loss_end",
                                                             "loss_fell", "dashboard")},
                 notes=["One build and one compose run: one value each, no spread. Build times depend on the engine's "
                        "layer cache (--use_cache) and the machine's load."])
    print(json.dumps(figures))
    return 0 if figures["ok"] else 1


RECORD_FIGURES = ("wheels_s", "base_build_s", "build_s", "image_mb", "up_s", "first_loss_s", "samples", "global_steps")


if __name__ == "__main__":
    sys.exit(main())
