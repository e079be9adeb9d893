"""The links of a multi-rank ``pipemesh profile`` (:class:`NetworkProfile`, the ``links.network`` of a profile
file), and which rate and message latency a plan uses: the user's flag, else the profile's measurement, else the
default (:func:`chosen_rate`, :func:`chosen_latency`).

Pure: standard library only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Sequence, Tuple


P2P_PATTERNS = ("p2p", "p2p both ways", "shared NIC")
"""Patterns of point-to-point flows (:attr:`LinkPoint.flows`): one flow alone, the same pair both directions at
once, and every rank of one node sending to another node at once (the flows share the node's NIC)."""
ROUND_TRIP = "round trip"
"""A message and its answer (:attr:`LinkPoint.flows` both ways, one after the other), each repeat after the link
idled :data:`ROUND_TRIP_IDLE_S`: twice the fixed time of one message (:attr:`NetworkProfile.latency_us`)."""
ROUND_TRIP_BYTES = 4
"""The message of a :data:`ROUND_TRIP`: one float, so that its time is the per-message part only."""
ROUND_TRIP_IDLE_S = 0.02
"""How long the link idles before each round trip: a pipeline's message follows a forward or backward of
milliseconds, and on CPU ranks a message after an idle spell takes 2-3x one sent back to back (gloo's threads wake
up: 0.15 ms one way back to back, 0.4 ms after 20-100 ms, the bench's NICs, ``scripts/nic_burst_check.py``)."""
COLLECTIVES = {"all-reduce": 2.0, "reduce-scatter": 1.0, "all-gather": 1.0, "all-to-all": 1.0}
"""Collectives timed, with the factor that turns their algorithm bandwidth into bus bandwidth over ``g`` ranks:
``factor * (g - 1) / g`` (nccl-tests' convention: the rate each rank's link carries in a ring; an all-to-all's
(g - 1)/g of the message leaves each rank, the MoE token dispatch's pattern)."""
BETWEEN_NODES, WITHIN_NODE, ALL_RANKS, ONE_NODE = "between nodes", "within a node", "all ranks", "one node"
"""Scopes of a :class:`LinkPoint`: p2p between two nodes or inside one; a collective over every rank or over the
ranks of one node."""


@dataclass(frozen=True)
class LinkPoint:
    """One communication pattern timed at one message size."""

    pattern: str
    """One of :data:`P2P_PATTERNS`, :data:`ROUND_TRIP` or :data:`COLLECTIVES`."""
    scope: str
    """:data:`BETWEEN_NODES` or :data:`WITHIN_NODE` (p2p); :data:`ALL_RANKS` or :data:`ONE_NODE` (collectives)."""
    ranks: Tuple[int, ...]
    """The ranks taking part."""
    flows: Tuple[Tuple[int, int], ...]
    """(source, destination) of every flow started at once (p2p); () for a collective."""
    nbytes: int
    """Bytes of each flow (p2p), or of the whole tensor (a collective: all-reduce's input, reduce-scatter's input,
    all-gather's output)."""
    seconds: Tuple[float, ...]
    """Every timed repeat: from a barrier to the last participating rank's completion (a :data:`ROUND_TRIP`: the
    initiator's message and answer, after the link idled)."""
    gbps: float
    """From the median: each flow's payload rate, Gbit/s (p2p); the bus bandwidth (a collective,
    :data:`COLLECTIVES`)."""

    @property
    def median_s(self) -> float:
        ordered = sorted(self.seconds)
        middle = len(ordered) // 2
        return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2

    def to_dict(self) -> dict:
        return {"pattern": self.pattern, "scope": self.scope, "ranks": list(self.ranks),
                "flows": [list(flow) for flow in self.flows], "nbytes": self.nbytes, "seconds": list(self.seconds),
                "gbps": self.gbps}

    @staticmethod
    def from_dict(data: Mapping) -> "LinkPoint":
        return LinkPoint(pattern=str(data["pattern"]), scope=str(data["scope"]),
                         ranks=tuple(int(r) for r in data["ranks"]),
                         flows=tuple((int(a), int(b)) for a, b in data["flows"]), nbytes=int(data["nbytes"]),
                         seconds=tuple(float(t) for t in data["seconds"]), gbps=float(data["gbps"]))


def link_gbps(pattern: str, nbytes: int, seconds: float, group: int) -> float:
    """The rate :attr:`LinkPoint.gbps` reports for ``pattern`` moving ``nbytes`` in ``seconds`` over ``group``
    ranks."""
    rate = nbytes * 8 / seconds / 1e9
    if pattern in COLLECTIVES:
        return rate * COLLECTIVES[pattern] * (group - 1) / group
    return rate


@dataclass(frozen=True)
class NetworkProfile:
    """The links measured between the ranks of a multi-rank ``pipemesh profile`` (torchrun, Slurm)."""

    nic_gbps: Optional[float]
    """One node's NIC per direction, Gbit/s (what ``--nic-gbps`` means); None: all ranks were on one node."""
    nic_from: str
    """How :attr:`nic_gbps` was derived: the shared flows' sum, or one flow between nodes alone ('' when None)."""
    intra_node_gbps: Optional[float]
    """One flow between two ranks of a node, Gbit/s (what ``--intra-node-gbps`` means); None: one rank per node."""
    backend: str
    """'nccl' or 'gloo'."""
    node_of_rank: Tuple[int, ...]
    """The node of every rank (ranks with the same hostname and network namespace share one)."""
    sizes: Dict[str, int]
    """The message sizes timed, bytes: 'activation' (one micro-batch's activation) and 'bucket'."""
    warmup: int
    """Untimed calls of every pattern before its repeats."""
    points: Tuple[LinkPoint, ...]
    """Every pattern timed (:class:`LinkPoint`)."""

    @property
    def nodes(self) -> int:
        return len(set(self.node_of_rank))

    @property
    def alltoall_intra_gbps(self) -> Optional[float]:
        """The all-to-all rate of a node's ranks (bytes leaving a rank per second, Gbit/s) at the largest message
        timed: how fast a MoE dispatch inside a node runs; None where no node's ranks were timed alone."""
        scope = ALL_RANKS if self.nodes == 1 else ONE_NODE
        found = [point for point in self.points if point.pattern == "all-to-all" and point.scope == scope]
        return max(found, key=lambda point: point.nbytes).gbps if found and len(self.node_of_rank) > 1 else None

    @property
    def latency_us(self) -> Optional[float]:
        """The fixed time of one message, microseconds: half the median :data:`ROUND_TRIP` between nodes (the links
        a pipeline's waits stretch on), else inside one; None: no round trip timed (a file from before)."""
        point = self.round_trip
        return point.median_s / 2 * 1e6 if point is not None else None

    @property
    def round_trip(self) -> Optional[LinkPoint]:
        """The :data:`ROUND_TRIP` :attr:`latency_us` comes from."""
        found = {point.scope: point for point in self.points if point.pattern == ROUND_TRIP}
        return found.get(BETWEEN_NODES) or found.get(WITHIN_NODE)

    def to_dict(self) -> dict:
        return {"nic_gbps": self.nic_gbps, "nic_from": self.nic_from, "intra_node_gbps": self.intra_node_gbps,
                "backend": self.backend, "node_of_rank": list(self.node_of_rank), "sizes": dict(self.sizes),
                "warmup": self.warmup, "points": [point.to_dict() for point in self.points]}

    @staticmethod
    def from_dict(data: Mapping) -> "NetworkProfile":
        return NetworkProfile(nic_gbps=_optional_float(data["nic_gbps"]), nic_from=str(data.get("nic_from", "")),
                              intra_node_gbps=_optional_float(data["intra_node_gbps"]), backend=str(data["backend"]),
                              node_of_rank=tuple(int(n) for n in data["node_of_rank"]),
                              sizes={str(k): int(v) for k, v in data["sizes"].items()}, warmup=int(data["warmup"]),
                              points=tuple(LinkPoint.from_dict(point) for point in data["points"]))


def _optional_float(value) -> Optional[float]:
    return None if value is None else float(value)


def network_rates(points: Sequence[LinkPoint]) -> Tuple[Optional[float], str, Optional[float]]:
    """(NIC Gbit/s, how it was derived, intra-node Gbit/s) from the largest message's points: the NIC is the sum of
    the flows sharing it where they were timed (one flow may not fill a fast NIC), else one flow between nodes
    alone; the intra-node rate is one flow inside a node alone. None where no such point was timed."""

    def largest(pattern: str, scope: str) -> Optional[LinkPoint]:
        found = [point for point in points if point.pattern == pattern and point.scope == scope]
        return max(found, key=lambda point: point.nbytes) if found else None

    shared, alone = largest("shared NIC", BETWEEN_NODES), largest("p2p", BETWEEN_NODES)
    inside = largest("p2p", WITHIN_NODE)
    if shared is not None:
        nic, source = shared.gbps * len(shared.flows), (f"{len(shared.flows)} flows sharing a NIC, summed "
                                                        f"({shared.nbytes} bytes each)")
    elif alone is not None:
        nic, source = alone.gbps, f"one flow between nodes alone ({alone.nbytes} bytes)"
    else:
        nic, source = None, ""
    return nic, source, inside.gbps if inside is not None else None


@dataclass(frozen=True)
class LinkRate:
    """The rate of one link a plan uses, and where it came from."""

    name: str
    """'NIC', 'intra-node', 'host link'."""
    flag: str
    """The ``pipemesh plan`` flag that sets it."""
    gbps: Optional[float]
    """The rate used, Gbit/s (None: neither given nor measured, and no default)."""
    source: str
    """'given' (the flag), 'measured' (the profile), 'default' (the flag's default) or 'missing'."""
    measured_gbps: Optional[float] = None
    """What the profile measured, also when the flag overrides it."""
    origin: str = ""
    """Where a default came from, when not the flag's own (e.g. the device table's interconnect)."""

    @property
    def measured(self) -> bool:
        return self.source == "measured"

    def origin_text(self) -> str:
        """Where the rate came from, without the rate."""
        if self.source == "measured":
            return "measured by the profile"
        if self.source == "given":
            also = f"; the profile measured {self.measured_gbps:.4g}" if self.measured_gbps is not None else ""
            return f"{self.flag}{also}"
        if self.source == "default":
            return f"{self.origin}; {self.flag} to change" if self.origin else f"{self.flag} default"
        return f"not measured and {self.flag} not given"

    def describe(self) -> str:
        if self.source == "measured":
            return f"{self.name} {self.gbps:.4g} Gbit/s measured (profile)"
        if self.source == "given":
            also = f"; the profile measured {self.measured_gbps:.4g}" if self.measured_gbps is not None else ""
            return f"{self.name} {self.gbps:.4g} Gbit/s ({self.flag}, given{also})"
        if self.source == "default":
            where = f"{self.origin}; {self.flag} to change" if self.origin else f"{self.flag} default"
            return f"{self.name} {self.gbps:.4g} Gbit/s ({where}, not measured)"
        return f"{self.name}: not measured and {self.flag} not given"


def chosen_rate(name: str, flag: str, given: Optional[float], measured: Optional[float],
                default: Optional[float], origin: str = "") -> LinkRate:
    """The rate of ``name`` a plan uses: the flag ``given`` wins, else what a profile ``measured``, else
    ``default`` (from ``origin`` where that is not the flag's own default)."""
    if given is not None:
        return LinkRate(name, flag, given, "given", measured)
    if measured is not None:
        return LinkRate(name, flag, measured, "measured", measured)
    if default is not None:
        return LinkRate(name, flag, default, "default", origin=origin)
    return LinkRate(name, flag, None, "missing")


@dataclass(frozen=True)
class MessageLatency:
    """The fixed time of one message a plan uses (:attr:`.costs.ClusterSpec.latency_us`), and where it came from."""

    us: float
    """Microseconds per pipeline transfer and collective step."""
    source: str
    """How it was chosen, for the plan's assumptions ('the default, not measured', '--latency-us', 'measured ...')."""


def chosen_latency(given: Optional[float], network: Optional[NetworkProfile], default: float) -> MessageLatency:
    """The message latency a plan uses: the flag ``given`` wins, else what the profile's ``network`` measured, else
    ``default``."""
    point = network.round_trip if network is not None else None
    measured = network.latency_us if point is not None else None
    if given is not None:
        also = f"; the profile measured {measured:.4g} us" if measured is not None else ""
        return MessageLatency(float(given), f"--latency-us{also}")
    if measured is not None:
        return MessageLatency(measured, f"measured by the profile: half a {point.nbytes}-byte round trip {point.scope} "
                                        f"(ranks {point.ranks[0]} and {point.ranks[1]}, {network.backend}), each after "
                                        f"the link idled {ROUND_TRIP_IDLE_S * 1e3:g} ms")
    return MessageLatency(default, "the default, not measured (--latency-us to set it, or a profile launched on "
                                   "several ranks to measure it)")
