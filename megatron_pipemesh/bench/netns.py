"""Network namespaces shaped with ``tc``: an emulated commodity network on one machine.

Two topologies (:attr:`Shaping.per_rank`):

* **per rank** (default): one VM per rank. Every rank runs in its own namespace ``NAME-r<rank>`` whose only
  interface ``eth0`` is one end of a veth pair; the other ends hang on a bridge in the hub namespace ``NAME``
  (which holds the launcher and its rendezvous store at :data:`HUB_ADDRESS`). Each rank's NIC is shaped in both
  directions at the rate, on ``eth0`` (its uplink, behind a ``netem`` delay when one is asked for) and on its
  bridge port (its downlink). Ranks do not share a bucket, as VMs on a switched network do not; a rank's
  data-parallel ring and pipeline links do share its NIC. How concurrent flows share it is
  :attr:`Shaping.nic_queue` (:mod:`.nic_queue`): by default fairly, ``htb`` with one class per peer, else one
  FIFO per direction (a ``tbf``).
* **shared**: all ranks in one namespace talk over its ``lo``, which carries one ``tbf`` (behind the optional
  ``netem``): one token bucket for the *aggregate* traffic of every rank, link and direction.

A worker enters its rank's namespace through :mod:`.rank_netns` (torchrun starts it in the hub namespace).

The commands are built as argument lists by pure functions (tested without running them);
:class:`ShapedNamespace` runs them and always deletes the namespace (``finally``; also on Ctrl-C).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from typing import List, Optional, Sequence

from .nic_queue import NIC_QUEUES, fair_commands, fifo_commands

LOOPBACK_MTU = 65536
"""Linux loopback MTU: a tbf burst below it drops every full-size packet."""

MIN_BURST_BYTES = 4 * LOOPBACK_MTU

VETH_PAYLOAD_FRACTION = 1448 / 1514
"""Share of the shaped rate that carries data on a rank's NIC: tbf counts whole Ethernet frames (1500-byte MTU +
14-byte header) and a full TCP segment holds 1448 bytes (20 IP + 20 TCP + 12 timestamp-option bytes). On the
shared loopback (64 KiB MTU) the headers are negligible."""


class NamespaceError(RuntimeError):
    """The namespace could not be created or shaped (message says why and what to do)."""


_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmg]?)(bit|bps)?\s*$", re.IGNORECASE)


def parse_rate_mbit(text: str) -> float:
    """'200mbit', '1gbit', '500' (Mbit/s) -> Mbit/s. Raises ValueError."""
    match = _RATE_RE.match(str(text))
    if not match:
        raise ValueError(f"cannot read a bandwidth from {text!r}; write e.g. 200mbit, 1gbit or 500 (Mbit/s)")
    value, prefix, unit = float(match.group(1)), match.group(2).lower(), (match.group(3) or "bit").lower()
    scale = {"": 1.0, "k": 1e-3, "m": 1.0, "g": 1e3}[prefix]
    if not match.group(2) and match.group(3):
        scale = 1e-6  # plain "bit"/"bps"
    mbit = value * scale * (8.0 if unit == "bps" else 1.0)
    if mbit <= 0:
        raise ValueError(f"bandwidth {text!r} must be positive")
    return mbit


@dataclass(frozen=True)
class Shaping:
    """How the emulated network is shaped."""

    rate_mbit: float
    """Token-bucket rate (Mbit/s): of each rank's NIC in each direction (``per_rank``), else of the one loopback
    that all traffic shares."""
    delay_ms: float = 0.0
    """One-way delay added by netem to every packet (0: no netem)."""
    burst_bytes: int = MIN_BURST_BYTES
    """Token-bucket size; must be >= 4 x loopback MTU."""
    queue_ms: float = 200.0
    """tbf ``latency``: how long a packet may wait in the queue before being dropped."""
    per_rank: bool = True
    """True: every rank has its own NIC shaped at the rate each way (one namespace per rank, see the module
    docstring); False: every rank shares the loopback of one namespace, one token bucket for all traffic."""
    nic_queue: Optional[str] = None
    """How concurrent flows share a NIC (:data:`~.nic_queue.NIC_QUEUES`): ``fair`` (one htb class per peer) or
    ``fifo`` (one tbf); None: ``fair`` on the per-rank network, ``fifo`` on the shared loopback (one address for
    every rank: no peer to class by)."""

    def __post_init__(self):
        if self.nic_queue is None:
            object.__setattr__(self, "nic_queue", "fair" if self.per_rank else "fifo")
        if self.nic_queue not in NIC_QUEUES:
            raise ValueError(f"NIC queue {self.nic_queue!r} is not one of {', '.join(NIC_QUEUES)}")
        if self.nic_queue == "fair" and not self.per_rank:
            raise ValueError("a fair NIC queue needs the per-rank network: on the shared loopback every rank has the "
                             "same address, so there is no peer to give a class")
        if not self.rate_mbit > 0:
            raise ValueError(f"rate {self.rate_mbit} Mbit/s must be positive")
        if self.delay_ms < 0:
            raise ValueError(f"delay {self.delay_ms} ms must be >= 0")
        if self.burst_bytes < MIN_BURST_BYTES:
            raise ValueError(f"burst {self.burst_bytes} bytes is below 4 x loopback MTU ({MIN_BURST_BYTES}); "
                             "packets would be dropped")
        if not self.queue_ms > 0:
            raise ValueError(f"queue latency {self.queue_ms} ms must be positive")

    @property
    def bytes_per_s(self) -> float:
        return self.rate_mbit * 1e6 / 8

    @property
    def payload_bytes_per_s(self) -> float:
        """Data bytes per second one link carries at the rate (frame headers taken off): what plans and
        predictions see."""
        return self.bytes_per_s * (VETH_PAYLOAD_FRACTION if self.per_rank else 1.0)

    @property
    def payload_burst_bytes(self) -> float:
        """Data bytes a full token bucket passes at once: tc counts the frames' headers against the burst as against
        the rate (a 256 KiB message overruns a 256 KiB burst by 11 KiB, about a millisecond at 100 Mbit/s)."""
        return self.burst_bytes * (VETH_PAYLOAD_FRACTION if self.per_rank else 1.0)

    def describe(self) -> str:
        text = f"{self.rate_mbit:g} Mbit/s " + ("per rank each way" if self.per_rank else "shared by all ranks")
        if self.per_rank:
            text += ", fair share per peer" if self.nic_queue == "fair" else ", one FIFO"
        if self.delay_ms:
            text += f", +{self.delay_ms:g} ms delay"
        return text


def new_namespace_name(prefix: str = "pmbench") -> str:
    """A unique namespace name (pid + random suffix; at most 15 characters is not required for netns)."""
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


SUBNET = "10.213.0"
"""The per-rank topology's /24: rank r is ``SUBNET.(r+1)``, the hub :data:`HUB_ADDRESS` (private to the namespaces)."""
HUB_ADDRESS = f"{SUBNET}.254"
"""The hub namespace's bridge address: torchrun's rendezvous store (``--master-addr``) in the per-rank topology."""
RANK_INTERFACE = "eth0"
"""A rank namespace's one interface (its NIC): what gloo binds to there (``GLOO_SOCKET_IFNAME``)."""
BRIDGE = "pmbr0"
MAX_RANKS = 250
"""Ranks the per-rank topology's /24 holds (1..250; .254 is the hub)."""


def rank_namespace(name: str, rank: int) -> str:
    """The namespace of ``rank`` in the per-rank topology whose hub is ``name``."""
    return f"{name}-r{rank}"


def rank_address(rank: int) -> str:
    """Rank ``rank``'s address on the per-rank network."""
    return f"{SUBNET}.{rank + 1}"


def _nic_commands(namespace: str, dev: str, shaping: Shaping, own: int, ranks: int, match: str,
                  delay: bool) -> List[List[str]]:
    """One direction of rank ``own``'s NIC (``dev`` in ``namespace``): its queue discipline at the rate, behind the
    netem delay when ``delay`` and one is asked for; ``match`` says which address names the peer (``dst`` on the
    uplink, ``src`` on the downlink)."""
    delay_ms = shaping.delay_ms if delay else 0.0
    if shaping.nic_queue == "fifo":
        return fifo_commands(namespace, dev, shaping.rate_mbit, shaping.burst_bytes, shaping.queue_ms, delay_ms)
    peers = {q: rank_address(q) for q in range(ranks) if q != own}
    return fair_commands(namespace, dev, shaping.rate_mbit, shaping.burst_bytes, shaping.queue_ms, peers, match,
                         delay_ms)


def _ip(namespace: str, *args: str) -> List[str]:
    return ["ip", "netns", "exec", namespace, "ip", *args]


def setup_commands(name: str, shaping: Optional[Shaping], ranks: int = 0) -> List[List[str]]:
    """The commands that create namespace ``name`` with loopback up and (when given) shaped; with a per-rank
    ``shaping``, also the bridge and the ``ranks`` rank namespaces with their shaped NICs."""
    cmds = [["ip", "netns", "add", name], _ip(name, "link", "set", "lo", "up")]
    if shaping is None:
        return cmds
    if not shaping.per_rank:
        return cmds + fifo_commands(name, "lo", shaping.rate_mbit, shaping.burst_bytes, shaping.queue_ms,
                                    shaping.delay_ms)
    if not 1 <= ranks <= MAX_RANKS:
        raise ValueError(f"the per-rank network holds 1..{MAX_RANKS} ranks, not {ranks}")
    cmds += [_ip(name, "link", "add", BRIDGE, "type", "bridge"),
             _ip(name, "addr", "add", f"{HUB_ADDRESS}/24", "dev", BRIDGE), _ip(name, "link", "set", BRIDGE, "up")]
    for rank in range(ranks):
        own, port = rank_namespace(name, rank), f"v{rank}"
        cmds += [["ip", "netns", "add", own], _ip(own, "link", "set", "lo", "up"),
                 # created in the hub, its peer moved into the rank's namespace at once
                 _ip(name, "link", "add", port, "type", "veth", "peer", "name", RANK_INTERFACE, "netns", own),
                 _ip(name, "link", "set", port, "master", BRIDGE), _ip(name, "link", "set", port, "up"),
                 _ip(own, "addr", "add", f"{rank_address(rank)}/24", "dev", RANK_INTERFACE),
                 _ip(own, "link", "set", RANK_INTERFACE, "up")]
        # uplink (with the one-way delay) and downlink, each at the rate
        cmds += (_nic_commands(own, RANK_INTERFACE, shaping, rank, ranks, "dst", delay=True)
                 + _nic_commands(name, port, shaping, rank, ranks, "src", delay=False))
    return cmds


def teardown_commands(name: str, ranks: int = 0) -> List[List[str]]:
    """Delete the rank namespaces (their veth pairs go with them), then the hub."""
    return [["ip", "netns", "delete", rank_namespace(name, r)] for r in range(ranks)] + [["ip", "netns", "delete", name]]


def exec_prefix(name: str) -> List[str]:
    """Prefix of a command that runs inside the namespace."""
    return ["ip", "netns", "exec", name]


def permission_problem() -> Optional[str]:
    """None when this process can create namespaces; otherwise a sentence saying why not."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if shutil.which("tc") is None:
        return "the `tc` command (iproute2) is not installed"
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return "creating a network namespace and shaping it with tc needs root (CAP_NET_ADMIN + CAP_SYS_ADMIN)"
    return None


def _run(cmd: Sequence[str]) -> None:
    result = subprocess.run(list(cmd), capture_output=True, text=True)
    if result.returncode != 0:
        raise NamespaceError(f"`{' '.join(cmd)}` failed (exit {result.returncode}): "
                             f"{(result.stderr or result.stdout).strip()}")


class ShapedNamespace:
    """Context manager: create + shape on enter, delete on exit (also after errors and Ctrl-C)."""

    def __init__(self, shaping: Optional[Shaping], name: Optional[str] = None, runner=_run, ranks: int = 0):
        self.shaping, self.name, self._run = shaping, name or new_namespace_name(), runner
        self.ranks = ranks if (shaping is not None and shaping.per_rank) else 0
        """Rank namespaces (per-rank topology; 0 for the shared one)."""
        self.created = False

    def __enter__(self) -> "ShapedNamespace":
        problem = permission_problem()
        if problem:
            raise NamespaceError(f"cannot emulate the slow network: {problem}. Run as root, or pass --unshaped "
                                 "to benchmark over the plain loopback (no shaping)")
        try:
            for i, cmd in enumerate(setup_commands(self.name, self.shaping, self.ranks)):
                self._run(cmd)
                if i == 0:
                    self.created = True
        except BaseException:
            self.close()
            raise
        return self

    def prefix(self) -> List[str]:
        """Runs a command in the (hub) namespace: the launcher, or every rank in the shared topology."""
        return exec_prefix(self.name)

    @property
    def rank_namespaces(self) -> Optional[str]:
        """The name whose ``-r<rank>`` namespaces the workers enter (:mod:`.rank_netns`); None: shared topology."""
        return self.name if self.ranks else None

    def close(self) -> None:
        if self.created:
            self.created = False
            for cmd in teardown_commands(self.name, self.ranks):  # each one tried: a rank's may not exist yet
                try:
                    self._run(cmd)
                except NamespaceError:
                    pass

    def __exit__(self, *exc) -> None:
        self.close()
