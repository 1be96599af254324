"""``swarm dashboard``: a live web page of a run (stages, peers, trainers, loss and throughput charts, the
global-step timeline, and the command a volunteer pastes to join), served from this process.

The page polls ``/api/state`` (fields documented in :mod:`swarm.dashboard.state`); every asset ships in the
package, so it works offline. With ``--join ADDRESS`` the run's settings come from its organiser's manifest.
With ``--metrics_port PORT`` the same state is also served to Prometheus at ``http://metrics_host:PORT/metrics``
as ``swarm_dashboard_*`` families (:mod:`swarm.dashboard.metrics`); a port that cannot be listened on ends the
dashboard at once with exit code 2 and one line. Every ``--sample_period_s`` the page also shows text the run's
model writes from ``--sample_prompt`` (:mod:`swarm.dashboard.sample`: forwards only, which change nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence, Tuple

from peers._common import _add_join, _exit, emit, fail, fetch_manifest_or_exit, setup_logging, stop_event
from swarm.config.settings import NetworkConfig
from swarm.config.loading import ConfigError, config_from_dict, parse_role_args
from swarm.metrics import MetricsPortError, check_metrics_port
from swarm.dht.records import validate_run_id
from swarm.training.tokenizer import DEFAULT_CACHE_DIR

if TYPE_CHECKING:
    from swarm.dashboard.sample import SampleSettings


@dataclass
class DashboardConfig:
    """Which run to show, where to serve the page, and how often to read the DHT."""

    run_id: str = "swarm_demo"  # the run to show (with --join: taken from the run's manifest)
    num_stages: int = 2  # pipeline stages of that run (with --join: taken from the run's manifest)
    host: str = "127.0.0.1"  # address the page is served on; 0.0.0.0 serves it to other machines too
    port: int = 8080  # TCP port of the page; 0 = any free port (printed at start)
    period_s: float = 2.0  # seconds between reads of the DHT
    history_len: int = 1800  # points kept per chart (one per period_s: an hour at the default period)
    metrics_port: int = 0  # serve Prometheus metrics at http://metrics_host:PORT/metrics; 0 = off
    metrics_host: str = "127.0.0.1"  # address the metrics server listens on; 0.0.0.0 lets other machines scrape it
    sample_period_s: float = 180.0  # seconds between samples of text from the run's model (forwards only); 0 = off
    sample_prompt: str = "The"  # the text each sample continues
    sample_tokens: int = 48  # tokens each sample generates
    sample_timeout_s: float = 120.0  # seconds one whole sample may take before it is given up and shown as failed
    tokenizer: Optional[str] = field(
        default=None,
        metadata={
            "help": (
                "the run's tokenizer.json, for samples of a run with a tokenizer (its SHA-256 must equal "
                "run.tokenizer_sha256); None = the cached copy, fetched from the organiser when the run has a manifest"
            )
        },
    )
    tokenizer_cache_dir: str = DEFAULT_CACHE_DIR  # where tokenizers fetched from organisers are kept
    network: NetworkConfig = field(default_factory=NetworkConfig)

    def __post_init__(self) -> None:
        validate_run_id(self.run_id)
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be at least 1, got {self.num_stages}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if not self.period_s > 0:
            raise ValueError(f"period_s must be positive, got {self.period_s}")
        if self.history_len < 2:
            raise ValueError(f"history_len must be at least 2, got {self.history_len}")
        check_metrics_port(self.metrics_port)
        self.sample_settings()  # raises ValueError on a bad sample_* setting

    def sample_settings(self) -> "SampleSettings":
        """The :class:`~swarm.dashboard.sample.SampleSettings` of this config."""
        from swarm.dashboard.sample import SampleSettings

        return SampleSettings(
            period_s=self.sample_period_s,
            prompt=self.sample_prompt,
            num_tokens=self.sample_tokens,
            timeout_s=self.sample_timeout_s,
            tokenizer=self.tokenizer,
            tokenizer_cache_dir=self.tokenizer_cache_dir,
        )


def load_config(argv: Optional[Sequence[str]]) -> Tuple[DashboardConfig, Any, Optional[str]]:
    """The config, the run's verified manifest (or None) and the ``--join`` address (or None); exits with
    code 2 on a bad setting or one that contradicts the manifest, 1 when the manifest cannot be had."""
    role = parse_role_args(
        DashboardConfig, argv, "swarm dashboard", "Serve a live web page of a swarm training run.", add_extras=_add_join
    )
    settings, address = role.settings, role.extras.join
    manifest = None
    if address is not None:
        manifest = fetch_manifest_or_exit(address)
        run = manifest.run
        for name, value in (("run_id", run.run_id), ("num_stages", run.num_stages)):
            if name in settings and str(settings[name]) != str(value):
                _exit(2, f"{name}: the run's manifest says {value}, this dashboard has {settings[name]}")
        network = dict(settings.get("network") or {})
        given = network.get("initial_peers") or []
        given = [item for item in given.split(",") if item] if isinstance(given, str) else list(given)
        network["initial_peers"] = [address] + [peer for peer in given if peer != address]
        settings = {**settings, "run_id": run.run_id, "num_stages": run.num_stages, "network": network}
    try:
        config = config_from_dict(DashboardConfig, settings)
    except ConfigError as e:
        role.parser.error(f"invalid configuration: {e}")
    _check_tokenizer(config, manifest)
    return config, manifest, address


def _check_tokenizer(config: DashboardConfig, manifest: Any) -> None:
    """Exit with code 2 when ``--tokenizer`` names no file, or (the run being known from its manifest) not the
    run's tokenizer: a mistake to say at start, not in the sample panel minutes later."""
    from swarm.training.tokenizer import TokenizerError, load_run_tokenizer

    if config.tokenizer is None:
        return
    if not Path(config.tokenizer).expanduser().is_file():
        _exit(2, f"tokenizer: {config.tokenizer} is not a file")
    if manifest is None:
        return
    run = manifest.run
    if not run.tokenizer_sha256:
        _exit(2, f"tokenizer {config.tokenizer} is given, but the run uses byte tokens")
    try:
        load_run_tokenizer(config.tokenizer, run.tokenizer_sha256, run.model.vocab_size, config.tokenizer_cache_dir)
    except TokenizerError as e:
        _exit(2, str(e))


def _check_can_listen(host: str, port: int) -> None:
    """Raise ``OSError`` if ``host:port`` cannot be listened on now. The page's own socket is opened only
    after the DHT process forks, so that the DHT does not inherit it and hold the port after this process ends."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server binds
        probe.bind((host, port))


def _cannot_listen(config: DashboardConfig, error: OSError) -> int:
    return fail(
        f"cannot serve the dashboard on {config.host}:{config.port}: {error.strerror or error} "
        f"(pick another --port, or 0 for any free one)"
    )


def _cannot_serve_metrics(message: str) -> int:
    """A metrics port to change is a setting, as for ``swarm peer`` and ``swarm train``: exit code 2."""
    fail(f"{message} (choose another --metrics_port)")
    return 2


def _start_metrics(config: DashboardConfig, box: Any, dht: Any) -> Any:
    """The ``/metrics`` server of ``box``'s state, or None with ``metrics_port`` 0; raises MetricsPortError."""
    if not config.metrics_port:
        return None
    from swarm.dashboard.metrics import dashboard_registry
    from swarm.metrics import start_metrics_server

    registry = dashboard_registry(box, peer_id=str(dht.peer_id))
    return start_metrics_server(config.metrics_port, registry, config.metrics_host)


async def _poll_and_sample(
    config: DashboardConfig, dht: Any, join: Any, box: Any, history: Any, stop: asyncio.Event
) -> None:
    """Poll the DHT until ``stop`` is set, while a task of its own samples text from the run's model (a sample
    takes seconds: polls go on meanwhile)."""
    from swarm.dashboard.poller import DashboardPoller
    from swarm.dashboard.sample import DashboardSampler

    # each reads the other's latest only when called, after both exist
    sampler = DashboardSampler(
        config.sample_settings(),
        dht.replicate_p2p,
        lambda: poller.join,
        lambda: poller.snapshot.peers,
        on_sample=lambda sample: poller.publish(),
        check_period_s=config.period_s,
    )
    poller = DashboardPoller(dht, join, box, history, config.period_s, sample=lambda: sampler.latest)
    sampling = asyncio.create_task(sampler.run(stop), name="dashboard-sampler")
    try:
        await poller.run(stop)
    finally:
        sampling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampling


async def serve(config: DashboardConfig, manifest: Any = None, address: Optional[str] = None) -> int:
    from swarm.dashboard.history import History
    from swarm.dashboard.join import JoinInfo
    from swarm.dashboard.server import DashboardServer, StateBox
    from swarm.dashboard.state import Snapshot, build_state
    from swarm.dht.node import start_dht, start_run_dht, stop_dht

    stop = stop_event()
    history = History(config.history_len)
    join = JoinInfo(
        config.run_id,
        config.num_stages,
        tuple(config.network.initial_peers),
        manifest_address=address,
        run=None if manifest is None else manifest.run,
    )
    box = StateBox(build_state(Snapshot(fetched_at=time.time(), error="no DHT snapshot yet"), history, join, 0.0))
    try:
        _check_can_listen(config.host, config.port)  # fail in a second, not after starting the DHT
    except OSError as e:
        return _cannot_listen(config, e)
    try:
        _check_can_listen(config.metrics_host, config.metrics_port)
    except OSError as e:
        return _cannot_serve_metrics(
            f"cannot serve metrics on {config.metrics_host}:{config.metrics_port}: {e.strerror or e}"
        )
    if manifest is not None:  # a private run's nodes talk only to members: join as the manifest says
        dht = start_run_dht(config.network, manifest.run, client_mode=True)
    else:
        dht = start_dht(config.network, client_mode=True, run_id=config.run_id, num_stages=config.num_stages)
    server = metrics = None
    try:
        try:
            server = DashboardServer(box, config.host, config.port)
        except OSError as e:
            return _cannot_listen(config, e)
        try:
            metrics = _start_metrics(config, box, dht)
        except MetricsPortError as e:  # taken between the check above and now
            return _cannot_serve_metrics(str(e))
        server.start()
        emit("dashboard_ready", url=server.url, run_id=config.run_id, metrics=metrics.url if metrics else None)
        print(f"Dashboard of run {config.run_id!r}: {server.url}", flush=True)
        if metrics is not None:
            print(f"Prometheus metrics: {metrics.url}", flush=True)
        await _poll_and_sample(config, dht, join, box, history, stop)
        return 0
    finally:
        if metrics is not None:
            metrics.shutdown()
        if server is not None:
            server.shutdown()
        stop_dht(dht)


def main(argv: Optional[Sequence[str]] = None) -> int:
    config, manifest, address = load_config(argv)
    setup_logging()
    return asyncio.run(serve(config, manifest, address))
