"""The organiser's signed statement of a run's settings, and how joiners fetch and check it.

A run is defined by its :class:`~swarm.config.settings.RunConfig`. The organiser signs those settings
with the RSA key that is also its libp2p identity, so a volunteer who knows only the
organiser's address (which ends in ``/p2p/<peer id>``) can check that the settings it received
come from that peer and nobody else: the signer's public key must hash to that peer id.

The signed manifest reaches joiners two ways: the organiser serves it as the ``manifest`` RPC
(one call, before the joiner has a DHT of its own), and stores it in the run's DHT under its
owner subkey (hivemind's ``RSASignatureValidator`` lets only the key's holder write there).
Both paths end in :func:`verify_manifest`. The payload is canonical JSON (sorted keys, no
spaces), so a signature covers exactly one byte string per set of settings.

A run with a tokenizer names it in the manifest by the SHA-256 of its file; the organiser serves the
file's bytes as the ``tokenizer`` RPC, and :func:`fetch_tokenizer_from` refuses any other bytes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPublicKey

from swarm import PROTOCOL_VERSION
from swarm.config.settings import RunConfig
from swarm.config.loading import ConfigError, config_from_dict
from swarm.dht.identity import Identity, owner_subkey, peer_id_of
from swarm.dht.records import MAX_MANIFEST_PAYLOAD_BYTES, manifest_key
from swarm.net.addresses import address_peer_id
from swarm.net.rpc import Handler, call_peer
from swarm.training.tokenizer import MAX_TOKENIZER_BYTES, check_sha256, sha256_of_bytes

__all__ = [
    "ManifestError",
    "RunManifest",
    "SignedManifest",
    "sign_manifest",
    "verify_manifest",
    "run_hash",
    "run_settings",
    "run_differences",
    "check_against_manifest",
    "join_settings",
    "publish_manifest",
    "fetch_manifest",
    "manifest_handler",
    "fetch_manifest_from",
    "peer_id_in_address",
    "MANIFEST_METHOD",
    "TOKENIZER_METHOD",
    "tokenizer_handler",
    "fetch_tokenizer_from",
]

MANIFEST_METHOD = "manifest"  # the organiser's RPC method that replies with the signed manifest
TOKENIZER_METHOD = "tokenizer"  # the organiser's RPC method that replies with the bytes of the run's tokenizer.json
TOKENIZER_REPLY_ENVELOPE_BYTES = 4096  # what the tokenizer reply adds to the file's bytes (keys, the hash, framing)
# run settings left out of the settings while they hold their default: a run that does not use them keeps
# the settings, and so the hash and manifest, it had before they existed
_OMITTED_AT_DEFAULT: Dict[str, Any] = {"tokenizer_sha256": "", "init_config_sha256": "", "init_stage_digests": []}
# model settings left out at their defaults: a byte-level GPT run hashes as it did before they existed
_MODEL_OMITTED_AT_DEFAULT = {
    "architecture": "gpt",
    "num_kv_heads": 0,
    "intermediate_size": 0,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_embeddings": False,
    "boundary_dim": 0,
}


class ManifestError(ValueError):
    """A manifest that cannot be trusted or used; the message says why."""


@dataclass(frozen=True)
class RunManifest:
    """What the organiser states about a run: its settings, who states them, and when."""

    run: RunConfig
    organiser: str  # peer id of the organiser, whose key signs the manifest
    revision: int  # grows each time the organiser issues new settings
    issued_at: float  # seconds since the epoch when the organiser signed it
    protocol_version: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class SignedManifest:
    """A manifest as it travels: the canonical payload, its signature and the signer's public key
    (hivemind's ``RSAPublicKey.to_bytes()``)."""

    payload: bytes
    signature: bytes
    public_key: bytes

    def to_dict(self) -> Dict[str, bytes]:
        return {"payload": self.payload, "signature": self.signature, "public_key": self.public_key}

    @classmethod
    def from_dict(cls, value: Any) -> "SignedManifest":
        if not isinstance(value, Mapping):
            raise ManifestError(f"a signed manifest must be a mapping, got {type(value).__name__}")
        fields = {}
        for name in ("payload", "signature", "public_key"):
            item = value.get(name)
            if not isinstance(item, bytes) or not item:
                raise ManifestError(f"a signed manifest needs non-empty bytes in {name!r}")
            fields[name] = item
        if len(fields["payload"]) > MAX_MANIFEST_PAYLOAD_BYTES:
            raise ManifestError(
                f"manifest payload of {len(fields['payload'])} bytes exceeds {MAX_MANIFEST_PAYLOAD_BYTES}"
            )
        return cls(**fields)


def _canonical(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def run_settings(run: RunConfig) -> Dict[str, Any]:
    # a JSON round trip turns tuples into lists, so equal settings always give equal bytes
    settings = json.loads(json.dumps(dataclasses.asdict(run)))
    for section, omitted in ((settings, _OMITTED_AT_DEFAULT), (settings["model"], _MODEL_OMITTED_AT_DEFAULT)):
        for name, default in omitted.items():
            if section.get(name) == default:
                del section[name]
    return settings


def run_hash(run: RunConfig) -> str:
    """16 hex characters that differ between differently-configured runs (peers announce it)."""
    return hashlib.sha256(_canonical(run_settings(run))).hexdigest()[:16]


def sign_manifest(
    run: RunConfig, identity: Identity, revision: int, issued_at: Optional[float] = None
) -> SignedManifest:
    """Sign ``run`` as the organiser ``identity``.

    A private run must list the organiser itself: its DHT refuses everyone outside the list."""
    if isinstance(revision, bool) or not isinstance(revision, int) or revision < 0:
        raise ValueError(f"revision must be a non-negative integer, got {revision!r}")
    if run.allowlist and identity.peer_id not in run.allowlist:
        raise ValueError(f"the allowlist of a private run must include the organiser's own peer id {identity.peer_id}")
    payload = _canonical(
        {
            "protocol_version": PROTOCOL_VERSION,
            "organiser": identity.peer_id,
            "revision": revision,
            "issued_at": float(time.time() if issued_at is None else issued_at),
            "run": run_settings(run),
        }
    )
    public_key = identity.private_key.get_public_key().to_bytes()
    return SignedManifest(payload, identity.private_key.sign(payload), public_key)


def _check_signer(signed: SignedManifest, organiser_peer_id: str) -> None:
    try:
        public_key = RSAPublicKey.from_bytes(signed.public_key)
        signer = peer_id_of(signed.public_key)
    except Exception as e:  # cryptography raises several types for malformed keys
        raise ManifestError(f"the manifest's public key is not an RSA public key: {type(e).__name__}: {e}") from None
    if signer != organiser_peer_id:
        raise ManifestError(f"the manifest is signed by {signer}, not by the organiser {organiser_peer_id}")
    if not public_key.verify(signed.payload, signed.signature):
        raise ManifestError("the manifest's signature does not match its contents (tampered or corrupted)")


def _parse_payload(payload: bytes) -> Dict[str, Any]:
    try:
        data = json.loads(payload.decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise ManifestError(f"the manifest payload is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ManifestError("the manifest payload must be a JSON object")
    missing = sorted({"protocol_version", "organiser", "revision", "issued_at", "run"} - set(data))
    if missing:
        raise ManifestError(f"the manifest lacks {missing}")
    return data


def verify_manifest(signed: SignedManifest, organiser_peer_id: str) -> RunManifest:
    """The manifest's contents, once its signature, signer, protocol version and settings check out."""
    _check_signer(signed, organiser_peer_id)
    data = _parse_payload(signed.payload)
    if data["protocol_version"] != PROTOCOL_VERSION:
        raise ManifestError(
            f"the run uses protocol version {data['protocol_version']!r}, this program speaks "
            f"version {PROTOCOL_VERSION}: install the version the organiser uses"
        )
    if data["organiser"] != organiser_peer_id:
        raise ManifestError(f"the manifest names {data['organiser']!r} as organiser, expected {organiser_peer_id}")
    revision, issued_at = data["revision"], data["issued_at"]
    if isinstance(revision, bool) or not isinstance(revision, int) or revision < 0:
        raise ManifestError(f"the manifest's revision must be a non-negative integer, got {revision!r}")
    if isinstance(issued_at, bool) or not isinstance(issued_at, (int, float)):
        raise ManifestError(f"the manifest's issued_at must be a number, got {issued_at!r}")
    try:
        run = config_from_dict(RunConfig, data["run"], prefix="run.")
    except ConfigError as e:
        raise ManifestError(f"the manifest's run settings are invalid: {e}") from None
    if run.allowlist and organiser_peer_id not in run.allowlist:
        raise ManifestError("the manifest's allowlist leaves out its own organiser")
    return RunManifest(run, organiser_peer_id, revision, float(issued_at), data["protocol_version"])


def run_differences(expected: Any, actual: Any, prefix: str = "") -> List[Tuple[str, Any, Any]]:
    """(dotted field name, expected value, actual value) for every leaf field where two configs differ."""
    if dataclasses.is_dataclass(expected) and type(expected) is type(actual):
        differences = []
        for field in dataclasses.fields(expected):
            differences += run_differences(
                getattr(expected, field.name), getattr(actual, field.name), f"{prefix}{field.name}."
            )
        return differences
    name = prefix[:-1]
    normalize = lambda value: list(value) if isinstance(value, tuple) else value  # noqa: E731
    return [] if normalize(expected) == normalize(actual) else [(name, expected, actual)]


def _shown(value: Any) -> str:
    return str(list(value)) if isinstance(value, tuple) else str(value)


def check_against_manifest(manifest: RunManifest, run: RunConfig) -> None:
    """Raise :class:`ConfigError` naming the first setting where ``run`` departs from the manifest."""
    differences = run_differences(manifest.run, run)
    if differences:
        name, expected, actual = differences[0]
        raise ConfigError(f"{name}: the run's manifest says {_shown(expected)}, this peer has {_shown(actual)}")


def _merged(base: Mapping[str, Any], override: Mapping[str, Any]) -> Dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merged(merged[key], value)
        else:
            merged[key] = value
    return merged


def join_settings(settings: Mapping[str, Any], manifest: RunManifest, address: str) -> Dict[str, Any]:
    """A role's explicit settings with the manifest's run and ``address`` as first initial peer.

    Run settings the user gave explicitly must agree with the manifest: the first one that does
    not raises :class:`ConfigError` naming it and both values."""
    explicit_run = settings.get("run") or {}
    if not isinstance(explicit_run, Mapping):
        raise ConfigError(f"run: expected a mapping, got {type(explicit_run).__name__}")
    manifest_run = run_settings(manifest.run)
    check_against_manifest(manifest, config_from_dict(RunConfig, _merged(manifest_run, explicit_run), prefix="run."))
    network = dict(settings.get("network") or {})
    given = network.get("initial_peers") or []
    given = [item for item in given.split(",") if item] if isinstance(given, str) else list(given)
    network["initial_peers"] = [address] + [peer for peer in given if peer != address]
    return {**settings, "run": manifest_run, "network": network}


async def publish_manifest(dht: Any, signed: SignedManifest, expiration_s: float, timeout: float = 10.0) -> bool:
    """Store ``signed`` in the run's DHT under the signer's owner subkey for ``expiration_s`` seconds."""
    run_id = _parse_payload(signed.payload)["run"]["run_id"]
    store = dht.store(
        manifest_key(run_id),
        signed.to_dict(),
        get_dht_time() + expiration_s,
        subkey=owner_subkey(signed.public_key),
        return_future=True,
    )
    return bool(await asyncio.wait_for(store, timeout))


async def fetch_manifest(dht: Any, run_id: str, organiser_peer_id: str, timeout: float = 10.0) -> RunManifest:
    """The organiser's manifest of ``run_id`` from the DHT: other subkeys are never looked at, and
    the newest valid revision wins."""
    raw = await asyncio.wait_for(dht.get(manifest_key(run_id), latest=True, return_future=True), timeout)
    entries = getattr(raw, "value", None)
    if not isinstance(entries, dict):
        raise ManifestError(f"no manifest of run {run_id!r} in the DHT")
    found: Optional[RunManifest] = None
    for subkey, item in entries.items():
        value = getattr(item, "value", None)
        public_key = value.get("public_key") if isinstance(value, Mapping) else None
        if not isinstance(public_key, bytes) or subkey != owner_subkey(public_key):
            continue
        try:
            if peer_id_of(public_key) != organiser_peer_id:
                continue
        except Exception:  # a malformed key belongs to nobody
            continue
        manifest = verify_manifest(SignedManifest.from_dict(value), organiser_peer_id)
        if found is None or manifest.revision > found.revision:
            found = manifest
    if found is None:
        raise ManifestError(f"no manifest of run {run_id!r} signed by the organiser {organiser_peer_id} in the DHT")
    return found


def manifest_handler(signed: SignedManifest) -> Handler:
    """An :class:`swarm.net.rpc.RPCServicer` handler that replies with ``signed`` to anyone who asks:
    the settings of a run are not secret, and a refused volunteer learns why from them."""

    async def handle(message: Dict[str, Any], caller: str) -> Dict[str, bytes]:
        return signed.to_dict()

    return handle


def peer_id_in_address(address: str) -> str:
    """The base58 peer id after ``/p2p/`` in a multiaddr; :class:`ManifestError` if there is none."""
    peer_id = address_peer_id(address)
    if not peer_id:
        raise ManifestError(f"{address!r} is not a multiaddr ending in /p2p/<peer id>")
    return str(peer_id)


async def fetch_manifest_from(p2p: P2P, address: str, timeout: float) -> RunManifest:
    """Ask the peer at ``address`` for its manifest; it must be signed by that very peer."""
    organiser = peer_id_in_address(address)
    reply = await call_peer(p2p, PeerID.from_base58(organiser), MANIFEST_METHOD, {}, timeout=timeout)
    return verify_manifest(SignedManifest.from_dict(reply), organiser)


def tokenizer_handler(data: bytes) -> Handler:
    """An :class:`swarm.net.rpc.RPCServicer` handler that replies with the bytes of the run's tokenizer.json
    (and their SHA-256) to anyone who asks: like the run's settings, it is not secret."""
    if not data or len(data) > MAX_TOKENIZER_BYTES:
        raise ValueError(f"a served tokenizer must hold 1 to {MAX_TOKENIZER_BYTES} bytes, got {len(data)}")
    reply = {"sha256": sha256_of_bytes(data), "tokenizer": bytes(data)}

    async def handle(message: Dict[str, Any], caller: str) -> Dict[str, Any]:
        return reply

    return handle


async def fetch_tokenizer_from(
    p2p: P2P, address: str, expected_sha256: str, timeout: float, max_bytes: int = MAX_TOKENIZER_BYTES
) -> bytes:
    """The bytes of the tokenizer ``expected_sha256`` from the organiser at ``address``, within ``timeout``
    seconds; a reply above ``max_bytes`` is refused before it is read, and bytes with another SHA-256
    raise :class:`~swarm.training.tokenizer.TokenizerError` naming both hashes."""
    organiser = peer_id_in_address(address)
    reply = await call_peer(
        p2p,
        PeerID.from_base58(organiser),
        TOKENIZER_METHOD,
        {},
        timeout=timeout,
        stream=True,
        max_reply_bytes=max_bytes + TOKENIZER_REPLY_ENVELOPE_BYTES,
    )
    data = reply.get("tokenizer")
    if not isinstance(data, bytes) or not data:
        raise ManifestError(f"the organiser {organiser} sent no tokenizer file")
    if len(data) > max_bytes:
        raise ManifestError(f"the organiser {organiser} sent a tokenizer of {len(data)} bytes, more than {max_bytes}")
    check_sha256(sha256_of_bytes(data), expected_sha256, f"sent by the organiser {organiser}")
    return data
