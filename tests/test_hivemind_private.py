"""Every private name of hivemind that swarm.hivemind_private uses is there, with the parameters it is called
with: an upgrade of hivemind that renames or drops one fails here, naming it, rather than deep in a live run."""

import asyncio

import pytest
import torch
from hivemind import DHT, DecentralizedAverager
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.p2p import P2P
from hivemind.utils.crypto import RSAPrivateKey

from swarm.hivemind_private import PRIVATE_ATTRIBUTES, PrivateAttribute, PrivateAverager, missing_private_attributes

CLASS_LEVEL = [a for a in PRIVATE_ATTRIBUTES if not a.instance]
INSTANCE_LEVEL = [a for a in PRIVATE_ATTRIBUTES if a.instance]


@pytest.mark.parametrize("attribute", CLASS_LEVEL, ids=lambda a: a.label)
def test_class_level_private_attribute_is_there(attribute):
    assert missing_private_attributes(attribute) == ""


@pytest.fixture(scope="module")
def live_objects():
    """A P2P and a started averager; the averager's private state exists only in its background process."""
    dht = DHT(start=True)
    averager = PrivateAverager([torch.zeros(4)], dht=dht, prefix="private_api_test", target_group_size=2,
                               start=True)
    loop = asyncio.new_event_loop()
    p2p = loop.run_until_complete(P2P.create())
    try:
        yield p2p, averager
    finally:
        averager.shutdown()
        loop.run_until_complete(p2p.shutdown())
        loop.close()
        dht.shutdown()


async def _report_private_state(self, names, future) -> None:
    """Runs in the averager's background process: which of ``names`` its averager or matchmaking has."""
    owners = {"DecentralizedAverager": self, "Matchmaking": getattr(self, "_matchmaking", None)}
    future.set_result({f"{owner}.{name}": hasattr(owners[owner], name) for owner, name in names})


PrivateAverager._report_private_state = _report_private_state  # a probe installed only by this test module


def _present_in_background(averager: PrivateAverager) -> dict:
    from hivemind.utils import MPFuture

    future = MPFuture()
    names = [(a.owner.__name__, a.name) for a in INSTANCE_LEVEL if a.owner in (DecentralizedAverager, Matchmaking)]
    averager.call_in_background("_report_private_state", names=names, future=future)
    return future.result(timeout=30)


@pytest.mark.parametrize("attribute", INSTANCE_LEVEL, ids=lambda a: a.label)
def test_instance_level_private_attribute_is_there(attribute: PrivateAttribute, live_objects):
    p2p, averager = live_objects
    if attribute.owner is P2P:
        assert missing_private_attributes(attribute, p2p) == ""
    elif attribute.owner is RSAPrivateKey:
        assert missing_private_attributes(attribute, RSAPrivateKey()) == ""
    else:
        present = _present_in_background(averager)[f"{attribute.owner.__name__}.{attribute.name}"]
        assert present, f"{attribute.label} is gone from hivemind: swarm.hivemind_private relies on it"


def test_a_missing_attribute_is_named():
    class Bare:
        def method(self, other):
            pass

    assert "Bare.gone is gone" in missing_private_attributes(PrivateAttribute(Bare, "gone"))
    assert "no longer takes ['peer_id']" in missing_private_attributes(PrivateAttribute(Bare, "method", ("peer_id",)))
    assert missing_private_attributes(PrivateAttribute(Bare, "method", ("other",))) == ""


def test_subclasses_of_an_averager_with_an_rpc_name_keep_it():
    """An emulated faulty replica (a subclass) serves and calls its RPCs under the name honest replicas use."""
    class Honest(PrivateAverager):
        RPC_NAME = "Honest"

    class Faulty(Honest):
        pass

    assert Faulty._get_handle_name("run_stage0", "rpc_download_state") == "run_stage0::Honest.rpc_download_state"
    assert Faulty._get_handle_name(None, "rpc_join_group") == Honest._get_handle_name(None, "rpc_join_group")
    assert PrivateAverager._get_handle_name(None, "rpc_join_group") == "PrivateAverager.rpc_join_group"
