"""One RSA key per participant: its libp2p identity (hence its peer id) and the key that signs its DHT records.

hivemind's ``p2pd`` identities are RSA keys stored as a libp2p ``crypto_pb2.PrivateKey``, and a
libp2p peer id is the sha256 multihash of the protobuf-wrapped public key. Because the same key
signs the participant's DHT records (under an ``[owner:<public key>]`` subkey), anyone can check
offline that a record signed by key K was written by peer ``peer_id_of(K)``: a record that names
another peer as its author is a forgery, whatever its signature.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import os
import tempfile
from dataclasses import dataclass, field
from typing import Iterator, Optional

import base58
import multihash
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from google.protobuf.message import DecodeError
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

from swarm.hivemind_private import wrap_rsa_key

__all__ = ["Identity", "load_or_create_identity", "key_file_for_start", "owner_subkey", "peer_id_of", "MIN_RSA_BITS"]

MIN_RSA_BITS = 2048  # libp2p refuses smaller RSA keys


@dataclass(frozen=True)
class Identity:
    """A participant's private key, the file ``p2pd`` reads it from, and the peer id it implies.

    Lives in the role's main process; the DHT process gets the same key through the identity file
    (for its libp2p identity) and through the signature validator given to it at start."""

    path: str
    private_key: RSAPrivateKey = field(repr=False)
    peer_id: str
    fresh: bool = False  # generated just now, so no other peer can be using it yet
    temporary: bool = False  # made for this process only: on disk until its first p2pd start, then only during one

    @property
    def public_key(self) -> bytes:
        """The public key as hivemind writes it inside ``[owner:...]`` subkeys (OpenSSH format)."""
        return self.private_key.get_public_key().to_bytes()

    @property
    def owner_subkey(self) -> bytes:
        """The DHT subkey under which this participant stores its records: only its key can sign it."""
        return owner_subkey(self.public_key)


def owner_subkey(public_key: bytes) -> bytes:
    """The DHT subkey that hivemind's ``RSASignatureValidator`` reserves for the holder of ``public_key``."""
    return RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", public_key)


def load_or_create_identity(path: Optional[str]) -> Identity:
    """Read the libp2p identity at ``path``, or create one there (mode 0600, written atomically).

    With ``path`` None the identity is new and lives in a private temporary file removed at
    interpreter exit: a process that does not need a stable peer id still signs its records."""
    if path is None:
        return _create_temporary_identity()
    if not os.path.exists(path):
        _write_new_identity(path)
        return _identity_from_file(path, fresh=True)
    return _identity_from_file(path, fresh=False)


def peer_id_of(public_key: bytes) -> str:
    """The base58 libp2p peer id of an RSA public key in hivemind's ``RSAPublicKey.to_bytes()`` format.

    Raises ``ValueError`` for anything that is not such a key (the bytes come from the network)."""
    if not isinstance(public_key, bytes):
        raise ValueError(f"a public key must be bytes, got {type(public_key).__name__}")
    try:
        key = serialization.load_ssh_public_key(public_key)  # what hivemind's RSAPublicKey.from_bytes reads
        if not isinstance(key, rsa.RSAPublicKey):
            raise ValueError(f"expected an RSA public key, got {type(key).__name__}")
    except Exception as e:  # cryptography raises ValueError, UnsupportedAlgorithm, IndexError... on garbage
        raise ValueError(f"not an OpenSSH RSA public key: {type(e).__name__}: {e}") from None
    if key.key_size < MIN_RSA_BITS:
        raise ValueError(f"RSA key of {key.key_size} bits; libp2p requires at least {MIN_RSA_BITS}")
    return _peer_id_of_rsa(key)


def _peer_id_of_rsa(key: rsa.RSAPublicKey) -> str:
    # libp2p peer ids: sha256 multihash of the protobuf PublicKey holding the SubjectPublicKeyInfo DER
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    wrapped = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(wrapped).digest(), multihash.coerce_code("sha2-256"))
    return base58.b58encode(digest).decode()


def _identity_from_file(path: str, fresh: bool) -> Identity:
    with open(path, "rb") as file:
        data = file.read()
    try:
        private_key = _parse_identity(data)
    except ValueError as e:
        raise ValueError(f"{path} is not a usable libp2p identity: {e}") from None
    return Identity(
        path=path, private_key=private_key, peer_id=peer_id_of(private_key.get_public_key().to_bytes()), fresh=fresh
    )


def _parse_identity(data: bytes) -> RSAPrivateKey:
    try:
        message = crypto_pb2.PrivateKey.FromString(data)
    except DecodeError as e:
        raise ValueError(f"not a libp2p PrivateKey protobuf ({e})") from None
    if message.key_type != crypto_pb2.RSA:
        name = crypto_pb2.KeyType.Name(message.key_type) if message.key_type in crypto_pb2.KeyType.values() else "?"
        raise ValueError(f"key type {name} ({message.key_type}); only RSA identities can sign DHT records")
    try:
        key = serialization.load_der_private_key(message.data, password=None)
    except (ValueError, TypeError) as e:
        raise ValueError(f"corrupt RSA key ({e})") from None
    if not isinstance(key, rsa.RSAPrivateKey):
        raise ValueError(f"expected an RSA key, found {type(key).__name__}")
    if key.key_size < MIN_RSA_BITS:
        raise ValueError(f"RSA key of {key.key_size} bits; libp2p requires at least {MIN_RSA_BITS}")
    return _wrap(key)


def _wrap(key: rsa.RSAPrivateKey) -> RSAPrivateKey:
    der = key.private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
    )
    return wrap_rsa_key(der)


def _serialized_new_identity() -> bytes:
    return _serialized(RSAPrivateKey())


def _serialized(key: RSAPrivateKey) -> bytes:
    # the same encoding as hivemind's P2P.generate_identity, which p2pd reads
    return crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=key.to_bytes()).SerializeToString()


def _write_new_identity(path: str) -> None:
    """Write to a private temporary file beside ``path``, then link it into place: a reader never
    sees half a key, and of two processes creating the same identity at once, the second one reads
    the first one's key instead of replacing it."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"the directory {directory!r} for the identity file {path!r} does not exist")
    fd, temporary = tempfile.mkstemp(prefix=".identity-", dir=directory)  # mkstemp creates it with mode 0600
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(_serialized_new_identity())
            file.flush()
            os.fsync(file.fileno())
        try:
            os.link(temporary, path)
        except FileExistsError:
            pass  # created concurrently by someone else: use theirs
    finally:
        os.unlink(temporary)


def _create_temporary_identity() -> Identity:
    fd, path = tempfile.mkstemp(prefix="swarm-identity-", suffix=".key")
    atexit.register(_remove_quietly, path)
    with os.fdopen(fd, "wb") as file:
        file.write(_serialized_new_identity())
    return dataclasses.replace(_identity_from_file(path, fresh=True), temporary=True)


@contextlib.contextmanager
def key_file_for_start(identity: Identity) -> Iterator[str]:
    """The identity file to start a p2pd with. A temporary identity's key is written to a new private file
    for the start, removed once the daemon has read it: the key lives on in this process, and a process
    that is killed leaves no private key behind in the temporary directory (an exit handler removes files
    only on a clean exit)."""
    if not identity.temporary:
        yield identity.path
        return
    _remove_quietly(identity.path)  # the file it was created in; each start writes a new private one
    fd, path = tempfile.mkstemp(prefix="swarm-identity-", suffix=".key")  # mode 0600
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(_serialized(identity.private_key))
        yield path
    finally:
        _remove_quietly(path)


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
