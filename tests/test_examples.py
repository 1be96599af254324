"""The example configs join the run that ``make demo`` starts, as they are.

``make demo`` runs ``swarm demo --config examples/demo.yaml``; a newcomer who then starts
``swarm peer --config examples/peer.yaml`` or ``swarm train --config examples/trainer.yaml`` against
it must be accepted. A peer or trainer is accepted when its run settings equal those the run's peers
announce (their hash, :func:`swarm.dht.manifest.run_hash`, is what :mod:`swarm.dht.agreement`
compares), so every check here parses the files with the code the CLI runs
(:func:`swarm.config.loading.parse_role_config` for the demo, :func:`peers._common.load_role_config`
for the roles, :func:`peers.bootstrap.load_run_manifest` for the manifest) and compares the result with
the run of a peer exactly as the demo starts it. The last test does it live on loopback: the demo's
bootstrap, one peer started with the demo's own flags and one from ``examples/peer.yaml``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple, Type

import pytest
import yaml

from peers._common import load_role_config
from peers.bootstrap import load_run_manifest
from peers.demo import _run_flags
from swarm.config.loading import ConfigError, config_from_dict, parse_role_args, parse_role_config
from swarm.config.settings import BootstrapConfig, DemoConfig, PeerConfig, RunConfig, TrainerConfig
from swarm.dht.manifest import RunManifest, join_settings, run_differences, run_hash
from tests.utils.probe import Probe
from tests.utils.processes import REPO, Launcher

EXAMPLES = Path(REPO) / "examples"
DEMO_YAML = EXAMPLES / "demo.yaml"
PEER_YAML = EXAMPLES / "peer.yaml"
TRAINER_YAML = EXAMPLES / "trainer.yaml"
RUN_YAML = EXAMPLES / "run.yaml"
BOOTSTRAP_YAML = EXAMPLES / "bootstrap.yaml"
# any address ending in /p2p/<peer id>: join_settings only makes it the first initial peer
ORGANISER = "QmSvuZxUGTJaY4pLTeJtbwGMBYSRZATLroEYyM2ncc2aJx"
JOIN_ADDRESS = f"/ip4/127.0.0.1/tcp/31330/p2p/{ORGANISER}"


def demo_config() -> DemoConfig:
    return parse_role_config(DemoConfig, ["--config", str(DEMO_YAML)], "swarm demo", "")


def role_config(cls: Type[Any], argv: Sequence[str], prog: str) -> Any:
    """The config ``swarm ROLE argv`` would run with; an assertion error with the reason if the role refuses it."""
    try:
        config, manifest = load_role_config(cls, list(argv), prog, "")
    except SystemExit as e:  # argparse and the role print the reason on stderr
        raise AssertionError(f"{prog} {' '.join(argv)} refuses to start: exit {e.code}") from None
    assert manifest is None  # no --join: nothing was fetched
    return config


def demo_peer_run(demo: DemoConfig) -> RunConfig:
    """The run a stage peer of ``make demo`` serves: parsed from the flags the demo starts it with."""
    return role_config(PeerConfig, ["--stage", "0", *_run_flags(demo)], "swarm peer").run


def demo_trainer_run(demo: DemoConfig) -> RunConfig:
    return role_config(TrainerConfig, _run_flags(demo), "swarm train").run


def mismatch(expected: RunConfig, actual: RunConfig) -> List[Tuple[str, Any, Any]]:
    """Every run setting where ``actual`` departs from ``expected``; empty also means equal hashes."""
    differences = run_differences(expected, actual)
    assert (run_hash(expected) == run_hash(actual)) == (not differences), "run_hash disagrees with the fields"
    return differences


def test_the_demos_peers_serve_the_run_its_file_states():
    # otherwise the examples below would be compared with a run the demo does not start
    demo = demo_config()
    assert mismatch(demo.run, demo_peer_run(demo)) == []
    assert mismatch(demo.run, demo_trainer_run(demo)) == []


def test_a_peer_from_the_example_serves_the_demos_run():
    peer = role_config(PeerConfig, ["--config", str(PEER_YAML)], "swarm peer")
    assert mismatch(demo_peer_run(demo_config()), peer.run) == [], f"{PEER_YAML.name} would be refused by the demo"


def test_a_trainer_from_the_example_trains_on_the_demos_run():
    trainer = role_config(TrainerConfig, ["--config", str(TRAINER_YAML)], "swarm train")
    assert mismatch(demo_trainer_run(demo_config()), trainer.run) == [], \
        f"{TRAINER_YAML.name} would be refused by the demo"


def test_the_example_manifest_states_the_demos_run_and_the_examples_join_it():
    run = load_run_manifest(str(RUN_YAML))
    assert mismatch(demo_peer_run(demo_config()), run) == []
    manifest = RunManifest(run, organiser=ORGANISER, revision=1, issued_at=0.0)
    for cls, path, prog in ((PeerConfig, PEER_YAML, "swarm peer"), (TrainerConfig, TRAINER_YAML, "swarm train")):
        # what `swarm ROLE --config FILE --join ADDRESS` builds (peers._common.load_role_config): the file's own
        # run settings must agree with the manifest, or the role exits naming the first that does not
        explicit = parse_role_args(cls, ["--config", str(path)], prog, "").settings
        try:
            config = config_from_dict(cls, join_settings(explicit, manifest, JOIN_ADDRESS))
        except ConfigError as e:
            raise AssertionError(f"{prog} --config {path.name} --join ADDRESS refuses the manifest: {e}") from None
        assert config.network.initial_peers[0] == JOIN_ADDRESS and mismatch(run, config.run) == []


def test_the_example_bootstrap_enforces_the_demos_run():
    demo = demo_config()
    boot = parse_role_config(BootstrapConfig, ["--config", str(BOOTSTRAP_YAML)], "swarm bootstrap", "")
    assert (boot.run_id, boot.num_stages) == (demo.run.run_id, demo.run.num_stages)


@pytest.mark.parametrize("path, change", [
    (("target_batch_size",), 128),
    (("seed",), 1),
    (("model", "hidden_size"), 64),
    (("optimizer", "lr"), 0.001),
    (("compression",), "fp16"),
])
def test_an_example_that_drifts_from_the_demo_is_caught_naming_the_field(tmp_path, path, change):
    data = yaml.safe_load(PEER_YAML.read_text())
    node = data["run"]
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = change
    drifted = tmp_path / "peer.yaml"
    drifted.write_text(yaml.safe_dump(data))
    peer = role_config(PeerConfig, ["--config", str(drifted)], "swarm peer")
    differences = mismatch(demo_peer_run(demo_config()), peer.run)
    assert [name for name, _, _ in differences] == [".".join(path)]


def _same_run_online(records: Dict[str, Any], peer_ids: Sequence[str]) -> bool:
    mine = [r for r in records.values() if r.peer_id in peer_ids and r.state == "online"]
    return len(mine) == len(peer_ids) and len({r.run_hash for r in mine}) == 1


async def test_a_peer_from_the_example_is_accepted_by_a_live_demo_run(tmp_path):
    """The demo's bootstrap and one stage-0 peer, started with exactly the demo's flags, then a peer from
    ``examples/peer.yaml``: it must start (one whose settings differ from those the run's peers announce exits
    with code 2, naming the field) and announce, online, the same run settings as the demo's peer (a record
    with other settings is left out of every decision of the run).

    Only where the example peer listens (loopback, any port, instead of 0.0.0.0:31337) and where it
    checkpoints are overridden: neither is a run setting. The three roles and the probe take about 45 s of CPU
    in all (each imports torch and starts a DHT, mostly one after the other), which fits in about a minute on
    2 idle cores; on 2 cores shared with other test runs (load average 9-19) it took 115-150 s."""
    demo = demo_config()
    launcher = Launcher(tmp_path, run_id=demo.run.run_id)
    probe = None
    try:
        boot = launcher.start("bootstrap", ["--run_id", demo.run.run_id, "--num_stages", str(demo.run.num_stages)],
                              name="bootstrap")
        maddrs = boot.wait_event("bootstrap_ready", timeout=60)["maddrs"]
        initial = ["--initial_peers", ",".join(maddrs)]
        demo_peer = launcher.start("peer", ["--stage", "0", *_run_flags(demo), *initial], name="demo_peer")
        demo_id = demo_peer.wait_event("peer_ready", timeout=90)["peer_id"]
        # started once the demo's peer announces itself, so that its start-up check compares against it
        example = launcher.start("peer", ["--config", str(PEER_YAML), *initial, "--host_maddrs", "/ip4/127.0.0.1/tcp/0",
                                          "--checkpoint_dir", str(tmp_path / "checkpoints")], name="example_peer")
        probe = Probe(maddrs, demo.run.run_id, demo.run.num_stages)  # while the example peer starts
        try:
            example_id = example.wait_event("peer_ready", timeout=90)["peer_id"]
        except TimeoutError as e:
            raise AssertionError(f"the peer from {PEER_YAML.name} did not start: {e}") from None
        records = await probe.wait_for(lambda r: _same_run_online(r, [demo_id, example_id]), 30,
                                       "both peers online, announcing the same run settings")
        assert records[example_id].run_hash == run_hash(demo_peer_run(demo))
        assert example.proc.poll() is None and demo_peer.proc.poll() is None
    finally:
        if probe is not None:
            probe.shutdown()
        launcher.close()
