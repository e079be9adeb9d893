"""Max-min fair sharing of network links: the one model of concurrent transfers.

A *resource* is one direction of a link with a capacity in bytes/s: a rank's NIC egress or ingress, a
device's host link in one direction, an intra-node link. A *flow* crosses some resources, each with a
*weight*: how many identical device-level flows it stands for there (the simulator runs one pipeline
replica and folds its symmetric peers in: a stage whose 4 devices all send through one server's NIC is one
flow of weight 4 on that NIC). Rates are max-min fair per device-level flow, by progressive filling: every
unfrozen flow's rate grows at the same pace; a resource saturates when the weighted sum of its flows' rates
reaches its capacity, and freezes them. A lone flow gets min over its resources of capacity / weight;
two flows through one resource and nothing else get half each; a flow held back at the receiver's
ingress leaves the rest of the sender's egress to the sender's other flows.

Rates change only when a flow starts or ends, and only for the flows connected to it through shared resources
(max-min rates are set per connected component); :class:`FairShareNetwork` then re-rates that component (from a
cache of the mixes of routes met before) and gives a new end only to the flows whose pace changed.

Used by the simulator's engine (:mod:`..schedule.timeline`, through the costs' :class:`.topology.Topology`)
and by the bench's network check, which measures real flows against :func:`fair_share_finish_times` and
:func:`collective_with_flows_finish_times` (so it checks the simulator's own model).

Pure: no torch.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Dict, Hashable, Iterable, List, Mapping, Optional, Sequence, Tuple

Demand = Tuple[int, float]
"""(resource index, weight) of one flow on one resource."""

SATURATED = 1e-9
"""Relative capacity left below which a resource counts as saturated (float slack of progressive filling)."""


@dataclass(frozen=True)
class Flow:
    """One point-to-point transfer between two ranks, each rank with its own egress and ingress."""

    src: int
    """Sending rank (its egress carries the flow)."""
    dst: int
    """Receiving rank (its ingress carries the flow)."""
    nbytes: float
    """Bytes moved."""
    start_s: float = 0.0
    """When the transfer starts (seconds)."""


@dataclass(frozen=True)
class Route:
    """The resources one flow crosses, and its rate when it is alone on them."""

    demands: Tuple[Demand, ...]
    """(resource index, weight) pairs, one per resource, weights > 0."""
    lone_bytes_per_s: float
    """Rate of the flow alone on its resources: the least capacity / weight."""


def make_route(demands: Iterable[Demand], capacity: Sequence[float]) -> Route:
    """A :class:`Route` over ``capacity`` (bytes/s per resource); a resource named twice adds its weights."""
    merged: Dict[int, float] = {}
    for resource, weight in demands:
        if not 0 <= resource < len(capacity):
            raise ValueError(f"resource {resource} is not one of the {len(capacity)} resources")
        if not weight > 0:
            raise ValueError(f"a flow's weight on resource {resource} must be > 0, got {weight}")
        merged[resource] = merged.get(resource, 0.0) + float(weight)
    if not merged:
        raise ValueError("a route needs at least one resource")
    pairs = tuple(sorted(merged.items()))
    return Route(pairs, min(capacity[r] / w for r, w in pairs))


def max_min_rates(routes: Sequence[Sequence[Demand]], capacity: Sequence[float]) -> List[float]:
    """Max-min fair rate (bytes/s per device-level flow) of each route's flow when all run at once
    (progressive filling, the rule of the module docstring)."""
    rates = [0.0] * len(routes)
    left = {r: capacity[r] for route in routes for r, _ in route}
    live = list(range(len(routes)))
    level = 0.0
    while live:
        load: Dict[int, float] = {}
        for i in live:
            for r, w in routes[i]:
                load[r] = load.get(r, 0.0) + w
        step, tightest = min((left[r] / w, r) for r, w in load.items())
        level += step
        saturated = {tightest}
        for r, w in load.items():
            left[r] -= step * w
            if left[r] <= SATURATED * capacity[r]:
                saturated.add(r)
        keep = []
        for i in live:
            if any(r in saturated for r, _ in routes[i]):
                rates[i] = level
            else:
                keep.append(i)
        live = keep
    return rates


class _Active:
    """A flow in a :class:`FairShareNetwork`: the work left (seconds at its lone rate) at ``since``."""

    __slots__ = ("token", "route", "left", "since", "pace", "version")

    def __init__(self, token: Hashable, route: int, work_s: float, now: float):
        self.token, self.route = token, route
        self.left, self.since = work_s, now
        self.pace = 0.0
        """Fraction of its lone rate the flow gets (0 until rated)."""
        self.version = 0
        """The sequence number of its latest end on the heap (0: none yet); flows reuse tokens, so ends are
        matched by this, never by token alone."""


Paces = Dict[int, float]
"""Route id -> the fraction of its lone rate each of its flows gets."""


class RateCache:
    """Fair-share paces per mix of routes (how many flows of each run, in one connected component), with the
    route ids they are keyed by: one per set of resources, shared by every network on them
    (:class:`.topology.Topology` keeps one)."""

    LIMIT = 200_000
    """Mixes kept at most (a bound on memory; past it new mixes are computed each time)."""

    def __init__(self) -> None:
        self.ids: Dict[Route, int] = {}
        self.routes: List[Route] = []
        self.paces: Dict[tuple, Paces] = {}

    def route_id(self, route: Route) -> int:
        rid = self.ids.get(route)
        if rid is None:
            rid = self.ids[route] = len(self.routes)
            self.routes.append(route)
        return rid


class FairShareNetwork:
    """Flows on shared resources in simulated time: :meth:`start` at the current time, then :meth:`pop` the
    next completions (advancing the clock), or :meth:`advance` the clock to another event first.

    A flow's size is its *work*: the seconds it would take alone (its bytes over its route's lone rate), so
    that a flow alone on its resources ends exactly ``work`` after its start.

    Speed (the simulator's inner loop): a flow that starts on resources no running flow crosses gets its lone
    rate at once, and one that ends there changes no other rate, so neither re-rates anything. Otherwise only the
    connected component of the resources it starts or frees is re-rated (the routes running there, and those
    sharing a resource with them, transitively). Flows of one route are alike, so a component's rates depend only
    on how many flows of each of its routes run; they are computed once per such mix and kept in ``cache`` (pass
    one :class:`RateCache` to every network on the same resources: :class:`.topology.Topology` does), as are the
    paces of every mix of all running routes met (a schedule's steady state repeats them: one look-up, no search
    of components), and only the flows whose pace changes get a new end. Starts and ends at one instant are rated
    together, when the clock next moves."""

    def __init__(self, capacity: Sequence[float], cache: Optional[RateCache] = None,
                 burst: Optional[Sequence[float]] = None):
        if any(not c > 0 for c in capacity):
            raise ValueError(f"every resource needs a capacity > 0 bytes/s, got {list(capacity)}")
        if burst is not None and (len(burst) != len(capacity) or any(not b >= 0 for b in burst)):
            raise ValueError(f"burst needs one value >= 0 bytes per resource ({len(capacity)}), got {list(burst)}")
        self.capacity = tuple(float(c) for c in capacity)
        self.now = 0.0
        # Token buckets (tc tbf): a resource holds up to its burst in tokens, refilled at its capacity while it carries
        # nothing; a flow starting where every resource it crosses holds tokens passes that many bytes at once.
        self._burst = tuple(float(b) for b in burst) if burst is not None and any(burst) else None
        self._tokens = list(self._burst) if self._burst is not None else []
        self._idle_since = [0.0] * len(self.capacity)
        self._cache = RateCache() if cache is None else cache
        self._routes = self._cache.routes
        self._flows: Dict[Hashable, _Active] = {}
        self._of_route: Dict[int, Dict[Hashable, _Active]] = {}
        self._counts: Dict[int, int] = {}  # route id -> flows running on it
        self._load = [0] * len(self.capacity)  # flows running through each resource
        self._on: List[Dict[int, None]] = [{} for _ in self.capacity]  # resource -> route ids running through it
        self._pace: Dict[int, float] = {}  # route id -> the pace its rated flows run at
        self._fresh: List[_Active] = []  # started since the last rating
        self._touched: List[int] = []  # resources whose flows' rates may have changed since the last rating
        self._dirty = False
        self._ends: List[Tuple[float, int, Hashable]] = []  # (end, seq, token); stale when seq != the flow's version
        self._seq = 0

    def __len__(self) -> int:
        return len(self._flows)

    def advance(self, t: float) -> None:
        """Move the clock to ``t`` (no flow may end before it: call :meth:`pop` first)."""
        if t < self.now:
            raise ValueError(f"the network's clock is at {self.now}; it cannot go back to {t}")
        if t > self.next_time():
            raise ValueError(f"a flow ends at {self.next_time()}, before {t}: pop it first")
        self.now = t

    def start(self, token: Hashable, route: Route, work_s: float) -> None:
        """Start a flow of ``work_s`` seconds alone (>= 0) on ``route`` now."""
        if token in self._flows:
            raise ValueError(f"flow {token!r} is already running")
        if not work_s >= 0:
            raise ValueError(f"flow {token!r}: work must be >= 0 seconds, got {work_s}")
        rid = self._cache.ids.get(route)
        if rid is None:
            for r, _ in route.demands:
                if not 0 <= r < len(self.capacity):
                    raise ValueError(f"route {route} names resource {r}; the network has {len(self.capacity)}")
            rid = self._cache.route_id(route)
        if self._burst is not None:
            work_s = self._spend_tokens(route, work_s)
        flow = _Active(token, rid, float(work_s), self.now)
        self._flows[token] = flow
        self._of_route.setdefault(rid, {})[token] = flow
        count = self._counts[rid] = self._counts.get(rid, 0) + 1
        load, alone = self._load, True
        for r, _ in route.demands:
            if load[r]:
                alone = False
            load[r] += 1
            if count == 1:
                self._on[r][rid] = None
        if alone:  # nothing else crosses its resources: its lone rate, and no other rate moves
            flow.pace = self._pace[rid] = 1.0
            self._seq += 1
            flow.version = self._seq
            heapq.heappush(self._ends, (self.now + flow.left, self._seq, token))
        else:
            self._fresh.append(flow)
            self._touched.extend(r for r, _ in route.demands)
            self._dirty = True

    def _spend_tokens(self, route: Route, work_s: float) -> float:
        """The work left of a flow starting now on ``route`` once its first bytes pass on the tokens of the buckets
        it crosses (the least over them, per device-level flow: a resource without a bucket passes none)."""
        burst, tokens, load = self._burst, self._tokens, self._load
        for r, _ in route.demands:
            if not load[r] and tokens[r] < burst[r]:  # idle since it last carried a flow: refilled at its capacity
                tokens[r] = min(burst[r], tokens[r] + (self.now - self._idle_since[r]) * self.capacity[r])
                self._idle_since[r] = self.now
        free = min(tokens[r] / w for r, w in route.demands)
        if not free > 0:
            return work_s
        free = min(free, work_s * route.lone_bytes_per_s)
        for r, w in route.demands:
            tokens[r] -= free * w
        return work_s - free / route.lone_bytes_per_s

    def next_time(self) -> float:
        """When the next flow ends (inf: none runs)."""
        if self._dirty:
            self._rate()
        ends = self._ends
        while ends:
            end, version, token = ends[0]
            flow = self._flows.get(token)
            if flow is not None and flow.version == version:
                return end
            heapq.heappop(ends)
        return float("inf")

    def pop(self) -> Tuple[float, List[Hashable]]:
        """Advance to the next end; remove and return (that time, the tokens of every flow ending then)."""
        t = self.next_time()
        if t == float("inf"):
            raise ValueError("no flow is running")
        self.now = t
        done: List[Hashable] = []
        ends, flows, load, routes = self._ends, self._flows, self._load, self._routes
        while ends and ends[0][0] <= t:
            _, version, token = heapq.heappop(ends)
            flow = flows.get(token)
            if flow is None or flow.version != version:
                continue
            del flows[token]
            rid = flow.route
            same = self._of_route[rid]
            del same[token]
            last = not same
            if last:
                del self._of_route[rid]
                del self._counts[rid]
                del self._pace[rid]
            else:
                self._counts[rid] -= 1
            for r, _ in routes[rid].demands:
                load[r] -= 1
                if last:
                    del self._on[r][rid]
                if load[r]:  # others cross a resource it freed: their rates may rise
                    self._touched.append(r)
                    self._dirty = True
                else:  # idle from now: its bucket refills
                    self._idle_since[r] = t
            done.append(token)
        return t, done

    def _component(self, seed: int, reached: set, seen: set) -> List[int]:
        """The route ids running in the connected component of resource ``seed`` (routes through a resource,
        resources of a route, transitively); empty if ``seed`` is in ``reached``, the resources of the components
        found before (the resources and routes of this one are added to ``reached`` and ``seen``)."""
        if seed in reached:
            return []
        routes, on = self._routes, self._on
        out: List[int] = []
        stack = [seed]
        reached.add(seed)
        while stack:
            for rid in on[stack.pop()]:
                if rid in seen:
                    continue
                seen.add(rid)
                out.append(rid)
                for r, _ in routes[rid].demands:
                    if r not in reached:
                        reached.add(r)
                        stack.append(r)
        return out

    def _paces(self, mix: tuple) -> Paces:
        """The paces of one component's mix ((route id, flows), ...): from the cache, else by progressive filling."""
        paces = self._cache.paces.get(mix)
        if paces is None:
            routes = [self._routes[rid] for rid, _ in mix]
            rates = max_min_rates([[(r, w * n) for r, w in route.demands] for route, (_, n) in zip(routes, mix)],
                                  self.capacity)
            paces = {}
            for (rid, _), route, rate in zip(mix, routes, rates):
                pace = rate / route.lone_bytes_per_s
                paces[rid] = 1.0 if pace > 1.0 - 1e-12 else pace  # alone on its bottleneck: exactly its lone rate
            if len(self._cache.paces) < RateCache.LIMIT:
                self._cache.paces[mix] = paces
        return paces

    def _apply(self, paces: Paces) -> None:
        """Run each route of ``paces`` at its pace; a flow whose pace changes has its work left brought to now and
        a new end."""
        now, ends, current = self.now, self._ends, self._pace
        for rid, pace in paces.items():
            if current.get(rid) == pace:
                continue
            current[rid] = pace
            for flow in self._of_route[rid].values():
                if flow.pace:
                    flow.left = max(0.0, flow.left - (now - flow.since) * flow.pace)
                    flow.since = now
                flow.pace = pace
                self._seq += 1
                flow.version = self._seq
                heapq.heappush(ends, (now + flow.left / pace, self._seq, flow.token))

    def _rate(self) -> None:
        """Paces for the flows now running: those of the whole mix of routes when met before, else those of
        every component touched since the last rating (:meth:`_paces`); the flows whose pace changes have their
        work left brought to now and a new end."""
        self._dirty = False
        current, counts = self._pace, self._counts
        whole = tuple(sorted(counts.items()))
        paces = self._cache.paces.get(whole)
        if paces is not None:  # the mix recurs (one schedule's steady state, or a schedule simulated again)
            self._apply(paces)
        else:
            reached: set = set()
            seen: set = set()
            for seed in self._touched:
                component = self._component(seed, reached, seen)
                if component:
                    self._apply(self._paces(tuple(sorted((rid, counts[rid]) for rid in component))))
            if len(self._cache.paces) < RateCache.LIMIT:
                self._cache.paces[whole] = {rid: current[rid] for rid in counts}
        self._touched = []
        now, ends = self.now, self._ends
        for flow in self._fresh:  # new flows of a route whose pace did not change
            if flow.version == 0 and self._flows.get(flow.token) is flow:
                flow.pace = current[flow.route]
                self._seq += 1
                flow.version = self._seq
                heapq.heappush(ends, (now + flow.left / flow.pace, self._seq, flow.token))
        self._fresh = []


def _rank_resources(egress: Mapping[int, float], ingress: Mapping[int, float]
                    ) -> Tuple[List[float], Dict[int, int], Dict[int, int]]:
    """Capacities of every rank's egress and ingress, with the index of each."""
    capacity: List[float] = []
    out: Dict[int, int] = {}
    into: Dict[int, int] = {}
    for rank, rate in egress.items():
        out[rank] = len(capacity)
        capacity.append(rate)
    for rank, rate in ingress.items():
        into[rank] = len(capacity)
        capacity.append(rate)
    return capacity, out, into


def _flow_route(flow: Flow, capacity: Sequence[float], out: Mapping[int, int], into: Mapping[int, int]) -> Route:
    if flow.src == flow.dst:
        raise ValueError(f"flow {flow}: a rank does not send to itself over the network")
    for rank, side in ((flow.src, out), (flow.dst, into)):
        if rank not in side:
            raise ValueError(f"flow {flow}: rank {rank} has no {'egress' if side is out else 'ingress'} rate")
    if not flow.nbytes >= 0 or not flow.start_s >= 0:
        raise ValueError(f"flow {flow}: bytes and start must be >= 0")
    return make_route(((out[flow.src], 1.0), (into[flow.dst], 1.0)), capacity)


def _run(network: FairShareNetwork, pending: List[Tuple[float, Hashable, Route, float]], on_end) -> None:
    """Start ``pending`` (start time, token, route, work) at their times and call ``on_end(t, token)`` for
    each end (it may append to ``pending``), until nothing runs or waits."""
    pending.sort(key=lambda item: (item[0], item[1]))
    while pending or len(network):
        if pending and pending[0][0] <= network.next_time():
            start, token, route, work = pending.pop(0)
            network.advance(max(start, network.now))
            network.start(token, route, work)
            continue
        t, done = network.pop()
        for token in sorted(done):
            on_end(t, token)
        pending.sort(key=lambda item: (item[0], item[1]))


def fair_share_finish_times(flows: Sequence[Flow], egress_bytes_per_s: Mapping[int, float],
                            ingress_bytes_per_s: Mapping[int, float], latency_s: float = 0.0) -> List[float]:
    """When each of ``flows`` arrives (its bytes delivered, plus ``latency_s``) when every rank's egress and
    ingress are shared max-min fairly (progressive filling) by the flows running through them."""
    capacity, out, into = _rank_resources(egress_bytes_per_s, ingress_bytes_per_s)
    network = FairShareNetwork(capacity)
    ends: List[Optional[float]] = [None] * len(flows)
    pending = []
    for i, flow in enumerate(flows):
        route = _flow_route(flow, capacity, out, into)
        pending.append((flow.start_s, i, route, flow.nbytes / route.lone_bytes_per_s))

    def on_end(t: float, token: int) -> None:
        ends[token] = t + latency_s

    _run(network, pending, on_end)
    return [float(e) for e in ends]


def ring_allreduce_flows(ranks: Sequence[int], nbytes: float) -> List[List[Flow]]:
    """The 2(d-1) steps of a ring all-reduce of ``nbytes`` over ``ranks`` (d of them), each step a flow of
    nbytes / d from every rank to the next (d-1 reduce-scatter steps, then d-1 all-gather steps)."""
    d = len(ranks)
    if len(set(ranks)) != d:
        raise ValueError(f"ring ranks must be distinct, got {list(ranks)}")
    if d < 2:
        return []
    return [[Flow(ranks[i], ranks[(i + 1) % d], nbytes / d) for i in range(d)] for _ in range(2 * (d - 1))]


def collective_with_flows_finish_times(steps: Sequence[Sequence[Flow]], others: Sequence[Flow],
                                       egress_bytes_per_s: Mapping[int, float], ingress_bytes_per_s: Mapping[int, float],
                                       latency_s: float = 0.0) -> Tuple[float, List[float]]:
    """A ring collective (``steps`` one after another: a step's flows start together when every flow of the
    step before has arrived, ``latency_s`` after its bytes, so a step runs at its slowest hop) concurrent with
    ``others`` (each from its own ``start_s``), all sharing the ranks' egress and ingress max-min fairly.

    The collective starts at the earliest ``start_s`` of its first step. Returns (when its last step has
    arrived, when each of ``others`` arrives)."""
    capacity, out, into = _rank_resources(egress_bytes_per_s, ingress_bytes_per_s)
    network = FairShareNetwork(capacity)
    ends: List[Optional[float]] = [None] * len(others)
    pending = []
    for i, flow in enumerate(others):
        route = _flow_route(flow, capacity, out, into)
        pending.append((flow.start_s, (0, i, 0), route, flow.nbytes / route.lone_bytes_per_s))
    steps = [list(step) for step in steps if step]
    routes = [[_flow_route(flow, capacity, out, into) for flow in step] for step in steps]
    start = min((f.start_s for f in steps[0]), default=0.0) if steps else 0.0
    progress = {"step": 0, "left": 0, "end": start}

    def launch(t: float) -> None:
        k = progress["step"]
        progress["left"] = len(steps[k])
        for j, (flow, route) in enumerate(zip(steps[k], routes[k])):
            pending.append((t, (1, k, j), route, flow.nbytes / route.lone_bytes_per_s))

    def on_end(t: float, token: Tuple[int, int, int]) -> None:
        kind, i, _ = token
        if kind == 0:
            ends[i] = t + latency_s
            return
        progress["left"] -= 1
        if progress["left"] == 0:
            progress["step"] += 1
            progress["end"] = t + latency_s
            if progress["step"] < len(steps):
                launch(t + latency_s)

    if steps:
        launch(start)
    _run(network, pending, on_end)
    return float(progress["end"]), [float(e) for e in ends]
