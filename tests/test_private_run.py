"""Live: a private run trains with its allowlisted peers and trainer, and refuses an outsider's stage calls."""

from __future__ import annotations

import pytest
import torch
from hivemind.p2p import P2P, PeerID

from swarm.dht.identity import load_or_create_identity
from swarm.net.rpc import RemoteError, call_peer
from tests.utils.processes import FAST_PEER


@pytest.mark.long
async def test_private_run_trains_members_and_refuses_outsiders(launcher, tmp_path):
    names = ("organiser", "stage0", "stage1", "trainer")
    keys = {name: load_or_create_identity(str(tmp_path / f"{name}.key")) for name in names}
    allowlist = ", ".join(keys[name].peer_id for name in names)
    manifest = tmp_path / "run.yaml"
    manifest.write_text(f"run_id: {launcher.run_id}\nnum_stages: 2\ntarget_batch_size: 32\n"
                        f"model: {{num_layers: 2, hidden_size: 32, num_heads: 2, seq_len: 16}}\nallowlist: [{allowlist}]\n")
    boot = launcher.start("bootstrap", ["--manifest", str(manifest), "--identity_path", keys["organiser"].path],
                          name="organiser")
    address = boot.wait_event("bootstrap_ready", timeout=60)["join"]
    peers = {stage: launcher.start("peer", ["--join", address, "--stage", str(stage), "--identity_path",
                                            keys[f"stage{stage}"].path, *FAST_PEER], name=f"stage{stage}")
             for stage in (0, 1)}
    ready = {stage: peer.wait_event("peer_ready", timeout=90) for stage, peer in peers.items()}
    trainer = launcher.start("train", ["--join", address, "--identity_path", keys["trainer"].path, "--max_samples", "64",
                                       "--batch_size", "8", "--max_data_mb", "2", "--refresh_period_s", "0.5"],
                             name="trainer")
    assert trainer.wait_event("trainer_done", timeout=120)["samples_sent"] == 64

    # an outsider that knows a member's address reaches it over libp2p, but every stage call is refused
    outsider = await P2P.create(initial_peers=ready[0]["maddrs"], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        for _ in range(3):
            with pytest.raises(RemoteError) as error:
                await call_peer(outsider, PeerID.from_base58(ready[0]["peer_id"]), "forward",
                                {"stage": 0, "inputs": torch.randint(0, 256, (2, 16))}, timeout=20)
            assert error.value.kind == "unauthorized", error.value
    finally:
        await outsider.shutdown()
    log = peers[0].log_tail(400)
    assert log.count(str(outsider.peer_id)) == 1, "an outsider is reported once, however often it calls"
