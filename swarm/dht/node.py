"""Starting the hivemind DHT that every role (peer, trainer, bootstrap, status) joins.

Every node runs the same validators: ``RSASignatureValidator`` with the node's own identity key
(it signs what this node stores under its ``[owner:...]`` subkey and checks everyone else's
signatures) and, once the run is known, the run's schema (``swarm.dht.records.run_schema_validator``).
hivemind applies them both when a node is asked to store a value and when a lookup returns one,
so a node that stores junk in its own storage cannot make an honest reader accept it. A record
accepted once is not verified again while it stays unchanged (:mod:`swarm.dht.validator_cache`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from contextvars import ContextVar
from typing import Any, Collection, Dict, List, Optional

from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import get_dht_time, get_logger
from hivemind.utils.auth import AuthorizerBase

from swarm.config.settings import NetworkConfig, RunConfig
from swarm.dht.identity import Identity, key_file_for_start, load_or_create_identity
from swarm.hivemind_private import wrap_dht_protocol
from swarm.net.listening import listen_and_announce
from swarm.dht.records import run_schema_validator
from swarm.dht.routes import reach_nodes_by_address, routes_of
from swarm.dht.validator_cache import RememberingValidator

__all__ = [
    "start_dht",
    "start_run_dht",
    "stop_dht",
    "identity_of",
    "blacklisted_peers",
    "store_in_dht",
    "STORE_TRAVERSAL",
    "known_nodes",
]

logger = get_logger(__name__)
FRESH_LOOKUP_WORKERS = 2  # nodes asked at once by a lookup that stops at the first fresh copy (hivemind's default: 4)
NUM_REPLICAS = 5  # nodes that keep each stored value (hivemind's default)
# how a store finds the nodes to keep its value: hivemind's walk goes on until it has asked the key's 20 nearest nodes
# (its bucket size); a store needs only the NUM_REPLICAS nearest, so its walk stops once it has asked that many
STORE_TRAVERSAL: Dict[str, int] = {"beam_size": NUM_REPLICAS, "num_workers": FRESH_LOOKUP_WORKERS}
# nodes a read that wants every copy of a key asks, nearest first: twice the nodes a store writes to, so that it meets
# them even where the writer knew other nodes than the reader (hivemind's default walks 20, each answering with 20
# neighbours per key: a probe of tens of keys then moved megabytes and outlasted its timeout)
WHOLE_READ_BEAM = 2 * NUM_REPLICAS
DHT_EXIT_WAIT_S = 10.0  # seconds a stopped DHT process may take to exit before it is killed
# values refused while one lookup request is answered (set per request, in the DHT process)
_REFUSED_IN_ANSWER: ContextVar[Optional[List[bytes]]] = ContextVar("refused_in_answer", default=None)


def start_dht(
    network: NetworkConfig,
    client_mode: bool = False,
    *,
    run_id: Optional[str] = None,
    num_stages: Optional[int] = None,
    identity: Optional[Identity] = None,
    authorizer: Optional[AuthorizerBase] = None,
    p2p_options: Optional[Dict[str, Any]] = None,
) -> DHT:
    """Start a DHT process whose libp2p identity is ``identity`` (loaded from or created at
    ``network.identity_path`` when not given) and attach that identity as ``dht.identity``, so
    that the caller signs its records with the key behind its peer id.

    With ``run_id`` (and then ``num_stages``) the node enforces the run's record schema; roles that
    read or write run records should always pass them: without the schema, a plain value stored
    under a run key with a later expiration hides the records beneath it from this node.

    ``p2p_options``: further settings of its p2pd (relaying, forced reachability: see
    :mod:`swarm.net.reachability`). ``/tcp/0`` in ``network.announce_maddrs`` is made concrete,
    and a wildcard listener announces its interfaces' addresses but loopback and container bridges
    (:func:`swarm.net.listening.listen_and_announce`); ``dht.listen_maddrs`` holds the addresses it listens on."""
    if run_id is not None and num_stages is None:
        raise ValueError("num_stages is required with run_id: the run's schema has one key per stage")
    if identity is None:
        identity = load_or_create_identity(network.identity_path)
    validators = [RSASignatureValidator(identity.private_key)]
    if run_id is not None and num_stages is not None:  # (one without the other was refused above)
        validators.append(run_schema_validator(run_id, num_stages))
    validators = [RememberingValidator(validators)]  # an unchanged record is verified once, not on every read
    extra: Dict[str, Any] = {} if authorizer is None else {"authorizer": authorizer}
    # a freshly generated key cannot be in use yet: skip the extra daemon that checks it
    extra.update({"check_if_identity_free": not identity.fresh, **(p2p_options or {})})
    host_maddrs, announce_maddrs = listen_and_announce(network.host_maddrs, network.announce_maddrs)
    with key_file_for_start(identity) as identity_path:
        dht = DHT(
            initial_peers=network.initial_peers,
            host_maddrs=host_maddrs,
            announce_maddrs=announce_maddrs or None,
            identity_path=identity_path,
            record_validators=validators,
            client_mode=client_mode,
            start=True,
            startup_timeout=network.startup_timeout_s,
            # no copies of values nobody asked this node to keep, and no lookups to refresh them: every reader asks
            # for what it needs when it needs it (a lookup that stops at the first fresh copy must not stop at
            # a cached one), and records are re-stored by their owners
            cache_locally=False,
            cache_on_store=False,
            cache_nearest=0,
            cache_refresh_before_expiry=0,
            num_replicas=NUM_REPLICAS,
            **extra,
        )
    dht.listen_maddrs = host_maddrs
    dht.identity = identity  # lives in this (parent) process only; the DHT process has the key in its validator
    if str(dht.peer_id) != identity.peer_id:
        stop_dht(dht)
        raise RuntimeError(f"p2pd runs as {dht.peer_id}, but the identity at {identity.path} is {identity.peer_id}")
    try:
        dht.run_coroutine(reach_nodes_by_address, return_future=True).result(timeout=network.startup_timeout_s)
    except Exception as e:  # the node still reaches every node libp2p routes, and those it is connected to
        logger.warning(f"this DHT node will not ask where the nodes it hears of listen: {type(e).__name__}: {e}")
    if run_id is not None:
        dht.run_coroutine(_blacklist_nodes_that_answer_junk)
    return dht


def stop_dht(dht: Optional[DHT]) -> None:
    """Shut the DHT process down and wait until it has exited; a second call does nothing.

    hivemind's shutdown closes its pipe to the process and, past a grace period, terminates the process
    without waiting for it. A second shutdown while that process is still exiting finds it alive and writes
    to the closed pipe ("handle is closed"), so this waits for the exit, and kills a process that ignores
    the terminate."""
    if dht is None or not dht.is_alive():
        return
    try:
        dht.shutdown()
    except OSError:  # an earlier shutdown closed the pipe and the process is on its way out
        pass
    dht.join(DHT_EXIT_WAIT_S)
    if dht.is_alive():
        logger.warning(f"the DHT process {dht.pid} did not exit within {DHT_EXIT_WAIT_S:.0f} s; killing it")
        dht.kill()
        dht.join(DHT_EXIT_WAIT_S)


def start_run_dht(
    network: NetworkConfig,
    run: RunConfig,
    client_mode: bool = False,
    p2p_options: Optional[Dict[str, Any]] = None,
    identity: Optional[Identity] = None,
) -> DHT:
    """The DHT of a participant of ``run``: its identity (``identity``, else loaded from or created at
    ``network.identity_path``), the run's record schema, and in a private run the allowlist authorizer
    (without which the run's other nodes refuse to talk to it)."""
    from swarm.dht.auth import authorizer_for

    identity = identity or load_or_create_identity(network.identity_path)
    return start_dht(
        network,
        client_mode,
        run_id=run.run_id,
        num_stages=run.num_stages,
        identity=identity,
        authorizer=authorizer_for(run.allowlist, identity),
        p2p_options=p2p_options,
    )


def identity_of(dht: DHT) -> Identity:
    """The identity a DHT was started with; records can be signed and read only through such a DHT."""
    identity = getattr(dht, "identity", None)
    if not isinstance(identity, Identity):
        raise ValueError("this DHT has no signing identity: start it with swarm.dht.node.start_dht")
    return identity


async def get_many_in_dht(
    _dht: DHT, node: DHTNode, keys: Collection[str], timeout: float, fresh_s: Optional[float] = None
) -> Optional[Dict[str, Any]]:
    """Look up several keys in one traversal; None if it took longer than ``timeout``. With ``fresh_s``, the
    search for a key stops at the first answer whose value outlives ``fresh_s`` seconds from now (a node that
    took a store of it lately), instead of asking the ``WHOLE_READ_BEAM`` nodes nearest the key for their copies.
    Runs inside the DHT process through ``dht.run_coroutine``, so it is defined here, imported by every process
    before its DHT forks. A timeout is returned rather than raised: hivemind logs every exception a coroutine
    raises with a traceback, and a slow lookup is an expected event that the caller reports."""
    sufficient = float("inf") if fresh_s is None else get_dht_time() + fresh_s
    # a lookup that stops at the first fresh copy asks few nodes at once: more in flight would each send a whole
    # copy back after the first one already sufficed
    walk = {"beam_size": WHOLE_READ_BEAM} if fresh_s is None else {"num_workers": FRESH_LOOKUP_WORKERS}
    try:
        return await asyncio.wait_for(node.get_many(list(keys), sufficient_expiration_time=sufficient, **walk), timeout)
    except asyncio.TimeoutError:
        return None


async def store_in_dht(
    _dht: DHT, node: DHTNode, key: str, subkey: Any, value: Any, expiration_time: float, timeout: float
) -> bool:
    """Store ``value`` under ``subkey`` of ``key`` on the key's ``NUM_REPLICAS`` nearest nodes (this node among
    them where it serves the DHT and is near enough); whether any of them took it. False also when the store took
    longer than ``timeout`` (returned, not raised, as in :func:`get_many_in_dht`).

    hivemind's own store finds those nodes by looking up the key itself, and every node on the way that keeps the
    key answers with its whole copy: a peer re-storing its record would download the shard of its stage from each
    holder to upload one record. The walk here looks up the id beside the key's (its last bit flipped). XOR
    distance orders nodes alike from both ids (two node ids would have to differ in their last bit alone to swap
    places), so it ends at the same nearest nodes, and as no node keeps anything under that id, their answers
    carry nodes only. Runs inside the DHT process through ``dht.run_coroutine``."""
    try:
        return await asyncio.wait_for(_store_beside(node, key, subkey, value, expiration_time), timeout)
    except asyncio.TimeoutError:
        return False


async def _store_beside(node: DHTNode, key: str, subkey: Any, value: Any, expiration_time: float) -> bool:
    protocol = node.protocol
    key_id = DHTID.generate(source=key)
    beside = DHTID(int(key_id) ^ 1)
    serving = not protocol.client_mode  # a client's own storage is asked by nobody: it is no replica
    found = await node.find_nearest_nodes([beside], k_nearest=NUM_REPLICAS, exclude_self=not serving, **STORE_TRAVERSAL)
    serializer, validator = protocol.serializer, protocol.record_validator
    record = DHTRecord(key_id.to_bytes(), serializer.dumps(subkey), serializer.dumps(value), expiration_time)
    if validator is not None:
        record = dataclasses.replace(record, value=validator.sign_value(record))
    stored: List[bool] = []
    calls = []
    nearest = found.get(beside, {})
    routes = routes_of(node)
    if routes is not None:  # the walk names nodes it has not called: reach them all at once, not one after another
        await asyncio.gather(
            *(routes.reach(peer_id) for node_id, peer_id in nearest.items() if node_id != node.node_id)
        )
    for node_id, peer_id in nearest.items():
        if node_id == node.node_id:
            valid = validator is None or validator.validate(record)
            stored.append(bool(valid) and protocol.storage.store(key_id, record.value, expiration_time, subkey=subkey))
        else:
            calls.append(
                protocol.call_store(
                    peer_id, keys=[key_id], values=[record.value], expiration_time=[expiration_time], subkeys=[subkey]
                )
            )
    for answer in await asyncio.gather(*calls):
        stored.append(bool(answer) and all(answer))  # None: no answer; [False]: refused or older than its copy
    return any(stored)


async def known_nodes(_dht: DHT, node: DHTNode) -> int:
    """The nodes in this DHT node's routing table: where its lookups and stores start. It keeps only nodes it
    could call (:mod:`swarm.dht.routes` says how it reaches them); a node that knows few of the swarm's nodes
    stores its records on the nearest of those, where readers that know others may not look. Runs inside the
    DHT process through ``dht.run_coroutine``."""
    return len(node.protocol.routing_table.uid_to_peer_id)


async def _blacklist_nodes_that_answer_junk(_dht: DHT, node: DHTNode) -> None:
    """Runs once in the DHT process: a node whose answer to a lookup holds a value the validators refuse
    (a plain value under a run key, a forged or malformed record) is treated as a node that did not
    answer, so hivemind blacklists it with its backoff (longer each time). hivemind itself only drops
    such values, so a node serving a megabyte of junk under a run key would be asked again on every
    lookup of every reader."""
    reported: set = set()

    def noting(validate):
        def checked(key_bytes: bytes, *args) -> bool:
            valid = validate(key_bytes, *args)
            refused = _REFUSED_IN_ANSWER.get()
            if not valid and refused is not None:
                refused.append(key_bytes)
            return valid

        return checked

    def refusing_junk(call_find):
        async def call_find_refusing_junk(peer_id, keys):
            token = _REFUSED_IN_ANSWER.set([])
            try:
                response = await call_find(peer_id, keys)
                refused = _REFUSED_IN_ANSWER.get()
            finally:
                _REFUSED_IN_ANSWER.reset(token)
            if not refused:
                return response
            if peer_id not in reported and len(reported) < 10_000:
                reported.add(peer_id)
                logger.warning(
                    f"DHT node {peer_id} answered a lookup with {len(refused)} invalid values; not asking "
                    f"it for a while (longer each time it does so again)"
                )
            return None  # as if it had not answered: the caller blacklists it

        return call_find_refusing_junk

    wrap_dht_protocol(node.protocol, wrap_call_find=refusing_junk, wrap_validation=noting)


async def blacklisted_peers(_dht: DHT, node: DHTNode) -> List[str]:
    """The peers this DHT node does not ask now (for ``dht.run_coroutine``: tests and diagnostics)."""
    return [str(peer_id) for peer_id, _ in node.blacklist.banned_peers.items()]
