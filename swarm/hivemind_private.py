"""Every use of hivemind's private API, in one place.

hivemind 1.1.12 offers no public way to do a few things this system needs: connect p2pd to a peer at given
addresses, teach a node's DHT protocol to refuse junk, register a tensor codec for the averager's wire
format, change how a ``DecentralizedAverager`` forms groups and runs its all-reduce, and stream the state it
serves without hivemind's whole-tensor serialisation. Each is done here
and nowhere else, and :data:`PRIVATE_ATTRIBUTES` lists every private name touched, so that
``tests/test_hivemind_private.py`` fails with the name that is missing when hivemind changes under it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Tuple

from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.compression import serialization as hivemind_serialization
from hivemind.compression.base import CompressionBase
from hivemind.dht.protocol import DHTProtocol
from hivemind.p2p import P2P, PeerID, ServicerBase
from hivemind.p2p.p2p_daemon_bindings.p2pclient import Client as DaemonClient
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.multiaddr import Multiaddr

__all__ = [
    "PrivateAttribute",
    "PRIVATE_ATTRIBUTES",
    "missing_private_attributes",
    "daemon_connect",
    "wrap_rsa_key",
    "register_decoder",
    "wrap_dht_protocol",
    "wrap_join_request",
    "PrivateAverager",
]


@dataclass(frozen=True)
class PrivateAttribute:
    """A private name of hivemind this module uses: ``owner.name``, with the parameters it is called with
    (for a function or method) or None for a plain attribute."""

    owner: Any
    name: str
    parameters: Tuple[str, ...] | None = None
    instance: bool = False  # set in __init__ rather than on the class: checked on an instance by the tests

    @property
    def label(self) -> str:
        return f"{getattr(self.owner, '__module__', '')}.{getattr(self.owner, '__name__', self.owner)}.{self.name}"


PRIVATE_ATTRIBUTES: Tuple[PrivateAttribute, ...] = (
    PrivateAttribute(P2P, "_client", instance=True),
    PrivateAttribute(DaemonClient, "connect", ("peer_id", "maddrs")),
    PrivateAttribute(hivemind_serialization, "_BASE_COMPRESSION_TYPES"),
    PrivateAttribute(DHTProtocol, "_validate_record", ("key_bytes", "subkey_bytes", "value_bytes", "expiration_time")),
    PrivateAttribute(DHTProtocol, "_validate_dictionary", ("key_bytes", "dictionary")),
    PrivateAttribute(DHTProtocol, "call_find", ("peer", "keys")),
    PrivateAttribute(Matchmaking, "_request_join_group", ("leader",)),
    PrivateAttribute(Matchmaking, "min_group_size", instance=True),
    PrivateAttribute(Matchmaking, "target_group_size", instance=True),
    PrivateAttribute(Matchmaking, "group_key_manager", instance=True),
    PrivateAttribute(DecentralizedAverager, "_matchmaking", instance=True),
    PrivateAttribute(DecentralizedAverager, "_running_groups", instance=True),
    PrivateAttribute(DecentralizedAverager, "_outer_pipe", instance=True),
    PrivateAttribute(DecentralizedAverager, "_p2p", instance=True),
    PrivateAttribute(DecentralizedAverager, "_allreduce_timeout", instance=True),
    PrivateAttribute(DecentralizedAverager, "_state_updated", instance=True),
    PrivateAttribute(DecentralizedAverager, "_step", ("step", "future_for_init")),
    PrivateAttribute(DecentralizedAverager, "_aggregate_with_group", ("group_info", "min_vector_size")),
    PrivateAttribute(DecentralizedAverager, "_run_allreduce_inplace_", ("tensors", "group_info", "group_id")),
    PrivateAttribute(DecentralizedAverager, "_declare_for_download_periodically", ()),
    PrivateAttribute(DecentralizedAverager, "_shutdown", ("timeout",)),
    PrivateAttribute(DecentralizedAverager, "_get_current_state_from_host_process", ()),
    PrivateAttribute(ServicerBase, "_get_handle_name", ("namespace", "method_name")),
    PrivateAttribute(RSAPrivateKey, "_private_key", instance=True),
)


def missing_private_attributes(attribute: PrivateAttribute, obj: Any = None) -> str:
    """What is wrong with one private attribute on this hivemind ("" if nothing): missing, or callable with
    other parameters. ``obj``: an instance to look on, for attributes set in ``__init__``."""
    holder = obj if obj is not None else attribute.owner
    if not hasattr(holder, attribute.name):
        return f"{attribute.label} is gone from hivemind: swarm.hivemind_private relies on it"
    if attribute.parameters is None:
        return ""
    parameters = inspect.signature(getattr(holder, attribute.name)).parameters
    missing = [p for p in attribute.parameters if p not in parameters]
    return f"{attribute.label} no longer takes {missing}: swarm.hivemind_private calls it with them" if missing else ""


async def daemon_connect(p2p: P2P, peer_id: PeerID, maddrs: Sequence[Multiaddr]) -> None:
    """Make ``p2p``'s daemon connect to ``peer_id`` at ``maddrs`` (hivemind's ``P2P`` has no public connect)."""
    await p2p._client.connect(peer_id, list(maddrs))


def wrap_rsa_key(der: bytes) -> RSAPrivateKey:
    """hivemind's ``RSAPrivateKey`` holding the key ``der`` (PKCS#1 DER): its constructor only generates keys, and
    only its unpickling, whose state names the private ``_private_key``, loads one."""
    wrapped = RSAPrivateKey.__new__(RSAPrivateKey)
    wrapped.__setstate__({"_private_key": der})
    return wrapped


def register_decoder(name: str, codec: CompressionBase) -> None:
    """Let hivemind's tensor deserialization decode ``name`` with ``codec``: the registry has no public setter."""
    hivemind_serialization._BASE_COMPRESSION_TYPES[name] = codec


def wrap_dht_protocol(
    protocol: DHTProtocol,
    wrap_call_find: Callable[[Callable], Callable],
    wrap_validation: Optional[Callable[[Callable], Callable]] = None,
) -> None:
    """Replace a node's ``call_find`` and (with ``wrap_validation``) its record checks (``_validate_record``,
    ``_validate_dictionary``) with wrappers of the originals; a second call wraps the first one's wrappers."""
    if wrap_validation is not None:
        protocol._validate_record = wrap_validation(protocol._validate_record)
        protocol._validate_dictionary = wrap_validation(protocol._validate_dictionary)
    protocol.call_find = wrap_call_find(protocol.call_find)


def wrap_join_request(matchmaking: Matchmaking, wrap: Callable[[Callable], Callable]) -> None:
    """Replace how ``matchmaking`` asks a leader to join its group with a wrapper of the original, once."""
    if getattr(matchmaking, "_swarm_wrapped", False):
        return
    matchmaking._request_join_group = wrap(matchmaking._request_join_group)
    matchmaking._swarm_wrapped = True


class PrivateAverager(DecentralizedAverager):
    """A ``DecentralizedAverager`` whose private state this system reads, behind names of its own.

    Subclasses override the private hooks listed in :data:`PRIVATE_ATTRIBUTES` (``_step``,
    ``_aggregate_with_group``, ``_run_allreduce_inplace_``, ``_declare_for_download_periodically``,
    ``_shutdown``); everything they read of the averager's internals goes through the properties below, and
    the name its RPCs go by through ``RPC_NAME``.
    """

    RPC_NAME: str | None = None  # the class name its RPCs go by on the wire, subclasses included; None: its own

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        """hivemind names a servicer's RPCs after its class: a subclass (an emulated faulty replica) would neither
        serve nor reach the RPCs of the class it stands in for. Subclasses of a class that sets ``RPC_NAME``
        keep that name."""
        name = f"{cls.RPC_NAME or cls.__name__}.{method_name}"
        return name if namespace is None else f"{namespace}::{name}"

    @property
    def matchmaking(self) -> Matchmaking:
        return self._matchmaking

    @property
    def running_groups(self) -> dict:
        """group id -> future of the running all-reduce of that group."""
        return self._running_groups

    @property
    def background_p2p(self) -> P2P:
        """The P2P of the averager's background process (a replica of its DHT's)."""
        return self._p2p

    @property
    def allreduce_timeout(self) -> float | None:
        return self._allreduce_timeout

    @property
    def state_updated(self) -> Any:
        """The event set whenever the averager's shared state changes (an ``asyncio.Event`` in the background)."""
        return self._state_updated

    async def current_state_from_host(self) -> Tuple[bytes, Sequence[Any], Any]:
        """(serialized metadata, tensors, compression infos) of ``get_current_state``, which runs in the process
        that created the averager; awaited in the background process (as hivemind's download RPC does)."""
        return await self._get_current_state_from_host_process()

    def call_in_background(self, method: str, **kwargs: Any) -> None:
        """Run ``method`` of this averager in its background process, from the process that created it."""
        self._outer_pipe.send((method, [], kwargs))

    def set_group_sizes(self, minimum: int, full: int | None) -> None:
        """Change the group sizes the next matchmaking aims for (runs in the background process)."""
        self._matchmaking.min_group_size = minimum
        self._matchmaking.target_group_size = full
