"""The queue of one emulated NIC, as ``tc`` commands (built by pure functions; :mod:`.netns` runs them).

Two disciplines (:data:`NIC_QUEUES`, the bench's ``--nic-queue``):

* ``fifo``: one token-bucket filter (``tbf``) at the rate, one FIFO for every flow through the NIC. Concurrent
  flows share it as TCP happens to share a FIFO: a bulk flow can hold a short one behind its queue.
* ``fair`` (the per-rank network's default): ``htb`` with one class per peer of the rank, each with an equal
  guaranteed rate (the NIC's rate / classes) and the whole rate as ceiling, so concurrent flows to (on the
  downlink: from) different peers get equal shares and a lone flow gets the whole NIC. A ``u32`` filter matches
  the peer's address: the destination on the rank's uplink, the source on its downlink. Two more classes of the
  same size take pure TCP acknowledgements and what no filter matches (the hub's rendezvous store, ARP). Every class
  queues at most what ``tbf`` would (the rate x the queue time + the burst), so both disciplines drop at the same
  depth. This kernel has no ``fq``, ``sfq``, ``fq_codel`` or ``prio``; ``htb`` with ``u32`` it has.

  Why acknowledgements have a class: gloo uses one TCP connection per pair of ranks for both directions, so the
  acknowledgements of a flow 2 -> 0 leave rank 0 in the class of peer 2, behind rank 0's own data to 2, and arrive
  through rank 0's downlink class of peer 2, behind 2's data. Queued up to 200 ms there, they stretch the flow's
  round trip and it stops filling its share (measured: a 2 MiB pipeline send next to a ring all-reduce took 0.32 to
  0.57 s where its fair share gives 0.35 s). A cloud NIC's queue is not that deep; in their own class (far below its
  guaranteed rate, so always served first) the acknowledgements pass at once and each flow gets its share.

With a one-way delay a ``netem`` qdisc is the root and the shaper its only child, for either discipline.
"""
from __future__ import annotations

from typing import List, Mapping

NIC_QUEUES = ("fair", "fifo")
"""``--nic-queue`` values: fair-share classes per peer (default on the per-rank network), or one FIFO."""

ROOT_CLASS_MINOR = 0x1
OTHER_CLASS_MINOR = 0x2
"""The class of traffic no peer filter matches (the hub, ARP): the htb ``default``."""
ACK_CLASS_MINOR = 0x3
"""The class of pure TCP acknowledgements (see the module docstring)."""
PURE_ACK_MATCH = ("match", "ip", "protocol", "6", "0xff",  # TCP
                  "match", "u8", "0x05", "0x0f", "at", "0",  # an IPv4 header without options (20 bytes)
                  "match", "u16", "0x0000", "0xff80", "at", "2",  # the whole packet under 128 bytes
                  "match", "u8", "0x10", "0xff", "at", "33")  # TCP flags: ACK alone
"""u32 selectors of a pure TCP acknowledgement: no payload (a 52-byte ACK with timestamps, SACK blocks within 128
bytes), only the ACK flag set."""
PEER_CLASS_BASE = 0x10
"""Peer rank q's class minor is ``PEER_CLASS_BASE + q`` (tc writes class minors in hex): ``tc -s class show``
names each peer's class after its rank."""
HTB_QUANTUM_BYTES = 2 * 65536
"""Bytes a class may send per round when classes borrow from the root: equal for every class, so borrowed
bandwidth is split equally, and above a whole GSO packet (64 KiB) so that one round moves at least one."""


def rate_arg(mbit: float) -> str:
    """tc's spelling of a rate in Mbit/s (kbit, whole)."""
    return f"{mbit * 1000:.0f}kbit"


def _tc(namespace: str, *args: str) -> List[str]:
    return ["ip", "netns", "exec", namespace, "tc", *args]


def _shaper_parent(namespace: str, dev: str, delay_ms: float) -> List[List[str]]:
    """The netem root when a delay is asked for (the shaper then hangs at ``parent 1:1``), else nothing."""
    if delay_ms > 0:
        return [_tc(namespace, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", f"{delay_ms:g}ms")]
    return []


def fifo_commands(namespace: str, dev: str, rate_mbit: float, burst_bytes: int, queue_ms: float,
                  delay_ms: float = 0.0) -> List[List[str]]:
    """One ``tbf`` at the rate on ``dev`` of ``namespace`` (behind the netem delay when ``delay_ms`` > 0)."""
    tbf = ["tbf", "rate", rate_arg(rate_mbit), "burst", str(burst_bytes), "latency", f"{queue_ms:g}ms"]
    where = ["parent", "1:1", "handle", "10:"] if delay_ms > 0 else ["root"]
    return _shaper_parent(namespace, dev, delay_ms) + [_tc(namespace, "qdisc", "add", "dev", dev, *where, *tbf)]


def class_id(minor: int) -> str:
    """An htb class of the fair queue (handle ``10:``; the minor in hex, as tc reads it)."""
    return f"10:{minor:x}"


def queue_limit_bytes(rate_mbit: float, burst_bytes: int, queue_ms: float) -> int:
    """The bytes a ``tbf`` of the same rate, burst and latency holds before dropping: the depth of each class."""
    return int(rate_mbit * 1e6 / 8 * queue_ms / 1e3) + burst_bytes


def fair_commands(namespace: str, dev: str, rate_mbit: float, burst_bytes: int, queue_ms: float,
                  peers: Mapping[int, str], match: str, delay_ms: float = 0.0) -> List[List[str]]:
    """``htb`` on ``dev`` of ``namespace``: a root class at the rate, one class per peer rank of ``peers`` (rank ->
    address; ``match`` ``dst`` on an uplink, ``src`` on a downlink) and one default class, each
    guaranteed rate / classes and allowed the whole rate, each with a byte FIFO as deep as :func:`fifo_commands`'
    queue (behind the netem delay when ``delay_ms`` > 0); pure TCP acknowledgements in a class of their own of the
    same size (matched first)."""
    if match not in ("dst", "src"):
        raise ValueError(f"a peer class matches the peer's address as 'dst' (uplink) or 'src' (downlink), not {match!r}")
    where = ["parent", "1:1", "handle", "10:"] if delay_ms > 0 else ["root", "handle", "10:"]
    cmds = _shaper_parent(namespace, dev, delay_ms)
    cmds.append(_tc(namespace, "qdisc", "add", "dev", dev, *where, "htb", "default", f"{OTHER_CLASS_MINOR:x}"))
    sizes = ["burst", str(burst_bytes), "cburst", str(burst_bytes), "quantum", str(HTB_QUANTUM_BYTES)]
    whole = rate_arg(rate_mbit)
    cmds.append(_tc(namespace, "class", "add", "dev", dev, "parent", "10:", "classid", class_id(ROOT_CLASS_MINOR),
                    "htb", "rate", whole, "ceil", whole, *sizes))
    minors = [OTHER_CLASS_MINOR, ACK_CLASS_MINOR] + [PEER_CLASS_BASE + rank for rank in sorted(peers)]
    share = rate_arg(rate_mbit / len(minors))
    limit = str(queue_limit_bytes(rate_mbit, burst_bytes, queue_ms))
    for minor in minors:
        cmds += [_tc(namespace, "class", "add", "dev", dev, "parent", class_id(ROOT_CLASS_MINOR), "classid",
                     class_id(minor), "htb", "rate", share, "ceil", whole, *sizes),
                 _tc(namespace, "qdisc", "add", "dev", dev, "parent", class_id(minor), "bfifo", "limit", limit)]
    cmds.append(_tc(namespace, "filter", "add", "dev", dev, "parent", "10:", "protocol", "ip", "prio", "1", "u32",
                    *PURE_ACK_MATCH, "flowid", class_id(ACK_CLASS_MINOR)))
    for rank in sorted(peers):
        cmds.append(_tc(namespace, "filter", "add", "dev", dev, "parent", "10:", "protocol", "ip", "prio", "2", "u32",
                        "match", "ip", match, f"{peers[rank]}/32", "flowid", class_id(PEER_CLASS_BASE + rank)))
    return cmds
