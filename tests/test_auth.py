"""Private runs: the allowlist decisions, the DHT authorizer, and the stage averager, each with the defence on
and off."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import subprocess
import sys
from typing import Iterator, List, Optional

import pytest
import torch
from hivemind import DHT
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.p2p import PeerID
from hivemind.proto import dht_pb2
from hivemind.utils import get_dht_time

from swarm.dht.auth import (Allowlist, AllowlistAuthorizer, NonceCache, authorize_peer, authorizer_for, check_freshness,
                        check_membership)
from swarm.config.settings import NetworkConfig, RunConfig
from swarm.dht.node import start_dht
from swarm.dht.identity import load_or_create_identity, peer_id_of
from swarm.dht.manifest import ManifestError, fetch_manifest, publish_manifest, sign_manifest
from swarm.model.gpt import ModelConfig
from swarm.dht.records import manifest_key
from swarm.server.averaging import StageAverager
from tests.utils.processes import REPO
from tests.utils.waiting import await_until

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


@pytest.fixture(scope="module")
def identities():
    return [load_or_create_identity(None) for _ in range(3)]


# ---- pure decisions ----


def test_allowlist_and_decisions():
    a, b = "QmTNt6JBYk8n4F1TNzRzBtUcFdoMN3Qd8kk3eFcE9ceH2F", "QmSVhxLwnszVKvM7KueiorWvv5BAfLMyW7fEQ9bfYGN4ne"
    assert Allowlist().allows(a) and Allowlist().is_open
    private = Allowlist.of([a])
    assert private.allows(a) and private.allows(PeerID.from_base58(a)) and not private.allows(b)
    assert authorize_peer(private, a, a).ok
    assert "not in the run's allowlist" in authorize_peer(private, b, b).reason
    assert "its key belongs to" in authorize_peer(private, a, b).reason  # claims a, holds b's key
    assert not authorize_peer(private, a, None).ok
    assert check_freshness(100.0, 130.0, max_skew_s=60).ok and check_freshness(130.0, 100.0, max_skew_s=60).ok
    assert not check_freshness(100.0, 161.0, max_skew_s=60).ok and not check_freshness(float("nan"), 100.0).ok
    assert check_membership(Allowlist(), None).ok
    assert "--identity_path" in check_membership(private, None).reason
    assert b in check_membership(private, b).reason and check_membership(private, a).ok


def test_nonce_cache_refuses_replays_and_stays_bounded():
    cache = NonceCache(ttl_s=10, max_size=3)
    assert cache.add(b"n1", now=0) and not cache.add(b"n1", now=1)
    for i in range(10):
        assert cache.add(f"x{i}".encode(), now=2)
    assert len(cache) == 3
    assert cache.add(b"n1", now=100)  # long forgotten: its message would be refused as stale anyway


def _authorizer(identity, allowed) -> AllowlistAuthorizer:
    return AllowlistAuthorizer(identity.private_key, identity.peer_id, Allowlist.of(i.peer_id for i in allowed),
                               peer_id_of)


async def test_authorizer_accepts_members_and_refuses_outsiders_replays_and_tampering(identities):
    alice, bob, mallory = identities
    server, client = _authorizer(alice, [alice, bob]), _authorizer(bob, [alice, bob])
    outsider = _authorizer(mallory, [alice, bob, mallory])  # signs correctly, but is not on alice's list

    async def signed_ping(authorizer) -> dht_pb2.PingRequest:
        request = dht_pb2.PingRequest(validate=True)
        await authorizer.sign_request(request, None)
        return request

    request = await signed_ping(client)
    replay = dht_pb2.PingRequest.FromString(request.SerializeToString())
    assert await server.validate_request(request)
    assert not await server.validate_request(replay), "a replayed request must be refused"
    assert not await server.validate_request(await signed_ping(outsider))

    tampered = await signed_ping(client)
    tampered.validate = False
    assert not await server.validate_request(tampered)
    stale = dht_pb2.PingRequest()
    await client.sign_request(stale, None)
    stale.auth.time, stale.auth.signature = get_dht_time() - 3600, b""
    stale.auth.signature = bob.private_key.sign(stale.SerializeToString())
    assert not await server.validate_request(stale)
    impostor = await signed_ping(outsider)  # mallory's key under bob's name
    impostor.auth.client_access_token.username = bob.peer_id
    assert not await server.validate_request(impostor)

    request = await signed_ping(client)
    response = dht_pb2.PingResponse(available=True)
    await server.sign_response(response, request)
    assert await client.validate_response(dht_pb2.PingResponse.FromString(response.SerializeToString()), request)
    foreign = dht_pb2.PingResponse(available=True)
    await outsider.sign_response(foreign, request)
    assert not await client.validate_response(foreign, request)
    assert not await client.validate_response(response, await signed_ping(client)), "answers another request"


# ---- live DHT: an outsider can neither read nor write the run's keys through a member ----


async def _find_through(peer: str, key: str, _dht: DHT, node) -> Optional[bool]:
    """Runs in the DHT process: ask ``peer`` directly for ``key``; None if it refused to answer."""
    response = await node.protocol.call_find(PeerID.from_base58(peer), [DHTID.generate(source=key)])
    if response is None:
        return None
    value, _nearest = response[DHTID.generate(source=key)]
    return value is not None


def _tiny_run(run_id: str, allowlist: List[str]) -> RunConfig:
    return RunConfig(run_id=run_id, num_stages=2, model=ModelConfig(num_layers=2, hidden_size=32, num_heads=2,
                                                                    seq_len=16), allowlist=allowlist)


@contextlib.contextmanager
def shutting_down(items: list) -> Iterator[list]:
    try:
        yield items
    finally:
        for item in reversed(items):
            item.shutdown()


@pytest.mark.parametrize("defended", [True, False], ids=["allowlist", "open"])
async def test_outsider_cannot_read_or_write_the_run_dht(identities, defended):
    alice, bob, mallory = identities
    run_id = f"auth_dht_{int(defended)}"
    members = [alice.peer_id, bob.peer_id] if defended else []
    dhts: list = []
    with shutting_down(dhts):
        first = start_dht(NetworkConfig(host_maddrs=LOOPBACK), run_id=run_id, num_stages=2, identity=alice,
                          authorizer=authorizer_for(members, alice))
        dhts.append(first)
        maddrs = [str(a) for a in first.get_visible_maddrs()]
        dhts.append(start_dht(NetworkConfig(initial_peers=maddrs, host_maddrs=LOOPBACK), run_id=run_id, num_stages=2,
                              identity=bob, authorizer=authorizer_for(members, bob)))
        second = dhts[-1]
        # mallory signs every message properly and lists itself: only the members' lists decide
        outsider_auth = _authorizer(mallory, [alice, bob, mallory]) if defended else None
        dhts.append(DHT(initial_peers=maddrs, host_maddrs=LOOPBACK, identity_path=mallory.path, start=True,
                        record_validators=[RSASignatureValidator(mallory.private_key)], authorizer=outsider_auth,
                        ensure_bootstrap_success=False))
        outsider = dhts[-1]

        assert await publish_manifest(first, sign_manifest(_tiny_run(run_id, members), alice, revision=1), 60)
        assert (await fetch_manifest(second, run_id, alice.peer_id)).organiser == alice.peer_id
        await publish_manifest(outsider, sign_manifest(_tiny_run(run_id, []), mallory, revision=2), 60)
        direct = outsider.run_coroutine(functools.partial(_find_through, alice.peer_id, manifest_key(run_id)))
        if defended:
            assert direct is None, "a member must not answer an outsider's request"
            with pytest.raises(ManifestError, match="no manifest"):
                await fetch_manifest(outsider, run_id, alice.peer_id)
            with pytest.raises(ManifestError, match="no manifest"):
                await fetch_manifest(second, run_id, mallory.peer_id)
        else:  # the harm the allowlist prevents: the outsider reads the run and writes into it
            assert direct is True
            assert (await fetch_manifest(outsider, run_id, alice.peer_id)).organiser == alice.peer_id
            assert (await fetch_manifest(second, run_id, mallory.peer_id)).organiser == mallory.peer_id


# ---- the stage averager: members average, an outsider is refused ----


AVERAGING_PREFIX = "auth_test_stage0"


def _averager(dht: DHT, value: float, allowlist: List[str]) -> StageAverager:
    tensor = torch.full((4,), value)
    return StageAverager([tensor], lambda: ({"value": value}, [tensor]), allowlist=allowlist, dht=dht, start=True,
                         prefix=AVERAGING_PREFIX, min_group_size=2, target_group_size=3, min_matchmaking_time=1.5,
                         request_timeout=0.75, allreduce_timeout=10, next_chunk_timeout=3, allow_state_sharing=True,
                         declare_state_period=0.5, initial_group_bits="0" * 16)


def state_declarations(dht: DHT) -> int:
    """How many averagers ``dht`` sees declared as state donors (hivemind's ``<prefix>.all_averagers`` key,
    one subkey per averager): what ``load_state_from_peers`` picks a donor from."""
    found = dht.get(f"{AVERAGING_PREFIX}.all_averagers", latest=True)
    return len(found.value) if found is not None and isinstance(found.value, dict) else 0


async def assert_refuses_group_with_outsider(averager: StageAverager, peer_ids: List[PeerID]) -> None:
    """A group that a (misconfigured) leader assembled with an outsider is refused before any tensor moves,
    and groupmates waiting for this averager's parts are failed at once."""
    group = GroupInfo(group_id=b"group-with-outsider", peer_ids=tuple(peer_ids), gathered=(b"", b""))
    waiting = asyncio.get_running_loop().create_future()
    averager._running_groups[group.group_id] = waiting
    try:
        with pytest.raises(MatchmakingException, match="not in the allowlist"):
            await averager._aggregate_with_group(group, min_vector_size=0)
        assert waiting.done() and isinstance(waiting.exception(), MatchmakingException)
    finally:
        averager._running_groups.pop(group.group_id, None)


@pytest.mark.parametrize("defended", [True, False], ids=["allowlist", "open"])
async def test_stage_averager_refuses_an_outsider(defended, caplog):
    dhts: list = []
    averagers: list = []
    with shutting_down(dhts), shutting_down(averagers):
        dhts.append(DHT(host_maddrs=LOOPBACK, start=True))
        maddrs = [str(a) for a in dhts[0].get_visible_maddrs()]
        dhts += [DHT(initial_peers=maddrs, host_maddrs=LOOPBACK, start=True) for _ in range(2)]
        members = [str(dht.peer_id) for dht in dhts[:2]] if defended else []
        averagers += [_averager(dhts[0], 1.0, members), _averager(dhts[1], 3.0, members), _averager(dhts[2], 100.0, [])]
        # every averager's state-sharing declaration has reached the DHT, as seen from each node
        await await_until(lambda: all(state_declarations(dht) == len(averagers) for dht in dhts), 30,
                          "every averager's state declaration")

        results = await asyncio.gather(*(averager.average(0, [torch.full((4,), value)], samples=1, gather={},
                                                          matchmaking_timeout=4, timeout=10)
                                         for averager, value in zip(averagers, (1.0, 3.0, 100.0))))
        loop = asyncio.get_running_loop()
        outsider_state = await loop.run_in_executor(None, lambda: averagers[2].load_state_from_peers(timeout=5))
        if defended:
            for result in results[:2]:
                assert result is not None and torch.equal(result.tensors[0], torch.full((4,), 2.0, dtype=torch.float64))
                assert sorted(result.gathered) == sorted(members), "the outsider took part in the group"
            assert results[2] is None, "the outsider's join must fail"
            assert outsider_state is None, "the outsider downloaded a member's state"
            member_state = await loop.run_in_executor(None, lambda: averagers[1].load_state_from_peers(timeout=5))
            assert member_state is not None and member_state[0]["value"] in (1.0, 100.0)
            with caplog.at_level(logging.WARNING):
                for _ in range(3):
                    assert not averagers[0]._allowed(dhts[2].peer_id, "a test call")
            assert caplog.text.count(f"refusing a test call from {dhts[2].peer_id}") == 1
            await assert_refuses_group_with_outsider(averagers[0], [dhts[0].peer_id, dhts[2].peer_id])
        else:  # the harm the allowlist prevents: the outsider's tensor is averaged in, its download succeeds
            averaged = [r.tensors[0][0].item() for r in results[:2] if r is not None]
            assert averaged and all(abs(value - 104.0 / 3) < 1e-4 for value in averaged), results
            assert outsider_state is not None


# ---- a private run, end to end through the CLI: a volunteer outside the allowlist is told why ----


def test_private_run_refuses_a_volunteer_outside_the_allowlist(launcher, tmp_path):
    organiser = load_or_create_identity(str(tmp_path / "organiser.key"))
    volunteer = load_or_create_identity(str(tmp_path / "volunteer.key"))
    manifest = tmp_path / "run.yaml"
    manifest.write_text(f"run_id: {launcher.run_id}\nnum_stages: 2\n"
                        "model: {num_layers: 2, hidden_size: 32, num_heads: 2, seq_len: 16}\n"
                        f"allowlist: [{organiser.peer_id}]\n")
    boot = launcher.start("bootstrap", ["--manifest", str(manifest), "--identity_path", organiser.path],
                          name="organiser")
    address = boot.wait_event("bootstrap_ready", timeout=60)["join"]
    for extra, expected in (([], "--identity_path"), (["--identity_path", volunteer.path], volunteer.peer_id)):
        result = subprocess.run([sys.executable, "-m", "peers.cli", "peer", "--join", address, *extra], cwd=REPO,
                                capture_output=True, text=True, timeout=90)
        assert result.returncode == 1, result.stderr
        assert "private" in result.stderr and expected in result.stderr and "Traceback" not in result.stderr
    # the organiser's DHT refuses a node outside the allowlist outright
    with pytest.raises(RuntimeError, match="ensure_bootstrap_success"):
        start_dht(NetworkConfig(initial_peers=[address], host_maddrs=LOOPBACK, startup_timeout_s=15),
                  identity=volunteer)
    assert boot.proc.poll() is None, "the organiser must keep running"
