"""The container recipe is consistent with the code it runs: docker/compose.yaml names every role, each
service's command is accepted by that role's own parser, and the image, build, network and bootstrap
address references agree with each other. No Docker engine is needed (``benchmarks/containers.py``
builds and runs it); the last test validates the files with a Compose implementation when one is installed."""

from __future__ import annotations

import ipaddress
import re
import shlex
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import yaml

from peers.cli import SUBCOMMANDS
from peers.dashboard import DashboardConfig
from swarm.config.settings import BootstrapConfig, PeerConfig, TrainerConfig
from swarm.config.loading import ConfigError, config_from_dict, parse_role_args
from swarm.dht.identity import load_or_create_identity
from swarm.net.addresses import announceable, listens_on_any
from tests.utils.benchmark_modules import load_benchmark
from tests.utils.processes import REPO

DOCKER = Path(REPO) / "docker"
COMPOSE = DOCKER / "compose.yaml"
COMPOSE_GPU = DOCKER / "compose.gpu.yaml"
ROLE_CONFIGS = {"bootstrap": BootstrapConfig, "peer": PeerConfig, "train": TrainerConfig, "dashboard": DashboardConfig}


def _load(path: Path) -> Dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict) and isinstance(data.get("services"), dict), f"{path} has no services"
    return data


def _argv(service: Dict[str, Any]) -> List[str]:
    command = service.get("command")
    return shlex.split(command) if isinstance(command, str) else list(command or [])


def _role_config(argv: List[str]) -> Any:
    """The config the role's own parser builds from ``argv`` (``swarm ROLE ...`` without ``swarm``), or an
    assertion error with the parser's reason; nothing is started."""
    role, rest = argv[0], argv[1:]
    assert role in SUBCOMMANDS, f"{role!r} is not a swarm command"
    try:
        args = parse_role_args(ROLE_CONFIGS[role], rest, f"swarm {role}", "")
        return config_from_dict(ROLE_CONFIGS[role], args.settings)
    except SystemExit as e:  # argparse reports the reason on stderr
        raise AssertionError(f"swarm {role} refuses {rest}: exit {e.code}") from None
    except ConfigError as e:
        raise AssertionError(f"swarm {role} refuses {rest}: {e}") from None


def _configs(services: Dict[str, Any]) -> Dict[str, Any]:
    return {name: _role_config(_argv(s)) for name, s in services.items() if _argv(s)[0] in ROLE_CONFIGS}


def _bootstrap_address(services: Dict[str, Any]) -> str:
    """The multiaddr every other role must list: the bootstrap's fixed address and its key's peer id."""
    name, boot = next((n, s) for n, s in services.items() if _argv(s)[0] == "bootstrap")
    config = _role_config(_argv(boot))
    ip = boot["networks"]["swarm"]["ipv4_address"]
    port = re.fullmatch(r"/ip4/0\.0\.0\.0/tcp/(\d+)", config.network.host_maddrs[0]).group(1)
    key = next(v.split(":")[0] for v in boot["volumes"] if v.split(":")[1] == config.network.identity_path)
    return f"/ip4/{ip}/tcp/{port}/p2p/{load_or_create_identity(str(DOCKER / key)).peer_id}"


@pytest.fixture(autouse=True)
def _in_image_workdir(monkeypatch):
    # the image copies examples/ into its working directory, as they are at the repository's root
    monkeypatch.chdir(REPO)


def test_compose_names_every_role():
    services = _load(COMPOSE)["services"]
    roles = Counter(_argv(s)[0] for s in services.values())
    assert roles == Counter({"bootstrap": 1, "peer": 4, "train": 1, "dashboard": 1})
    stages = Counter(config.stage for config in _configs(services).values() if isinstance(config, PeerConfig))
    assert stages == Counter({0: 2, 1: 2})
    # benchmarks/containers.py reads these two services by name
    assert _argv(services["trainer"])[0] == "train" and _argv(services["dashboard"])[0] == "dashboard"


def test_every_command_is_accepted_and_joins_the_same_run():
    services = _load(COMPOSE)["services"]
    configs = _configs(services)
    boot = next(c for c in configs.values() if isinstance(c, BootstrapConfig))
    runs = {name: c.run for name, c in configs.items() if hasattr(c, "run")}
    assert len(runs) == 5
    first = next(iter(runs.values()))
    assert all(run == first for run in runs.values()), "peers and trainer disagree on the run's settings"
    assert (boot.run_id, boot.num_stages) == (first.run_id, first.num_stages)
    assert all(config.device == "cpu" for config in configs.values() if isinstance(config, PeerConfig))
    # reachable from other containers: every role but the dashboard (a DHT reader) listens on all interfaces
    assert all(listens_on_any(c.network.host_maddrs) for c in configs.values() if not isinstance(c, DashboardConfig))


def test_every_role_joins_through_the_bootstrap_at_its_fixed_address():
    data = _load(COMPOSE)
    services = data["services"]
    address = _bootstrap_address(services)
    subnet = ipaddress.ip_network(data["networks"]["swarm"]["ipam"]["config"][0]["subnet"])
    assert ipaddress.ip_address(address.split("/")[2]) in subnet
    # a peer announces its address on this network: swarm/net/addresses.py must not take it for a local-only one
    assert announceable([f"/ip4/{next(subnet.hosts())}/tcp/31337"], listens_on_any=True)
    for name, service in services.items():
        argv = _argv(service)
        if argv[0] == "bootstrap":
            continue
        assert argv[argv.index("--initial_peers") + 1] == address, name
        assert service["depends_on"]["bootstrap"]["condition"] == "service_healthy", name
        assert service["networks"] == ["swarm"], name


def test_image_and_build_references_agree_with_the_dockerfile():
    services = _load(COMPOSE)["services"]
    assert {s["image"] for s in services.values()} == {"swarm:local"}
    built = [s["build"] for s in services.values() if "build" in s]
    assert len(built) == 1, "one service builds the image that every service runs"
    context = (DOCKER / built[0]["context"]).resolve()
    dockerfile = (context / built[0]["dockerfile"]).read_text()
    declared = dict(re.findall(r"^ARG (\w+)(?:=(\S*))?$", dockerfile, re.M))
    assert declared["BASE_IMAGE"] == "python:3.11-slim" and "FROM ${BASE_IMAGE}" in dockerfile
    assert set(built[0]["args"]) <= set(declared), f"build args the Dockerfile does not declare: {built[0]['args']}"
    assert built[0]["args"]["INSTALL_FROM"] in ("wheels", "index")
    for source in re.findall(r"^COPY (?!--from)(.+) \S+$", dockerfile, re.M):
        for path in source.split():
            assert (context / path).exists(), f"the Dockerfile copies {path}, which the build context lacks"
    assert "/docker/wheels/*" in (context / ".gitignore").read_text().splitlines()


def _merged(base: Dict[str, Any], override: Dict[str, Any]) -> Dict[str, Any]:
    """Compose's merge of an override file for mappings (lists and scalars replace)."""
    merged = dict(base)
    for key, value in override.items():
        merged[key] = _merged(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return merged


def test_gpu_variant_runs_every_peer_on_a_reserved_gpu():
    base, gpu = _load(COMPOSE)["services"], _load(COMPOSE_GPU)["services"]
    assert set(gpu) <= set(base)
    services = {name: _merged(base[name], gpu.get(name, {})) for name in base}
    for name, config in _configs(services).items():
        if isinstance(config, PeerConfig):
            assert config.device == "cuda:0", name
            devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
            assert devices[0]["capabilities"] == ["gpu"], name
    assert _configs(services)["trainer"].run == _configs(base)["trainer"].run
    args = next(s["build"]["args"] for s in services.values() if "build" in s)
    assert args["INSTALL_FROM"] == "index" and "cu" in args["TORCH_INDEX"]


def test_dashboard_serves_the_run_on_every_interface():
    services = _load(COMPOSE)["services"]
    config = _configs(services)["dashboard"]
    peer = next(c for c in _configs(services).values() if isinstance(c, PeerConfig))
    assert (config.run_id, config.num_stages) == (peer.run.run_id, peer.run.num_stages)
    # the published port reaches the page only if it listens beyond the container's loopback
    assert config.host == "0.0.0.0"
    assert any(p.endswith(f":{config.port}") for p in services["dashboard"]["ports"])


def _compose_command() -> Optional[List[str]]:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True,
                                                 timeout=30).returncode == 0:
        return ["docker", "compose"]
    return None


def test_a_compose_implementation_accepts_the_files():
    compose = _compose_command()
    if compose is None:
        pytest.skip("neither docker-compose nor the docker compose plugin is installed")
    for files in ([COMPOSE], [COMPOSE, COMPOSE_GPU]):
        argv = [*compose, *(a for f in files for a in ("-f", str(f))), "config", "-q"]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"{' '.join(argv)}: {result.stderr}"


def _benchmark_module():
    return load_benchmark("containers")


def test_benchmark_reads_the_loss_and_the_steps_from_the_logs():
    bench = _benchmark_module()
    trainer_log = ("trainer_1 | Nov 24 23:57:43.826 [INFO] samples        0  loss None      0.0 samples/s  failed 0\n"
                   "trainer_1 | Nov 24 23:57:48.903 [INFO] samples       56  loss 5.6120     24.6 samples/s  failed 0\n"
                   "trainer_1 | Nov 24 23:58:04.691 [INFO] samples      224  loss 5.2462     12.0 samples/s  failed 0\n")
    losses = bench.parse_losses(trainer_log)
    assert losses == [bench.LossPoint(56, 5.612), bench.LossPoint(224, 5.2462)]
    peer_log = "stage 1: global step 1 with 136 samples\nstage 0: global step 7 with 9 samples\nstage 1: global step 3 x\n"
    assert bench.last_global_step(peer_log, stage=1) == 3 and bench.last_global_step("", stage=1) == 0
    assert bench.verdict(losses, "not available")["ok"] and bench.verdict(losses, "ok")["ok"]
    assert not bench.verdict(losses, "failed: connection refused")["ok"]
    assert not bench.verdict(list(reversed(losses)), "ok")["loss_fell"]
    assert not bench.verdict(losses[:1], "ok")["ok"] and not bench.verdict([], "ok")["ok"]
