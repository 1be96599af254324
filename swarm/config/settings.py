"""Config dataclasses of the swarm's roles: the run they join, the network, a peer, a trainer.

One dataclass per role; the CLI maps each leaf field 1:1 onto a flag (see
:mod:`swarm.config.loading`), YAML files mirror the nesting. Comments after fields are their
help text and carry units. Defaults work on loopback.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import List, Optional, Union

from swarm.net.compression import CODECS, MAX_BLOCK_SIZE, MIN_BLOCK_SIZE, gradient_codec
from swarm.net.ternary import GRADIENT_CODECS
from swarm.model.devices import parse_device
from swarm.model.gpt import ModelConfig
from swarm.training.optimizer import OptimizerConfig
from swarm.training.tokenizer import DEFAULT_CACHE_DIR
from swarm.policy.aggregation import AggregationConfig
from swarm.policy.rebalance import RebalanceConfig
from swarm.dht.records import validate_run_id

__all__ = ["RunConfig", "NetworkConfig", "PeerConfig", "TrainerConfig", "BootstrapConfig"]


_BASE58_PEER_ID = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{32,128}$")
_TOKENIZER_SHA256 = re.compile(r"^([0-9a-f]{64})?$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {value!r}")


def _port(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ValueError(f"{name} must be an integer in 0..65535 (0 = off), got {value!r}")


@dataclass
class RunConfig:
    """What every peer and trainer of one training run must agree on."""

    run_id: str = "swarm_demo"  # names the run in the DHT; letters, digits, '_' and '-'
    num_stages: int = 2  # pipeline stages the model is cut into
    seed: int = 0  # replicas of stage k initialise from (seed, k)
    target_batch_size: int = 256  # samples per global step, summed over all trainers
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    allowlist: List[str] = field(default_factory=list)  # peer ids allowed in a private run; empty = anyone may join
    aggregation: AggregationConfig = field(
        default_factory=AggregationConfig, metadata={"help": "how replicas combine gradients (with defences on)"}
    )
    defences: bool = True  # Byzantine defences (robust averaging, state checks, per-micro-batch clipping, verification); off only to measure them
    compression: str = field(
        default="none",
        metadata={
            "help": (
                "how activations, their gradients and the stage all-reduce travel: none (exact), fp16, int8 or int4 "
                "(lossy: 2x, ~4x and ~7.5x fewer bytes; int4 sends gradients, and the all-reduce, in int8)"
            )
        },
    )
    compression_block_size: int = 256  # values per int8 or int4 block, each with its own scale (64-4096): smaller is more precise, larger sends fewer scales
    gradient_compression: str = field(
        default="",
        metadata={
            "help": (
                "how the stage all-reduce sends gradients: empty = as `compression` (int8 for int4); none, fp16, int8, "
                "or ternary "
                "(each value as 0 or ±the scale of its block of 64, values below 0.3 x its mean magnitude dropped: "
                "17x fewer bytes than float32; needs defences on)"
            )
        },
    )
    tokenizer_sha256: str = ""  # SHA-256 of the run's tokenizer.json (64 hex characters; `swarm tokenizer` prints it); "" = byte tokens (vocab_size 256)
    init_config_sha256: str = field(
        default="",
        metadata={
            "help": (
                "SHA-256 of the config.json of the checkpoint the run starts from (`swarm bootstrap --init_from` fills it "
                "in); empty = the seeded random initialisation"
            )
        },
    )
    init_stage_digests: List[str] = field(
        default_factory=list,
        metadata={
            "help": (
                "digest of each stage's tensors in that checkpoint, one per stage (filled in with init_config_sha256)"
            )
        },
    )

    def __post_init__(self) -> None:
        validate_run_id(self.run_id)
        self._check_tokenizer()
        self._check_initial_checkpoint()
        for index, peer_id in enumerate(self.allowlist):
            if not isinstance(peer_id, str) or not _BASE58_PEER_ID.match(peer_id):
                raise ValueError(
                    f"allowlist[{index}] must be a base58 peer id (like 12D3KooW... or Qm...), got {peer_id!r}"
                )
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"num_stages must be a positive integer, got {self.num_stages!r}")
        if self.num_stages > self.model.num_layers:
            raise ValueError(f"num_stages ({self.num_stages}) cannot exceed num_layers ({self.model.num_layers})")
        if self.model.tie_embeddings and self.num_stages > 1:
            raise ValueError(
                "model.tie_embeddings shares the embedding with the LM head, which live on the first and "
                f"last of {self.num_stages} stages (different peers): tie them only in a 1-stage run"
            )
        if self.model.boundary_dim and self.num_stages == 1:
            raise ValueError(
                "model.boundary_dim narrows the activations that travel between stages, and a 1-stage run has "
                "none: leave it 0"
            )
        if self.model.stage_layers and len(self.model.stage_layers) != self.num_stages:
            raise ValueError(
                f"stage_layers {self.model.stage_layers} must name one block count per stage ({self.num_stages} stages)"
            )
        if not isinstance(self.target_batch_size, int) or self.target_batch_size < 1:
            raise ValueError(f"target_batch_size must be a positive integer, got {self.target_batch_size!r}")
        self._check_compression()

    def _check_tokenizer(self) -> None:
        if not isinstance(self.tokenizer_sha256, str) or not _TOKENIZER_SHA256.match(self.tokenizer_sha256.lower()):
            raise ValueError(
                f"tokenizer_sha256 must be 64 hex characters (the SHA-256 of the tokenizer.json) or empty "
                f"for byte tokens, got {self.tokenizer_sha256!r}"
            )
        self.tokenizer_sha256 = self.tokenizer_sha256.lower()  # one spelling per hash: equal settings, equal run hash

    def _check_initial_checkpoint(self) -> None:
        if not isinstance(self.init_config_sha256, str) or not _TOKENIZER_SHA256.match(self.init_config_sha256.lower()):
            raise ValueError(f"init_config_sha256 must be 64 hex characters or empty, got {self.init_config_sha256!r}")
        self.init_config_sha256 = self.init_config_sha256.lower()
        digests = self.init_stage_digests
        if not isinstance(digests, list) or not all(isinstance(d, str) and _SHA256.match(d.lower()) for d in digests):
            raise ValueError(f"init_stage_digests must be a list of 64-hex-character digests, got {digests!r}")
        self.init_stage_digests = [d.lower() for d in digests]
        if bool(self.init_config_sha256) != bool(digests):
            raise ValueError(
                "init_config_sha256 and init_stage_digests come together (a run that starts from a "
                "checkpoint signs both) or not at all"
            )
        if digests and len(digests) != self.num_stages:
            raise ValueError(f"init_stage_digests names {len(digests)} stages, the run has {self.num_stages}")

    @property
    def starts_from_checkpoint(self) -> bool:
        """Whether the run's stages start from a signed checkpoint instead of their seeded initialisation."""
        return bool(self.init_stage_digests)

    def _check_compression(self) -> None:
        if self.compression not in CODECS:
            raise ValueError(f"compression must be one of {list(CODECS)}, got {self.compression!r}")
        block_size = self.compression_block_size
        if (
            isinstance(block_size, bool)
            or not isinstance(block_size, int)
            or not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE
        ):
            raise ValueError(
                f"compression_block_size must be an integer in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], got {block_size!r}"
            )
        if self.gradient_compression not in ("", *GRADIENT_CODECS):
            raise ValueError(
                f"gradient_compression must be empty (as compression) or one of {list(GRADIENT_CODECS)}, "
                f"got {self.gradient_compression!r}"
            )
        if self.gradient_codec == "ternary" and not self.defences:
            raise ValueError(
                "gradient_compression ternary needs defences on: only the robust all-reduce, in which every member "
                "decodes each gradient whole, carries ternary gradients (hivemind's butterfly sums their parts)"
            )

    @property
    def gradient_codec(self) -> str:
        """How the stage all-reduce sends gradients: ``gradient_compression``, or when empty what gradients travel in
        under ``compression`` (:func:`~swarm.net.compression.gradient_codec`: int8 under int4)."""
        return self.gradient_compression or gradient_codec(self.compression)


@dataclass
class NetworkConfig:
    """How a process joins the DHT."""

    initial_peers: List[str] = field(default_factory=list)  # multiaddrs of any live peers; empty = start a new swarm
    host_maddrs: List[str] = field(
        default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"],
        metadata={"help": "where to listen; use /ip4/0.0.0.0/tcp/PORT to be reachable"},
    )
    announce_maddrs: List[str] = field(default_factory=list)  # public addresses to announce, if behind NAT
    identity_path: Optional[str] = None  # private key file: a fixed peer id across restarts
    startup_timeout_s: float = 30.0  # seconds to wait for the DHT to start

    def __post_init__(self) -> None:
        _positive("startup_timeout_s", self.startup_timeout_s)
        if not self.host_maddrs:
            raise ValueError("host_maddrs must name at least one address to listen on")
        from swarm.net.listening import resolve_ports

        ports = iter(range(1, 65536))  # distinct stand-ins for the ports port-0 listeners will get
        resolve_ports(self.host_maddrs, self.announce_maddrs, lambda maddr: next(ports))  # ValueError if ambiguous


@dataclass
class PeerConfig:
    """A stage server: holds one stage, serves forward/backward, averages with its replicas."""

    stage: Union[int, str] = "auto"  # stage index to serve, or 'auto' for the stage that needs capacity most
    device: str = "cpu"  # torch device for the stage, e.g. cpu or cuda:0
    num_threads: int = 1  # torch intra-op threads for this peer
    delay_per_sample_s: float = field(
        default=0.0,
        metadata={
            "help": "emulate a slower device: sleep this long per sample of backward work (0 = off; costs no CPU)"
        },
    )
    announce_period_s: float = 60.0  # seconds between DHT announcements (stage-mates exchange progress directly)
    expiration_s: float = (
        180.0  # seconds a DHT record outlives its announcement (failed calls route around a dead peer sooner)
    )
    poll_period_s: float = (
        0.25  # seconds between progress calls to the stage-mates while the stage nears its global batch
    )
    matchmaking_time_s: float = 2.0  # seconds replicas wait to form an all-reduce group
    averaging_timeout_s: float = 30.0  # seconds one all-reduce round may take
    state_download_timeout_s: float = 60.0  # seconds to download a stage's state from a replica
    overlap_averaging: bool = False  # keep computing the next step's gradients while a step is averaged: faster, but those gradients are one step stale
    max_batch_samples: int = field(
        default=512,
        metadata={
            "help": "largest request (samples) this peer accepts, and the most samples merged into one module call"
        },
    )
    merge_backward: bool = field(
        default=False,
        metadata={
            "help": (
                "merge concurrent backward requests of one shape into one vectorised call, each micro-batch still "
                "clipped and accounted alone (costs more CPU than it saves on CPU; see swarm/server/batching.py)"
            )
        },
    )
    speed_test_samples: int = field(
        default=8,
        metadata={
            "help": (
                "made-up samples this peer times itself on when it starts (again when its speed figure goes stale, "
                "and every 30 s while it stands by), so that it announces a speed before trainers send it work; 0 = "
                "off: announce 0 until measured on served calls"
            )
        },
    )
    max_memory_gb: float = field(
        default=0.0,
        metadata={
            "help": (
                "GB (10^9 bytes) this peer may use for its stage, host and device together (see "
                "swarm.model.footprint.stage_memory); a stage that needs more is refused, and --stage auto picks only "
                "stages that fit; 0 = no limit (on CUDA the device's free memory still bounds the device's part)"
            )
        },
    )
    memory_batch_samples: int = field(
        default=8,
        metadata={"help": "samples per request the memory check assumes for activations (the trainers' batch_size)"},
    )
    checkpoint_activations: bool = False  # recompute each block's activations in backward instead of keeping them (less memory, about a third more compute)
    dtype: str = field(
        default="fp32",
        metadata={
            "help": (
                "compute dtype: fp32, bf16 (autocast; CPU or a GPU with bf16) or fp16 (CUDA autocast with dynamic "
                "loss scaling); weights, optimizer state and averaged gradients stay float32"
            )
        },
    )
    forward_cache_mb: float = field(
        default=512.0,
        metadata={
            "help": (
                "MiB of training forwards' autograd state kept so that their backward skips recomputing the forward "
                "(oldest dropped first; 0 = always recompute)"
            )
        },
    )
    max_message_mb: float = 64.0  # largest request this peer accepts (MiB)
    direct_port: int = field(
        default=0,
        metadata={
            "help": (
                "TCP port where callers that reach it send large requests around p2pd, sealed with a key they got "
                "through p2pd (0 = any free port; -1 = off: every call goes through p2pd)"
            )
        },
    )
    max_requests_per_caller: int = 64  # requests one caller may have in flight at this peer; more are answered 'busy'
    max_mb_per_caller: float = field(
        default=256.0,
        metadata={"help": "MiB of requests one caller may have in flight at this peer (at least max_message_mb)"},
    )
    leave_timeout_s: float = 10.0  # seconds a leaving peer waits for in-flight requests (SIGTERM)
    checkpoint_dir: Optional[str] = None  # where to checkpoint the stage's state; None = no checkpoints
    checkpoint_period_s: float = 30.0  # seconds between checkpoints
    reinitialize: bool = False  # start a stage from its initialisation although the run is past step 0 and no replica or checkpoint has it
    init_from: Optional[str] = field(
        default=None,
        metadata={
            "help": (
                "a local copy of the Hugging Face checkpoint the run starts from (its manifest signs it): a stage's first "
                "replica loads its tensors from there"
            )
        },
    )
    rebalance: bool = False  # move to the bottleneck stage when the policy says so
    rebalance_policy: RebalanceConfig = field(default_factory=RebalanceConfig)
    metrics_port: int = 0  # serve Prometheus metrics at http://metrics_host:PORT/metrics; 0 = off
    metrics_host: str = "127.0.0.1"  # address the metrics server listens on; 0.0.0.0 lets other machines scrape it
    log_period_s: float = 10.0  # seconds between progress lines (state, step, samples processed, throughput)
    run: RunConfig = field(default_factory=RunConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)

    def __post_init__(self) -> None:
        parse_device(self.device)
        if isinstance(self.stage, str) and self.stage != "auto":
            if not self.stage.isdigit():
                raise ValueError(f"stage must be an integer or 'auto', got {self.stage!r}")
            self.stage = int(self.stage)
        if isinstance(self.stage, int) and not 0 <= self.stage < self.run.num_stages:
            raise ValueError(
                f"stage must be in 0..{self.run.num_stages - 1} for a {self.run.num_stages}-stage run, got {self.stage}"
            )
        for name in (
            "announce_period_s",
            "poll_period_s",
            "matchmaking_time_s",
            "averaging_timeout_s",
            "state_download_timeout_s",
            "max_message_mb",
            "leave_timeout_s",
            "checkpoint_period_s",
            "log_period_s",
        ):
            _positive(name, getattr(self, name))
        _port("metrics_port", self.metrics_port)
        if (
            isinstance(self.direct_port, bool)
            or not isinstance(self.direct_port, int)
            or not -1 <= self.direct_port <= 65535
        ):
            raise ValueError(
                f"direct_port must be an integer in -1..65535 (0 = any free port, -1 = off), got {self.direct_port!r}"
            )
        if self.expiration_s < 2 * self.announce_period_s:
            raise ValueError(
                f"expiration_s ({self.expiration_s}) must be at least twice announce_period_s ({self.announce_period_s})"
            )
        if not self.delay_per_sample_s >= 0.0:
            raise ValueError(f"delay_per_sample_s must be >= 0, got {self.delay_per_sample_s!r}")
        if not 0.0 <= self.max_memory_gb < float("inf"):
            raise ValueError(f"max_memory_gb must be a finite number >= 0 (0 = no limit), got {self.max_memory_gb!r}")
        if (
            isinstance(self.memory_batch_samples, bool)
            or not isinstance(self.memory_batch_samples, int)
            or self.memory_batch_samples < 1
        ):
            raise ValueError(f"memory_batch_samples must be a positive int, got {self.memory_batch_samples!r}")
        if self.dtype not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"dtype must be fp32, bf16 or fp16, got {self.dtype!r}")
        if self.dtype == "fp16" and parse_device(self.device).type != "cuda":
            raise ValueError(
                f"dtype fp16 needs a CUDA device (its loss scaling is for CUDA autocast), got device "
                f"{self.device}; use bf16 or fp32"
            )
        if not 0.0 <= self.forward_cache_mb < float("inf"):
            raise ValueError(f"forward_cache_mb must be a finite number >= 0, got {self.forward_cache_mb!r}")
        if self.max_mb_per_caller < self.max_message_mb:
            raise ValueError(
                f"max_mb_per_caller ({self.max_mb_per_caller}) must be at least max_message_mb ({self.max_message_mb})"
            )
        if (
            isinstance(self.speed_test_samples, bool)
            or not isinstance(self.speed_test_samples, int)
            or self.speed_test_samples < 0
        ):
            raise ValueError(f"speed_test_samples must be an int >= 0, got {self.speed_test_samples!r}")
        if self.max_batch_samples < 1 or self.num_threads < 1 or self.max_requests_per_caller < 1:
            raise ValueError("max_batch_samples, num_threads and max_requests_per_caller must be at least 1")


@dataclass
class TrainerConfig:
    """A trainer: draws micro-batches and pushes them through the swarm."""

    batch_size: int = 8  # samples per micro-batch
    max_in_flight: int = 4  # micro-batches in the pipeline at once
    max_samples: Optional[int] = None  # stop after sending this many samples; None = no limit
    duration_s: Optional[float] = None  # stop after this many seconds; None = no limit
    trainer_seed: int = 1  # seeds which samples this trainer draws; give each trainer its own
    data: List[str] = field(default_factory=list)  # text/JSONL files or directories; empty = Python's stdlib sources
    hf_dataset: Optional[str] = None  # a Hugging Face dataset name or local file (needs the 'hf' extra)
    max_data_mb: Optional[float] = None  # read at most this much of the corpus (MiB)
    forward_timeout_s: float = 30.0  # seconds one forward call may take
    backward_timeout_s: float = 60.0  # seconds one backward call may take
    max_retries: int = 8  # attempts per stage call before the micro-batch fails
    refresh_period_s: float = 60.0  # seconds between DHT snapshots of the swarm (and at once after a failed call)
    # stages whose records one refresh reads: those where a call failed, then those read longest ago (every stage
    # is read within ceil(stages / this) refreshes; between reads, replies tell what the trainer routes by)
    stages_per_refresh: int = 8
    peer_grace_s: float = 5.0  # seconds a peer must be missing from the DHT before its unconfirmed work is re-sent
    log_period_s: float = 5.0  # seconds between progress lines
    max_uncommitted: int = 4096  # micro-batches kept for replay until their global step is confirmed
    metrics_port: int = 0  # serve Prometheus metrics at http://metrics_host:PORT/metrics; 0 = off
    metrics_host: str = "127.0.0.1"  # address the metrics server listens on; 0.0.0.0 lets other machines scrape it
    attack: str = field(
        default="none",
        metadata={
            "help": "emulate a poisoning trainer (tests and attack benchmarks): one of swarm.client.attacks.ATTACKS"
        },
    )
    verify_fraction: float = 0.02  # probability (0-1) per micro-batch and stage of re-checking that stage's reply on a second replica (with defences on)
    serve_dht: bool = False  # also answer other nodes' DHT requests (only if other machines can reach this trainer); by default a trainer is a DHT client
    slow_replica_tolerance: float = field(
        default=2.0,
        metadata={
            "help": (
                "route only to replicas whose expected completion time is within this multiple of the stage's best "
                "(>= 1); 0 = off, route by throughput alone"
            )
        },
    )
    tokenizer: Optional[str] = field(
        default=None,
        metadata={
            "help": (
                "the run's tokenizer.json (its SHA-256 must equal run.tokenizer_sha256); None = the cached copy, "
                "fetched from the organiser with --join"
            )
        },
    )
    tokenizer_cache_dir: str = field(
        default=DEFAULT_CACHE_DIR,
        metadata={"help": "where tokenizers fetched from organisers are kept, one file per SHA-256"},
    )
    run: RunConfig = field(default_factory=RunConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)

    def __post_init__(self) -> None:
        from swarm.client.attacks import ATTACKS

        if self.attack not in ATTACKS:
            raise ValueError(f"attack must be one of {list(ATTACKS)}, got {self.attack!r}")
        for name in ("batch_size", "max_in_flight", "max_retries", "max_uncommitted", "stages_per_refresh"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("forward_timeout_s", "backward_timeout_s", "refresh_period_s", "log_period_s", "peer_grace_s"):
            _positive(name, getattr(self, name))
        _port("metrics_port", self.metrics_port)
        if self.max_samples is not None and self.max_samples < 1:
            raise ValueError(f"max_samples must be positive or None, got {self.max_samples}")
        if not 0.0 <= self.verify_fraction <= 1.0:
            raise ValueError(f"verify_fraction must be in [0, 1], got {self.verify_fraction!r}")
        if not (self.slow_replica_tolerance == 0 or 1.0 <= self.slow_replica_tolerance < math.inf):
            raise ValueError(
                f"slow_replica_tolerance must be 0 (off) or a finite number >= 1, got {self.slow_replica_tolerance!r}"
            )
        if self.duration_s is not None:
            _positive("duration_s", self.duration_s)
        if self.tokenizer is not None and not self.run.tokenizer_sha256:
            raise ValueError(
                f"tokenizer {self.tokenizer} is given, but the run trains on byte tokens (tokenizer_sha256 "
                f"is empty): name the run's tokenizer with --tokenizer_sha256 (`swarm tokenizer` prints it)"
            )
        if not self.tokenizer_cache_dir:
            raise ValueError("tokenizer_cache_dir must name a directory")


@dataclass
class BootstrapConfig:
    """A DHT-only entry point that others list in their initial_peers."""

    maddrs_file: Optional[str] = None  # write this peer's multiaddrs here once it is up
    manifest: Optional[str] = None  # YAML file of the run's settings: sign it, publish it and serve it to joiners
    run_id: Optional[str] = field(
        default=None,
        metadata={
            "help": "without a manifest: enforce this run's record schema (None = store whatever is sent; readers drop it)"
        },
    )
    num_stages: int = 2  # stages of that run (with run_id)
    tokenizer: Optional[str] = field(
        default=None,
        metadata={
            "help": "with a manifest: the run's tokenizer.json, named in the manifest by its SHA-256 and served to joining trainers"
        },
    )
    init_from: Optional[str] = field(
        default=None,
        metadata={
            "help": (
                "with a manifest: a Hugging Face checkpoint directory (LlamaForCausalLM safetensors) the run starts from; "
                "the manifest signs its config and each stage's tensors; model settings it leaves out are the checkpoint's"
            )
        },
    )
    network: NetworkConfig = field(default_factory=NetworkConfig)

    def __post_init__(self) -> None:
        if self.run_id is not None:
            validate_run_id(self.run_id)
        if self.tokenizer is not None and self.manifest is None:
            raise ValueError(
                "tokenizer needs a manifest: only a run's organiser (--manifest run.yaml) serves its tokenizer"
            )
        if self.init_from is not None and self.manifest is None:
            raise ValueError(
                "init_from needs a manifest: only a run's organiser (--manifest run.yaml) signs the checkpoint "
                "a run starts from"
            )
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be at least 1, got {self.num_stages}")


@dataclass
class DemoConfig:
    """A whole swarm on 127.0.0.1: one bootstrap, peers_per_stage peers per stage, num_trainers trainers."""

    peers_per_stage: int = 2  # replicas of every stage
    num_trainers: int = 2  # trainer processes
    duration_s: float = 120.0  # seconds of training
    batch_size: int = 8  # samples per micro-batch
    max_in_flight: int = 4  # micro-batches in flight per trainer
    max_data_mb: Optional[float] = 8.0  # read at most this much of the corpus (MiB), for a quick start
    log_period_s: float = 5.0  # seconds between status lines
    announce_period_s: float = field(
        default=5.0,
        metadata={
            "help": (
                "the peers' announce period and the trainers' refresh period (s): short on one machine, where the "
                "status lines show what records say; a run across the internet keeps the defaults (30 s)"
            )
        },
    )
    work_dir: str = "runs/demo"  # each process writes its log here
    startup_timeout_s: float = 120.0  # seconds to wait for every process to come up
    dashboard_port: int = field(
        default=8080,
        metadata={
            "help": "TCP port of the run's live web page (swarm dashboard) on 127.0.0.1; 0 = any free port, -1 = none"
        },
    )
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        if not -1 <= self.dashboard_port <= 65535:
            raise ValueError(f"dashboard_port must be in -1..65535, got {self.dashboard_port}")
        for name in ("peers_per_stage", "num_trainers", "batch_size", "max_in_flight"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("duration_s", "log_period_s", "startup_timeout_s", "announce_period_s"):
            _positive(name, getattr(self, name))
