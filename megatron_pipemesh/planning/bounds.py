"""A lower bound on the iteration of *any* exact synchronous schedule of a layout, under the planner's costs.

``pipemesh study`` reports ``fraction_of_tight_bound`` = this bound / PipeMesh's time: how close PipeMesh
comes to the limit of every schedule with the same costs, whatever its groups, recomputation, activation
placement, sharding level (data-parallel scope: ZeRO-1's traffic is the least) or V (the bound is the least
over V). Memory is ignored (valid, looser): recomputation and host copies only lengthen a schedule;
:func:`bound_for` takes a plan's recomputation and exposed copies per rank to show what memory costs.

Notation for one V: stage s = c*p + r runs on rank r (chunk c); f_s, b_s its forward and backward at no
recomputation (tensor-parallel collectives included); h(s, s') the transfer between the stages' ranks alone
(plus its latency); G the parameter gather of rank 0's chunk 0, R_rc the gradient reduction of rank r's chunk
c, E the tied embedding's all-reduce after the backward, o_r rank r's optimizer step; every transfer at its
lone time (sharing only slows it), less the burst of the NICs' token buckets where they have one (each transfer
passes at most that at once). An exact synchronous schedule needs at least:

* **the stage-0 chain, for every rank r**: rank 0's chunk-0 gather before any forward (stage 0's first
  forward waits for it), then the fill (rank r's first op is a forward of stage c*p + r, which needs that
  micro-batch's forwards on stages 0..r-1 and their transfers), then every forward and backward of rank r,
  then the drain (rank r's last op is a backward of stage c*p + r, after which that micro-batch's backwards
  on stages r-1..0 and their transfers remain), then rank 0's chunk-0 reduction (after stage 0's last
  backward), the embedding all-reduce (after every reduction of rank 0) and rank 0's step:
  G + sum_{s<r} (f_s + h(s, s+1)) + m sum_c (f + b)_{c p + r} + sum_{s<r} (h(s+1, s) + b_s) + R_00 + E + o_0.
  The start may also be rank r's own least gather, the end its own least reduction (+ E) and step, and the
  span of rank r's ops its input channels' deliveries (m V inputs at least a transfer apart) when longer;
* **reductions after the last stage's last forward**: the last stage's m-th forward ends no earlier than
  stage 0's m forwards after G and one micro-batch's chain through every later stage (or the chain to the
  last stage and its m forwards); every chunk's reduction starts after its last backward, which follows
  that forward and the backward chain down to the chunk's stage; a rank's reductions run one after another
  on its data-parallel channel, then E and its step. Also the previous bound's phases: every gather before
  any reduction, a reduction after its chunk's m forwards and backwards;
* **the links**: every transfer on a directed pipeline channel one after another, and every resource of the
  costs' links (:mod:`.topology`: a NIC direction, a host link...) carrying the bytes of every transfer
  through it at no more than its capacity: the pipeline sends, the gathers and reductions, the embedding
  all-reduce; and, for ranks sharing CPU cores (``compute_route``), every process's forwards and backwards at one
  core each through the cores.

Pure: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from ..schedule.config import ScheduleConfig
from ..schedule.levers import DEVICE
from ..schedule.ops import Op, OpKind
from .costs import ClusterSpec, ModelSpec, ScheduleCosts, analytic_costs


@dataclass(frozen=True)
class IterationBound:
    """The least iteration time any exact synchronous schedule of one (model, cluster, p, m) can reach."""

    seconds: float
    """The bound: the least over V of the largest need below."""
    vpp: int
    """The V that gives the bound."""
    chain_s: float
    """At that V: the largest per-rank stage-0 chain (gather, fill, compute, drain, chunk-0 reduction, embedding
    all-reduce, step)."""
    data_parallel_s: float
    """At that V: the largest per-rank data-parallel need (reductions after the last stage's last forward)."""
    links_s: float = 0.0
    """At that V: the busiest pipeline channel or link resource, its transfers back to back at full rate (or the
    shared CPU cores, every process's compute at one core each)."""

    @property
    def bottleneck(self) -> str:
        """'chain', 'data-parallel' or 'links': which need sets the bound."""
        needs = {"chain": self.chain_s, "data-parallel": self.data_parallel_s, "links": self.links_s}
        return max(needs, key=needs.get)

    def to_dict(self) -> dict:
        return {"seconds": self.seconds, "vpp": self.vpp, "chain_s": self.chain_s,
                "data_parallel_s": self.data_parallel_s, "links_s": self.links_s, "bottleneck": self.bottleneck}


def bound_for(config: ScheduleConfig, costs: ScheduleCosts, extra_s: Optional[Sequence[float]] = None) -> IterationBound:
    """The bound of one fixed V (``config`` only gives p, V, m; its groups do not matter). ``costs``' compute
    is read at no recomputation; ``extra_s``: seconds per rank added to its compute (a plan's recomputation and
    exposed host copies, to see what memory costs)."""
    c = costs.costs
    plain = ScheduleCosts(config, c)  # no recomputation
    p, vpp, m = config.pp, config.vpp, config.microbatches
    stages = p * vpp
    extra = list(extra_s) if extra_s is not None else [0.0] * p
    if len(extra) != p:
        raise ValueError(f"extra_s needs one value per pipeline rank ({p}), got {len(extra)}")
    f = [plain.compute(s % p, Op(OpKind.FORWARD, s // p, 0)) for s in range(stages)]
    b = [plain.compute(s % p, Op(OpKind.BACKWARD, s // p, 0)) for s in range(stages)]

    hops: Dict[tuple, float] = {}  # (src rank, dst rank) -> its hop: a transfer's time depends on its ranks alone

    def hop(s: int, t: int) -> float:
        """Transfer from stage s to stage t alone, with its latency (0 on one rank)."""
        if s % p == t % p:
            return 0.0
        seconds = hops.get((s % p, t % p))
        if seconds is None:
            busy, latency = p2p_alone(plain, s % p, t % p, Op(OpKind.FORWARD if t > s else OpKind.BACKWARD, s // p, 0))
            seconds = hops[s % p, t % p] = busy + latency
        return seconds

    links = plain.links()
    dp_burst = [burst_s(links, links.dp_route(r) if links is not None else None) for r in range(p)]
    step = [c.optimizer_s[r] if r < len(c.optimizer_s) else 0.0 for r in range(p)]
    gathers = [[max(0.0, plain.data_parallel(r, Op(OpKind.PARAM_SYNC, k)) - dp_burst[r]) if c.dp_gather_s > 0 else 0.0
                for k in range(vpp)] for r in range(p)]
    reductions = [[max(0.0, plain.data_parallel(r, Op(OpKind.GRAD_SYNC, k)) - dp_burst[r]) for k in range(vpp)]
                  for r in range(p)]
    finals = plain.final_collectives()
    final_s = {r: max(max(0.0, t[2] - burst_s(links, links.embedding_route(t[0], t[1]) if links is not None else None))
                      for t in final.transfers) + final.latency_s for final in finals for r in final.ranks}
    gather0, reduce0, embed = gathers[0][0], reductions[0][0], final_s.get(0, 0.0)

    # Reductions after the last stage's last forward (T_last): stage 0's m forwards then one chain, or the
    # chain to the last stage then its m forwards.
    chain_to = [0.0] * stages  # forward chain from stage 0's end to stage s's end, one micro-batch
    for s in range(1, stages):
        chain_to[s] = chain_to[s - 1] + hop(s - 1, s) + f[s]
    last_forward = gather0 + max(m * f[0] + chain_to[-1], f[0] + chain_to[-1] + (m - 1) * f[-1])
    down = [0.0] * stages  # from the last stage's forward end to the end of stage s's backward, one micro-batch
    down[-1] = b[-1]
    for s in range(stages - 2, -1, -1):
        down[s] = down[s + 1] + hop(s + 1, s) + b[s]

    chain = data_parallel = 0.0
    dp_end: Dict[int, float] = {}
    for r in range(p):
        busy = m * sum(f[k * p + r] + b[k * p + r] for k in range(vpp)) + extra[r]
        fill = sum(f[s] + hop(s, s + 1) for s in range(r))
        drain = sum(hop(s + 1, s) + b[s] for s in range(r))
        own_end = min(reductions[r]) + final_s.get(r, 0.0) + step[r]
        start = max(gather0 + fill, min(gathers[r]))
        end = max(drain + reduce0 + embed + step[0], own_end)
        chain = max(chain, start + max(busy, _fed_span(config, plain, f, b, r)) + end)
        dp_end[r] = last_forward + min(down[k * p + r] for k in range(vpp)) + sum(reductions[r])
        # The previous bound's phases: gathers before reductions; a reduction after its chunk's m F and B.
        chunk = m * min(f[k * p + r] + b[k * p + r] for k in range(vpp))
        phases = max(max(sum(gathers[r]), gather0 + fill + chunk) + sum(reductions[r]),
                     sum(gathers[r]) + chunk + min(reductions[r])) + step[r]
        data_parallel = max(data_parallel, phases)
    for r in range(p):
        ready = dp_end[r]
        for final in finals:  # the embedding all-reduce starts once all its ranks have reduced
            if r in final.ranks:
                ready = max(dp_end[q] for q in final.ranks)
        data_parallel = max(data_parallel, ready + final_s.get(r, 0.0) + step[r])
    compute = [m * sum(f[k * p + r] + b[k * p + r] for k in range(vpp)) for r in range(p)]
    links = _links_s(config, plain, gathers, reductions, finals, compute)
    return IterationBound(max(chain, data_parallel, links), vpp, chain, data_parallel, links)


def burst_s(links, route) -> float:
    """What a token bucket on ``route`` can save a flow at most (0 without: :meth:`.topology.Topology.burst_s`)."""
    saved = getattr(links, "burst_s", None)
    return saved(route) if callable(saved) else 0.0


def p2p_alone(costs: ScheduleCosts, src: int, dst: int, op: Op):
    """(busy, latency) of a pipeline transfer alone, less what the NICs' token buckets may pass at once."""
    busy, latency = costs.transfer(src, dst, op)
    links = costs.links()
    if links is not None:
        busy = max(0.0, busy - burst_s(links, links.p2p_route(src, dst)))
    return busy, latency


def _fed_span(config: ScheduleConfig, costs: ScheduleCosts, f: Sequence[float], b: Sequence[float], r: int) -> float:
    """From rank r's first op to its last, at least the time its input channels take to deliver: n inputs on
    one FIFO channel arrive at least n-1 transfers apart; the first forward input comes before any op, and
    after the last one that forward and a backward remain (the first backward input follows a forward, and
    after the last one that backward remains)."""
    p, vpp, m = config.pp, config.vpp, config.microbatches
    stages = p * vpp
    if p == 1:
        return 0.0
    mine = range(r, stages, p)
    span = 0.0
    fed = [s for s in mine if s >= 1]  # stages whose forward input comes from rank r-1
    if fed:
        busy, _ = p2p_alone(costs, (r - 1) % p, r, Op(OpKind.FORWARD, 0, 0))
        span = (m * len(fed) - 1) * busy + min(f[s] + b[s] for s in fed)
    fed = [s for s in mine if s <= stages - 2]  # stages whose backward input comes from rank r+1
    if fed:
        busy, _ = p2p_alone(costs, (r + 1) % p, r, Op(OpKind.BACKWARD, 0, 0))
        span = max(span, min(f[s] for s in fed) + (m * len(fed) - 1) * busy + min(b[s] for s in fed))
    return span


def _links_s(config: ScheduleConfig, costs: ScheduleCosts, gathers, reductions, finals, compute) -> float:
    """The busiest pipeline channel (its sends back to back) or link resource (every byte through it at its
    capacity; shared CPU cores: every rank's one-core ``compute`` seconds, times the processes it stands for)."""
    p, vpp, m = config.pp, config.vpp, config.microbatches
    stages = p * vpp
    if p == 1 and not gathers[0][0] and not reductions[0][0]:
        return 0.0
    channel: Dict[tuple, float] = {}
    sends: List[tuple] = []  # (src rank, dst rank, seconds alone) of every transfer of an iteration
    for s in range(stages):
        for t, direction in ((s + 1, "F"), (s - 1, "B")):
            if 0 <= t < stages and s % p != t % p:
                busy, _ = p2p_alone(costs, s % p, t % p, Op(OpKind.FORWARD if direction == "F" else OpKind.BACKWARD,
                                                              s // p, 0))
                key = (s % p, t % p, direction)
                channel[key] = channel.get(key, 0.0) + m * busy
                sends.append((s % p, t % p, m * busy))
    worst = max(channel.values(), default=0.0)
    links = costs.links()
    if links is None:
        return worst
    load = [0.0] * len(links.capacity)

    def carry(route, seconds: float) -> None:
        if route is None or not seconds:
            return
        for resource, weight in route.demands:
            load[resource] += seconds * route.lone_bytes_per_s * weight

    for src, dst, seconds in sends:
        carry(links.p2p_route(src, dst), seconds)
    for r in range(p):
        carry(links.dp_route(r), sum(gathers[r]) + sum(reductions[r]))
    for final in finals:
        for src, dst, seconds, _ in final.transfers:
            route = links.embedding_route(src, dst)
            carry(route, max(0.0, seconds - burst_s(links, route)))
    compute_route = getattr(links, "compute_route", None)
    for r in range(p) if callable(compute_route) else ():
        route = compute_route(r)
        if route is not None:  # the route's work is in seconds at its lone rate (cores)
            carry(route, compute[r] / route.lone_bytes_per_s)
    return max(worst, max(bytes_ / cap for bytes_, cap in zip(load, links.capacity)))


def virtual_sizes(model: ModelSpec, pp: int) -> List[int]:
    """V values stock and PipeMesh try: every V at which the model's layer split places its layers on p ranks
    (evenly: every divisor of the layers per rank; 1 = no interleaving); only 1 without a pipeline (p = 1)."""
    return model.layer_split.virtual_sizes(model.num_layers, pp) if pp > 1 else [1]


def iteration_lower_bound(model: ModelSpec, cluster: ClusterSpec, pp: int, microbatches: int,
                          vpps: Optional[Sequence[int]] = None) -> IterationBound:
    """The least iteration time of any schedule over ``vpps`` (default: :func:`virtual_sizes`)."""
    best = None
    for vpp in virtual_sizes(model, pp) if vpps is None else vpps:
        config = ScheduleConfig.depth_first(pp, vpp, microbatches)
        bound = bound_for(config, ScheduleCosts(config, analytic_costs(model, cluster, config, levels=(DEVICE,))))
        if best is None or bound.seconds < best.seconds:
            best = bound
    if best is None:
        split = " ".join(model.layer_split.flags()) or "evenly"
        raise ValueError(f"no V places the {model.num_layers} layers on {pp} pipeline ranks ({split})")
    return best
