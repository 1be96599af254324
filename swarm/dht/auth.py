"""Private runs: who may take part, decided by pure functions, and enforced on the DHT.

A run whose settings carry a non-empty ``allowlist`` is private: only the listed peer ids may
read or write its DHT and average with its stages. The list is part of the organiser's signed
manifest, so it is the run's only authority: there is no token issuer. Every DHT request and
response is signed by the sender's identity key (the RSA key behind its libp2p peer id), and a
receiver accepts it only if that key's peer id is on the list, the message is fresh, and its
nonce was not seen before.

Decisions (:func:`authorize_peer`, :func:`check_freshness`, :func:`check_membership`) return a
:class:`Verdict` with a reason and do no I/O; :class:`AllowlistAuthorizer` (used by hivemind's
DHT protocol in the DHT's own process) acts on them and logs each refused peer once.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, FrozenSet, Iterable, Optional, Set

from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils import get_dht_time, get_logger
from hivemind.utils.auth import AuthorizedRequestBase, AuthorizedResponseBase, AuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

__all__ = [
    "Allowlist",
    "Verdict",
    "authorize_peer",
    "check_freshness",
    "check_membership",
    "NonceCache",
    "AllowlistAuthorizer",
    "authorizer_for",
]

logger = get_logger(__name__)
MAX_CLOCK_SKEW_S = 60.0  # a signed message older or newer than this (seconds) is refused
MAX_NONCES = 100_000  # nonces remembered for replay detection; the oldest are forgotten first
MAX_REFUSED_LOGGED = 1024  # refused peer ids remembered so that each is logged once


@dataclass(frozen=True)
class Allowlist:
    """The peer ids allowed in a run; an empty list allows everyone (an open run)."""

    peer_ids: FrozenSet[str] = field(default_factory=frozenset)

    @classmethod
    def of(cls, peer_ids: Iterable[object]) -> "Allowlist":
        return cls(frozenset(str(peer_id) for peer_id in peer_ids))  # base58 strings or hivemind PeerIDs

    @property
    def is_open(self) -> bool:
        return not self.peer_ids

    def allows(self, peer_id: object) -> bool:
        return self.is_open or str(peer_id) in self.peer_ids


@dataclass(frozen=True)
class Verdict:
    """A decision with its reason: ``ok`` or why not."""

    ok: bool
    reason: str = ""


ACCEPT = Verdict(True)


def authorize_peer(allowlist: Allowlist, claimed_peer_id: str, key_peer_id: Optional[str]) -> Verdict:
    """May a message claiming to come from ``claimed_peer_id``, signed by a key whose peer id is
    ``key_peer_id`` (None: no usable key), be accepted?"""
    if key_peer_id is None:
        return Verdict(False, "the message carries no usable public key")
    if claimed_peer_id != key_peer_id:
        return Verdict(
            False, f"the message claims to come from {claimed_peer_id!r} but its key belongs to {key_peer_id}"
        )
    if not allowlist.allows(key_peer_id):
        return Verdict(False, f"peer {key_peer_id} is not in the run's allowlist")
    return ACCEPT


def check_freshness(sent_at: float, now: float, max_skew_s: float = MAX_CLOCK_SKEW_S) -> Verdict:
    """Is a message stamped ``sent_at`` recent enough (both ways: clocks differ) at time ``now``?"""
    if not abs(sent_at - now) <= max_skew_s:
        return Verdict(
            False,
            f"the message is stamped {sent_at - now:+.1f} s from now (allowed: ±{max_skew_s:.0f} s): "
            "a replay, or clocks out of sync",
        )
    return ACCEPT


def check_membership(allowlist: Allowlist, own_peer_id: Optional[str]) -> Verdict:
    """May this process join a run with ``allowlist`` as ``own_peer_id`` (None: no fixed identity)?"""
    if allowlist.is_open:
        return ACCEPT
    if own_peer_id is None:
        return Verdict(
            False,
            "this run is private: start with --identity_path KEYFILE and ask the organiser to add "
            "that key's peer id to the run's allowlist",
        )
    if not allowlist.allows(own_peer_id):
        return Verdict(
            False,
            f"this run is private and this peer's id {own_peer_id} is not in its allowlist: "
            "send that id to the organiser",
        )
    return ACCEPT


class NonceCache:
    """Nonces seen within the freshness window, bounded in size: a message seen once is refused
    again; a nonce older than the window need not be remembered (its message is stale anyway)."""

    def __init__(self, ttl_s: float = 3 * MAX_CLOCK_SKEW_S, max_size: int = MAX_NONCES):
        self.ttl_s, self.max_size = ttl_s, max_size
        self._seen: "OrderedDict[bytes, float]" = OrderedDict()

    def add(self, nonce: bytes, now: float) -> bool:
        """Remember ``nonce``; False if it was already seen (a replay)."""
        while self._seen and (len(self._seen) >= self.max_size or next(iter(self._seen.values())) < now - self.ttl_s):
            self._seen.popitem(last=False)
        if nonce in self._seen:
            return False
        self._seen[nonce] = now
        return True

    def __len__(self) -> int:
        return len(self._seen)


def _sign_token(private_key: RSAPrivateKey, peer_id: str) -> AccessToken:
    """A self-signed token: the allowlist, not an issuer, decides who is trusted, so the token
    only binds a peer id (``username``) to a public key; the signature of every message then
    proves that the sender holds that key."""
    public_key = private_key.get_public_key().to_bytes()
    token = AccessToken(username=peer_id, public_key=public_key, expiration_time="")
    token.signature = private_key.sign(token.SerializeToString())
    return token


class AllowlistAuthorizer(AuthorizerBase):
    """Signs this process's DHT requests and responses; accepts only those of allowlisted peers.

    Lives in the DHT's process (hivemind pickles or forks it there). ``peer_id_of`` maps a public
    key (``RSAPublicKey.to_bytes()``) to its libp2p peer id; refusing a request makes hivemind
    answer nothing, refusing a response makes the call count as failed, so an outsider can neither
    read nor write the run's DHT through an allowed node, nor enter allowed nodes' routing tables.

    hivemind's DHT client does not know the key of the node it calls, so requests are not bound to
    their recipient: a member could replay another member's request to a third member within the
    freshness window. Outsiders never receive members' requests (they are in no routing table),
    so only a member could do this, and it could as well send its own requests.
    """

    def __init__(
        self,
        private_key: RSAPrivateKey,
        peer_id: str,
        allowlist: Allowlist,
        peer_id_of: Callable[[bytes], str],
        max_skew_s: float = MAX_CLOCK_SKEW_S,
    ):
        self._private_key, self.peer_id, self.allowlist = private_key, peer_id, allowlist
        self._peer_id_of, self.max_skew_s = peer_id_of, max_skew_s
        self._token = _sign_token(private_key, peer_id)
        self._public_key = private_key.get_public_key().to_bytes()
        self._nonces = NonceCache(ttl_s=3 * max_skew_s)
        self._refused: Set[str] = set()

    def _key_peer_id(self, token: AccessToken) -> Optional[str]:
        """The peer id of the token's key, if the token is well formed and signed by that key."""
        unsigned = AccessToken()
        unsigned.CopyFrom(token)
        unsigned.signature = b""
        try:
            if not RSAPublicKey.from_bytes(token.public_key).verify(unsigned.SerializeToString(), token.signature):
                return None
            return self._peer_id_of(token.public_key)
        except Exception:  # a malformed key identifies nobody
            return None

    def _refuse(self, verdict: Verdict, sender: str) -> bool:
        sender = sender[:64]  # the claimed name is the sender's to choose
        if sender not in self._refused and len(self._refused) < MAX_REFUSED_LOGGED:
            self._refused.add(sender)
            logger.warning(f"refusing DHT traffic from {sender}: {verdict.reason}")
        else:
            logger.debug(f"refusing DHT traffic from {sender}: {verdict.reason}")
        return False

    def _check_signed(self, message, auth, token: AccessToken) -> Verdict:
        """Who signed ``message`` (whose ``auth.signature`` is cleared here, as it was when signed)."""
        key_peer_id = self._key_peer_id(token)
        verdict = authorize_peer(self.allowlist, token.username, key_peer_id)
        if not verdict.ok:
            return verdict
        signature, auth.signature = auth.signature, b""
        if not RSAPublicKey.from_bytes(token.public_key).verify(message.SerializeToString(), signature):
            return Verdict(False, "the message's signature does not match its contents")
        return ACCEPT

    async def sign_request(self, request: AuthorizedRequestBase, service_public_key: Optional[RSAPublicKey]) -> None:
        auth = request.auth
        auth.client_access_token.CopyFrom(self._token)
        if service_public_key is not None:
            auth.service_public_key = service_public_key.to_bytes()
        auth.time = get_dht_time()
        auth.nonce = secrets.token_bytes(16)
        auth.signature = b""
        auth.signature = self._private_key.sign(request.SerializeToString())

    async def validate_request(self, request: AuthorizedRequestBase) -> bool:
        auth = request.auth
        sender = auth.client_access_token.username or "an unnamed peer"
        verdict = self._check_signed(request, auth, auth.client_access_token)
        if verdict.ok and auth.service_public_key and auth.service_public_key != self._public_key:
            verdict = Verdict(False, "the request was signed for another peer")
        now = get_dht_time()
        if verdict.ok:
            verdict = check_freshness(auth.time, now, self.max_skew_s)
        if verdict.ok and not self._nonces.add(bytes(auth.nonce), now):
            verdict = Verdict(False, "the request replays an earlier one (its nonce was seen before)")
        return verdict.ok or self._refuse(verdict, sender)

    async def sign_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> None:
        auth = response.auth
        auth.service_access_token.CopyFrom(self._token)
        auth.nonce = request.auth.nonce
        auth.signature = b""
        auth.signature = self._private_key.sign(response.SerializeToString())

    async def validate_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> bool:
        auth = response.auth
        sender = auth.service_access_token.username or "an unnamed peer"
        verdict = self._check_signed(response, auth, auth.service_access_token)
        if verdict.ok and auth.nonce != request.auth.nonce:
            verdict = Verdict(False, "the response answers another request (nonce mismatch)")
        return verdict.ok or self._refuse(verdict, sender)


def authorizer_for(allowlist_peer_ids: Iterable[str], identity) -> Optional[AllowlistAuthorizer]:
    """The DHT authorizer of a run with this allowlist for ``identity`` (a :class:`swarm.dht.identity.Identity`),
    or None for an open run, whose DHT stays unauthenticated as before."""
    from swarm.dht.identity import peer_id_of

    allowlist = Allowlist.of(allowlist_peer_ids)
    if allowlist.is_open:
        return None
    return AllowlistAuthorizer(identity.private_key, identity.peer_id, allowlist, peer_id_of)
