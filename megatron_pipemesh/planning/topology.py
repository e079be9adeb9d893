"""Where a pipeline replica's transfers run: resources (one direction of a link, with a capacity) and the
route of every transfer the simulator models, from a :class:`.costs.ClusterSpec` and the pipeline size.

Layout (Megatron's rank order tp-cp-ep-dp-pp): device g = r*t*c*d + (k*c + j)*t + tau for pipeline rank r,
data-parallel rank k, context-parallel rank j (c = CP) and tensor-parallel rank tau; its node is
g // ``devices_per_node``. The data-parallel ring runs over the d*c ranks of a stage (Megatron reduces gradients over
DP x CP). The simulator runs
one pipeline replica, and every data-parallel replica and tensor-parallel rank runs the same program at the
same time, so each transfer it simulates stands for that many device-level transfers: their number through
a resource is the transfer's weight there (the NIC of a server holding one stage's 4 devices carries a
pipeline send of weight 4).

Resources (each direction its own, full duplex):

* ``nic-out n`` / ``nic-in n`` (``nic_gbps``): a node's NIC, shared by every transfer leaving / entering the
  node: pipeline sends to a stage on another node, data-parallel ring hops across nodes, the tied
  embedding's all-reduce; with ``nic_burst_bytes``, a token bucket of that burst. One per group of pipeline ranks on
  one node (a node holds several stages when t*d divides into it; otherwise a stage spans several alike nodes, and one
  stands for them all).
* Without a NIC (``nic_gbps`` None) those transfers run on links of their own, ``p2p a->b`` per directed
  pipeline link (``p2p_gbps``) and ``dp r`` per rank (``dp_gbps``): nothing else shares them.
* ``intra-out r`` / ``intra-in r`` (``intra_node_gbps``): a device's link to the other devices of its node, for
  pipeline sends between stages of one node and ring hops inside it. Without ``intra_node_gbps`` those run at
  their class's rate on the links of their own above.
* ``d2h r`` / ``h2d r`` (``host_link_gbps``): a device's host link: its OFFLOAD / RELOAD copies, and with
  ``nic_via_host`` (no GPUDirect RDMA: NCCL stages network traffic in host memory) every transfer it sends
  over the NIC (device to host) or receives from it (host to device).

* ``cpu cores`` (``shared_cores`` C, in cores: core-seconds per second) and ``cpu threads r`` (t*d cores): ranks
  that share the CPU cores of one host (:attr:`.costs.ClusterSpec.shared_cores`). Pipeline rank r's compute
  stands for the t*d processes of its stage, one thread each: a flow of weight t*d on the host's cores and on its
  own threads (so a lone process never runs faster than one core). With ``pinned_cores``: ``cpu core k`` (one
  core) instead, on which the t*d processes of every pipeline rank r with r % C = k run.

Routes: a pipeline send crosses the sender's egress and the receiver's ingress. A data-parallel collective of
rank r crosses rank r's own egress and ingress: each ring hop goes to the next replica, which runs the same
program, so the ring is symmetric and one flow stands for it, at the rate of its slowest hop (NIC or
intra-node). The tied embedding's all-reduce between the first and the last stage is a send each way.
Tensor-parallel collectives run on the compute stream (:data:`tp_gbps` prices them alone): inside a node
over the intra-node link, across nodes at a device's share of the NIC. A compute op on shared cores
(:meth:`Topology.compute_route`) is a flow whose work is its seconds at one full core, so its lone pace is
min(1, C / (t*d)) of a core (1 / (t*d) when pinned): e.g. pipeline ranks 0 and 1 of PP = 2 x DP = 2 on 2 cores
each run at 2 / 4 = 0.5 of a core while both compute, and at 1.0 while the other waits.

Pure: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from .network import Demand, FairShareNetwork, RateCache, Route, make_route

GBIT = 1e9 / 8
"""Bytes per second of one Gbit/s."""

CPU = "cpu "
"""Prefix of the resources that are CPU cores (capacity in cores) rather than links (bytes/s)."""


@dataclass(frozen=True)
class Topology:
    """The resources and routes of one pipeline replica (module docstring)."""

    names: Tuple[str, ...]
    """Name of each resource (index = position)."""
    capacity: Tuple[float, ...]
    """Bytes/s of each resource."""
    p2p: Mapping[Tuple[int, int], Route]
    """(src, dst) pipeline rank -> the route of a pipeline send between them (neighbours, and p-1 <-> 0)."""
    dp: Tuple[Optional[Route], ...]
    """Per pipeline rank: the route of its data-parallel collectives (None without data parallelism)."""
    d2h: Tuple[Route, ...]
    """Per pipeline rank: the route of its device-to-host copies."""
    h2d: Tuple[Route, ...]
    """Per pipeline rank: the route of its host-to-device copies."""
    inside: frozenset
    """(src, dst) pipeline links whose devices share a node."""
    tp_gbps: float
    """Rate of one device's tensor-parallel collectives (Gbit/s)."""
    cp_gbps: float
    """Rate of one device's context-parallel exchange (Gbit/s), priced like :attr:`tp_gbps`."""
    slowest_p2p_bytes_per_s: float
    """Lone rate of the slowest pipeline link (bytes/s; inf with one stage)."""
    compute: Tuple[Route, ...] = ()
    """Per pipeline rank: the route of its compute on the shared CPU cores (its lone rate in cores); empty: every
    rank computes on a device of its own."""
    rates: RateCache = field(default_factory=RateCache, compare=False, repr=False)
    """The fair-share rates of every mix of routes met so far, shared by the networks of this topology."""
    burst: Tuple[float, ...] = ()
    """Bytes of each resource's token-bucket burst (:attr:`.costs.ClusterSpec.nic_burst_bytes` on the NICs);
    empty: none has one."""

    def p2p_route(self, src: int, dst: int) -> Route:
        try:
            return self.p2p[src, dst]
        except KeyError:
            raise ValueError(f"no pipeline link from rank {src} to rank {dst}") from None

    def dp_route(self, rank: int) -> Optional[Route]:
        return self.dp[rank]

    def host_route(self, rank: int, offload: bool) -> Route:
        return (self.d2h if offload else self.h2d)[rank]

    def embedding_route(self, src: int, dst: int) -> Route:
        return self.p2p_route(src, dst)

    def compute_route(self, rank: int) -> Optional[Route]:
        """The route of ``rank``'s compute on the shared cores, whose work is seconds at one full core and whose
        lone rate (``lone_bytes_per_s``) is the cores one rank gets alone; None: the rank has a device of its own."""
        return self.compute[rank] if self.compute else None

    def new_network(self) -> FairShareNetwork:
        return FairShareNetwork(self.capacity, self.rates, self.burst or None)

    def burst_s(self, route: Optional[Route]) -> float:
        """The most a flow on ``route`` can save from the token buckets it crosses (seconds at its lone rate): the
        least burst over its resources, per device-level flow; 0 when one has none."""
        if route is None or not self.burst:
            return 0.0
        return min(self.burst[r] / w for r, w in route.demands) / route.lone_bytes_per_s

    def p2p_speedup(self, src: int, dst: int) -> float:
        """How much faster a lone send runs on link (src, dst) than on the slowest pipeline link."""
        return self.p2p_route(src, dst).lone_bytes_per_s / self.slowest_p2p_bytes_per_s

    def describe(self) -> str:
        """One line per resource with its capacity (Gbit/s; CPU cores for the ``cpu`` resources)."""
        return "\n".join(f"{name}: {cap:g} cores" if name.startswith(CPU) else f"{name}: {cap / GBIT:g} Gbit/s"
                         for name, cap in zip(self.names, self.capacity))


class _Builder:
    """Resources by name, created on first use."""

    def __init__(self) -> None:
        self.names: List[str] = []
        self.capacity: List[float] = []
        self.burst: List[float] = []
        self._index: Dict[str, int] = {}

    def __call__(self, name: str, gbps: float, burst: float = 0.0) -> int:
        if name not in self._index:
            if not gbps > 0:
                raise ValueError(f"link {name}: rate must be > 0 Gbit/s, got {gbps}")
            self._index[name] = len(self.names)
            self.names.append(name)
            self.capacity.append(gbps * GBIT)
            self.burst.append(float(burst))
        return self._index[name]

    def cores(self, name: str, cores: float) -> int:
        """A CPU resource of ``cores`` cores (core-seconds per second)."""
        name = CPU + name
        if name not in self._index:
            self._index[name] = len(self.names)
            self.names.append(name)
            self.capacity.append(float(cores))
            self.burst.append(0.0)
        return self._index[name]


def _check_layout(cluster, pp: int) -> None:
    per_stage, node = cluster.tp * cluster.dp_cp, cluster.devices_per_node
    if pp < 1 or node < 1:
        raise ValueError(f"pipeline size {pp} and devices per node {node} must be >= 1")
    if node % per_stage and per_stage % node:
        raise ValueError(f"devices_per_node={node} and a stage's TP x CP x DP = {per_stage} devices: one must divide "
                         f"the other (whole stages per node, or whole nodes per stage), e.g. devices_per_node=8 with "
                         f"TP x CP x DP = 4 or 16")


def _group_gbps(cluster, span: int) -> float:
    """A device's rate in a collective group of consecutive devices spanning ``span`` devices (TP: t; CP: t x cp, its
    members t apart): inside a node over the intra-node link, across nodes at a device's share of the NIC (every
    device of the node exchanges at once)."""
    node = cluster.devices_per_node
    if span <= node:
        return cluster.intra_node_gbps if cluster.intra_node_gbps is not None else cluster.dp_gbps
    return cluster.nic_gbps / node if cluster.nic_gbps is not None else cluster.dp_gbps


@lru_cache(maxsize=256)
def topology(cluster, pp: int) -> Topology:
    """The :class:`Topology` of one pipeline replica of ``pp`` stages on ``cluster`` (a ClusterSpec)."""
    _check_layout(cluster, pp)
    # A stage's DP x CP ranks (Megatron's order tp-cp-dp-pp: index k*cp + c) are alike here: the gradients are
    # reduced over all of them, and each carries its own pipeline transfers.
    t, d, node = cluster.tp, cluster.dp_cp, cluster.devices_per_node
    per_stage = t * d
    add = _Builder()

    def device(rank: int, k: int, tau: int) -> int:
        return rank * per_stage + k * t + tau

    def nic_group(rank: int) -> int:
        """The node (or, for a stage over several nodes, the stage) whose NIC stands for rank's."""
        return rank if per_stage >= node else rank * per_stage // node

    def route(pairs: Sequence[Tuple[int, int]], src: int, dst: int, own: Tuple[str, float]) -> Route:
        """Route of the device transfers ``pairs`` from pipeline rank ``src`` to ``dst``; ``own``: the (name, Gbit/s)
        of the class's own link where no NIC or intra-node rate is described."""
        across = [(a, b) for a, b in pairs if a // node != b // node]
        demands: List[Demand] = []
        own_link = False
        if across:
            if cluster.nic_gbps is not None:
                out: Dict[int, int] = {}
                into: Dict[int, int] = {}
                for a, b in across:
                    out[a // node] = out.get(a // node, 0) + 1
                    into[b // node] = into.get(b // node, 0) + 1
                burst = cluster.nic_burst_bytes
                demands += [(add(f"nic-out {nic_group(src)}", cluster.nic_gbps, burst), max(out.values())),
                            (add(f"nic-in {nic_group(dst)}", cluster.nic_gbps, burst), max(into.values()))]
                if cluster.nic_via_host:
                    demands += [(add(f"d2h {src}", cluster.host_link_gbps), 1), (add(f"h2d {dst}", cluster.host_link_gbps), 1)]
            else:
                own_link = True
        if len(across) < len(pairs):
            if cluster.intra_node_gbps is not None:
                demands += [(add(f"intra-out {src}", cluster.intra_node_gbps), 1),
                            (add(f"intra-in {dst}", cluster.intra_node_gbps), 1)]
            else:
                own_link = True
        if own_link:
            demands.append((add(*own), 1))
        return make_route(demands, add.capacity)

    p2p: Dict[Tuple[int, int], Route] = {}
    inside = set()
    for a in range(pp):
        for b in {(a + 1) % pp, (a - 1) % pp} - {a}:
            pairs = [(device(a, k, tau), device(b, k, tau)) for k in range(d) for tau in range(t)]
            p2p[a, b] = route(pairs, a, b, (f"p2p {a}->{b}", cluster.p2p_gbps))
            if all(x // node == y // node for x, y in pairs):
                inside.add((a, b))
    dp: List[Optional[Route]] = []
    for r in range(pp):
        if d < 2:
            dp.append(None)
            continue
        hops = [(device(r, k, tau), device(r, (k + 1) % d, tau)) for k in range(d) for tau in range(t)]
        dp.append(route(hops, r, r, (f"dp {r}", cluster.dp_gbps)))
    d2h = tuple(make_route([(add(f"d2h {r}", cluster.host_link_gbps), 1)], add.capacity) for r in range(pp))
    h2d = tuple(make_route([(add(f"h2d {r}", cluster.host_link_gbps), 1)], add.capacity) for r in range(pp))
    tp, cp = _group_gbps(cluster, t), _group_gbps(cluster, t * cluster.cp)
    slowest = min((route.lone_bytes_per_s for route in p2p.values()), default=float("inf"))
    compute: Tuple[Route, ...] = ()
    if cluster.shared_cores is not None:
        cores = cluster.shared_cores
        if cluster.pinned_cores:
            compute = tuple(make_route([(add.cores(f"core {r % cores}", 1), per_stage)], add.capacity)
                            for r in range(pp))
        else:
            compute = tuple(make_route([(add.cores("cores", cores), per_stage),
                                        (add.cores(f"threads {r}", per_stage), per_stage)], add.capacity)
                            for r in range(pp))
    return Topology(tuple(add.names), tuple(add.capacity), p2p, tuple(dp), d2h, h2d, frozenset(inside), tp, cp, slowest,
                    compute, burst=tuple(add.burst) if any(add.burst) else ())
