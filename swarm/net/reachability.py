"""Whether other machines can reach this process, checked by asking a peer of the run to dial it back.

A process learns nothing about its own reachability from its outgoing connections: they work from
behind NAT or a firewall too. So a starting peer asks a peer of the run (the ``dial_back`` RPC) to open a
*fresh* connection to each address it announces, from a p2pd of the helper's own that holds no connection
to the caller (the helper's main daemon is already connected to it, and p2pd would reuse that connection),
and to say which addresses answered as the caller's peer id. :func:`decide` turns the answer into what the
user is told and whether the peer serves through a relay; it is pure. The RPC and the check are the I/O.

A peer that cannot be reached serves through a relay: p2pd's circuit relay (v2), with the run's entry points
as the relays (they run the relay service: :data:`RELAY_SERVICE_OPTIONS`) and this peer reserving a slot at
them (:func:`relayed_options`). Its record then announces ``<relay address>/p2p/<relay id>/p2p-circuit``
(:func:`relay_addresses`), which callers dial like any other address.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_logger
from hivemind.utils.multiaddr import Multiaddr

from swarm.hivemind_private import daemon_connect
from swarm.net.addresses import (
    MAX_MADDRS,
    MAX_MADDR_CHARS,
    announceable,
    dialable,
    host_of,
    is_circuit,
    is_loopback,
    listens_on_loopback_only,
    address_peer_id,
    tcp_port,
)

__all__ = [
    "DIAL_BACK_METHOD",
    "DialBackReport",
    "Verdict",
    "decide",
    "needs_check",
    "parse_report",
    "dial_back_handler",
    "dial_back",
    "check_reachability",
    "relay_addresses",
    "relayed_options",
    "RELAY_SERVICE_OPTIONS",
]

logger = get_logger(__name__)

DIAL_BACK_METHOD = "dial_back"
DIAL_TIMEOUT_S = 5.0  # seconds the helper spends connecting to one address
DAEMON_START_TIMEOUT_S = 15.0  # seconds the helper waits for its fresh p2pd
CHECK_TIMEOUT_S = DAEMON_START_TIMEOUT_S + MAX_MADDRS * DIAL_TIMEOUT_S + 5.0  # seconds one dial-back call may take
MAX_HELPERS = 3  # run peers asked, one after the other, until one answers
MAX_CONCURRENT_CHECKS = 4  # dial-backs one helper runs at once (each starts a p2pd); more callers hear 'busy'
BUSY_RETRIES = 3  # times a caller asks a busy helper again
BUSY_BACKOFF_S = 2.0  # seconds before the first retry, doubled for each next one
MAX_REASON_CHARS = 200  # one failed address's reason, as reported

# p2pd settings of a process that others use as a relay: libp2p runs the relay service only on a host it
# believes publicly reachable, and with a handful of peers AutoNAT may never conclude that
RELAY_SERVICE_OPTIONS: Dict[str, Any] = {"force_reachability": "public"}


@dataclass(frozen=True)
class DialBackReport:
    """What a helper saw when it dialed the caller: addresses that answered as the caller, and why the others failed."""

    helper: str
    reachable: Tuple[str, ...] = ()
    failed: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Verdict:
    """What the user is told about reachability, and what the peer does about it.

    ``status``: "reachable", "unreachable", "local" (listens on loopback only: one machine's swarm) or
    "unknown" (nobody could check). ``ports_to_open``: TCP ports to forward to this machine."""

    status: str
    message: str
    addresses: Tuple[str, ...] = ()
    ports_to_open: Tuple[int, ...] = ()
    use_relay: bool = False


def needs_check(host_maddrs: Sequence[str]) -> bool:
    """Whether a dial-back check means anything: not for a process that listens on loopback only."""
    return not listens_on_loopback_only(host_maddrs)


def _ports(maddrs: Sequence[str]) -> Tuple[int, ...]:
    return tuple(sorted({port for port in map(tcp_port, maddrs) if port}))


def decide(
    announced: Sequence[str], host_maddrs: Sequence[str], report: Optional[DialBackReport], error: str = ""
) -> Verdict:
    """What to tell the user about whether other machines can reach this process, and whether to serve
    through a relay, from the addresses it announces (relay addresses excluded), those it listens on, and
    a helper's dial-back ``report`` (None if no helper answered; ``error`` says why)."""
    if not needs_check(host_maddrs):
        return Verdict(
            "local",
            f"listening on loopback only ({', '.join(host_maddrs)}): only processes on this "
            f"machine can reach it; to serve other machines listen with "
            f"--host_maddrs /ip4/0.0.0.0/tcp/PORT",
        )
    fixed = all(tcp_port(m) for m in host_maddrs if "/tcp/" in str(m))
    ports = _ports(host_maddrs) or _ports(announced)
    if fixed and ports:
        open_hint = (
            f"open TCP port {', '.join(map(str, ports))} to this machine (forward it on your router or "
            f"firewall) and pass --announce_maddrs /ip4/<your public IP>/tcp/{ports[0]}"
        )
    else:
        got = f"; this time it got port {', '.join(map(str, ports))}, a new one at every start" if ports else ""
        open_hint = (
            f"listen on a fixed port (--host_maddrs /ip4/0.0.0.0/tcp/PORT{got}), open it to this machine "
            f"(forward it on your router or firewall) and announce it "
            f"(--announce_maddrs /ip4/<your public IP>/tcp/PORT)"
        )
    if not announced:
        return Verdict(
            "unreachable",
            f"NOT reachable from other machines: it has no address others could dial "
            f"(loopback and container-bridge addresses are never announced); {open_hint}. "
            f"Serving through a relay meanwhile (slower).",
            ports_to_open=ports,
            use_relay=True,
        )
    if report is None:
        return Verdict(
            "unknown",
            f"could not check whether other machines can reach {', '.join(announced)}: "
            f"{error or 'no peer of the run answered'}",
            addresses=tuple(announced),
        )
    if report.reachable:
        failed = [a for a in announced if a not in report.reachable]
        extra = f" (not at {', '.join(failed)})" if failed else ""
        return Verdict(
            "reachable",
            f"reachable from other machines: {report.helper} connected to it at {', '.join(report.reachable)}{extra}",
            addresses=tuple(report.reachable),
        )
    reasons = "; ".join(f"{a}: {report.failed.get(a, 'no answer')}" for a in announced)
    return Verdict(
        "unreachable",
        f"NOT reachable from other machines: {report.helper} could not connect to it "
        f"({reasons}). To serve directly, {open_hint}. Serving through a relay "
        f"meanwhile (slower).",
        addresses=tuple(announced),
        ports_to_open=ports,
        use_relay=True,
    )


def parse_report(helper: str, reply: Mapping[str, Any], asked: Sequence[str]) -> DialBackReport:
    """A helper's reply as a report; only addresses the caller asked about count. ``ValueError`` if malformed."""
    reachable, failed = reply.get("reachable"), reply.get("failed")
    if not isinstance(reachable, list) or not isinstance(failed, dict):
        raise ValueError(f"malformed dial-back reply from {helper}: {sorted(reply)[:8]}")
    asked = list(asked)
    return DialBackReport(
        helper,
        tuple(a for a in asked if a in reachable),
        {a: str(failed[a])[:MAX_REASON_CHARS] for a in asked if a in failed and a not in reachable},
    )


# ---- the helper's side ----


def _asked_addresses(message: Mapping[str, Any]) -> List[str]:
    maddrs = message.get("maddrs")
    if not isinstance(maddrs, list) or not 0 < len(maddrs) <= MAX_MADDRS:
        raise ValueError(f"maddrs must be a list of 1 to {MAX_MADDRS} multiaddrs")
    if not all(isinstance(m, str) and len(m) <= MAX_MADDR_CHARS for m in maddrs):
        raise ValueError(f"every maddr must be a string of at most {MAX_MADDR_CHARS} characters")
    return list(dict.fromkeys(maddrs))


def _reason(text: str, error: BaseException, timeout_s: float) -> str:
    """Why p2pd could not dial ``text``: its line of p2pd's "all dials failed" list, else the whole error."""
    if isinstance(error, asyncio.TimeoutError):
        return f"no answer within {timeout_s:.0f} s"
    lines = [line.strip(" *") for line in str(error).splitlines() if line.strip()]
    parsed = dialable([text])
    mine = [line.split("] ", 1)[-1] for line in lines if parsed and f"[{parsed[0]}]" in line]
    return (mine or lines[-1:] or [type(error).__name__])[0][:MAX_REASON_CHARS]


async def dial_back(peer_id: str, maddrs: Sequence[str], dial_timeout_s: float = DIAL_TIMEOUT_S) -> Dict[str, Any]:
    """Connect to ``peer_id`` at ``maddrs`` from a fresh p2pd: {"reachable": [the address its connection
    took], "failed": {address: why}}. One connect for all addresses: p2pd dials them all at once, and a
    second connect from the same daemon would reuse what the first one found."""
    asked = [text for text in maddrs if dialable([text]) and not is_circuit(dialable([text])[0])]
    failed: Dict[str, Any] = {text: "not a direct address this peer can dial" for text in maddrs if text not in asked}
    if not asked:
        return {"reachable": [], "failed": failed}
    target = PeerID.from_base58(peer_id)
    p2p = await P2P.create(use_relay=False, auto_nat=False, nat_port_map=False, startup_timeout=DAEMON_START_TIMEOUT_S)
    try:
        try:
            await asyncio.wait_for(daemon_connect(p2p, target, [dialable([t])[0] for t in asked]), dial_timeout_s)
        except Exception as e:  # refused, unroutable, timed out, another peer id answered
            return {"reachable": [], "failed": {**failed, **{text: _reason(text, e, dial_timeout_s) for text in asked}}}
        used = {
            str(addr)
            for info in await asyncio.wait_for(p2p.list_peers(), dial_timeout_s)
            if info.peer_id == target
            for addr in info.addrs
        }
        reachable = [text for text in asked if str(dialable([text])[0]) in used] or asked[:1]
        return {"reachable": reachable, "failed": failed}
    finally:
        await p2p.shutdown()


def dial_back_handler():
    """An :class:`swarm.net.rpc.RPCServicer` handler that dials its caller back. At most
    :data:`MAX_CONCURRENT_CHECKS` at a time (each starts a p2pd): a caller beyond is told 'busy'."""
    from swarm.net.rpc import RemoteError

    running = [0]

    async def handle(message: Dict[str, Any], caller: str) -> Dict[str, Any]:
        maddrs = _asked_addresses(message)
        if running[0] >= MAX_CONCURRENT_CHECKS:
            raise RemoteError("checking other peers' reachability; ask again soon", "busy")
        running[0] += 1
        try:
            return await asyncio.wait_for(dial_back(caller, maddrs), CHECK_TIMEOUT_S - 2.0)
        finally:
            running[0] -= 1

    return handle


# ---- the caller's side ----


async def check_reachability(
    p2p: P2P, helpers: Sequence[str], announced: Sequence[str]
) -> Tuple[Optional[DialBackReport], str]:
    """Ask the peers at ``helpers`` (multiaddrs ending in /p2p/<id>), one after the other, to dial ``announced``
    back; the first answer's report, or (None, why nobody answered)."""
    from swarm.net.rpc import RemoteError, call_peer

    own, errors = str(p2p.peer_id), []
    candidates = [pid for pid in dict.fromkeys(map(address_peer_id, helpers)) if pid and pid != own][:MAX_HELPERS]
    for helper in candidates:
        for attempt in range(BUSY_RETRIES + 1):
            try:
                reply = await call_peer(
                    p2p,
                    PeerID.from_base58(helper),
                    DIAL_BACK_METHOD,
                    {"maddrs": list(announced)},
                    timeout=CHECK_TIMEOUT_S,
                )
                return parse_report(helper, reply, announced), ""
            except RemoteError as e:
                if e.kind == "busy" and attempt < BUSY_RETRIES:
                    await asyncio.sleep(BUSY_BACKOFF_S * 2**attempt)
                    continue
                errors.append(f"{helper}: {e.kind}: {str(e)[:MAX_REASON_CHARS]}")
            except Exception as e:  # an old peer without the method, gone, timed out: ask the next one
                errors.append(f"{helper}: {type(e).__name__}: {str(e)[:MAX_REASON_CHARS]}")
            break
    return None, "; ".join(errors) if errors else "no peer of the run to ask (no --initial_peers)"


async def own_verdict(
    p2p: P2P, host_maddrs: Sequence[str], announced: Sequence[str], helpers: Sequence[str]
) -> Verdict:
    """Check (when it means anything) and decide."""
    direct = [a for a in announced if not is_circuit(Multiaddr(a))]
    if not needs_check(host_maddrs) or not direct:
        return decide(direct, host_maddrs, None)
    report, error = await check_reachability(p2p, helpers, direct)
    return decide(direct, host_maddrs, report, error)


# ---- relaying ----


def relay_addresses(relays: Sequence[str]) -> List[str]:
    """The addresses a relayed peer announces: ``<relay>/p2p-circuit`` for each relay multiaddr (with its
    peer id), loopback relays left out, at most :data:`MAX_MADDRS`."""
    circuits = [f"{r}/p2p-circuit" for r in relays if address_peer_id(r) and not is_loopback(host_of(Multiaddr(r)))]
    return announceable(circuits, listens_on_any=True)


def relayed_options(relays: Sequence[str]) -> Dict[str, Any]:
    """p2pd settings of a peer that others cannot reach: reserve a slot at ``relays`` so that they reach it
    through them, and never wait for AutoNAT to find out what the dial-back check already did. The identity
    is not checked for being in use: this peer's previous p2pd, which had it, just stopped."""
    return {
        "use_auto_relay": True,
        "use_relay": True,
        "force_reachability": "private",
        "trusted_relays": list(relays),
        "check_if_identity_free": False,
    }
