"""A lower bound of one fixed-order schedule's simulated iteration: its critical path, each op and transfer at its lone
duration. Cheaper than a simulation by an order of magnitude (no network, no event heap: one pass over each rank's
compute order), and within a few percent of it where links are not shared much; the planner and stock's search skip
a schedule whose bound already exceeds the time it must beat, which the simulation would have dropped there too.

Why it bounds :func:`.simulator.simulate` from below (the engine's rules, :mod:`..schedule.timeline`): each rank runs
its compute ops in order on one stream, so an op starts no earlier than the previous one ends, nor before its input
arrives; a transfer starts no earlier than its producer ends (its send follows the producer), after the previous
transfer on its FIFO channel (src rank, dst rank, direction), and takes at least its lone time (sharing a link only
slows it; a token bucket's burst is taken off, as :mod:`.bounds` does), plus its latency; a chunk's first forward
waits for its parameter gather, and a rank's gathers run one after another on its data-parallel channel from time 0;
a rank's gradient reductions run one after another, each after its chunk's last backward; the tied embedding's
all-reduce after every reduction of its ranks; then each rank's optimizer step. Every other rule of the engine
(posting receives, Megatron's send waits, host copies, ZeRO-2/3 buffers, sharing) only delays ops, so leaving it out
keeps the bound. An op's duration is the engine's own (with its recomputation); on shared CPU cores, its work at the
rank's lone pace.

Pure: no torch.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

from ..schedule.config import ScheduleConfig
from ..schedule.lower import LoweringOptions
from ..schedule.ops import Op, OpKind
from ..schedule.order import rank_steps
from .bounds import burst_s, p2p_alone

SLACK = 1e-9
"""Relative slack when comparing a bound with a simulated time (this one, or the compute bounds of the searches): the
two add the same durations in other orders, so their floats may differ in the last bits."""


def beyond(bound_s: float, limit_s: float) -> bool:
    """Whether a lower bound is past a time even with :data:`SLACK`: nothing it bounds ends by ``limit_s``."""
    return bound_s * (1 - SLACK) > limit_s


def path_bound(config: ScheduleConfig, costs, options: LoweringOptions, optimizer_s: Sequence[float]) -> float:
    """The critical path of ``config``'s compute orders under ``costs`` (the engine's ``Costs``, e.g.
    :class:`.costs.ScheduleCosts` with a recomputation plan) lowered with ``options``, plus ``optimizer_s`` per rank
    (what :func:`.simulator.simulate` adds after a rank's collectives). 0 where the orders cannot finish (the
    simulation raises the deadlock)."""
    p, vpp, m = config.pp, config.vpp, config.microbatches
    stages = p * vpp
    links = costs.links() if callable(getattr(costs, "links", None)) else None
    compute_route = getattr(links, "compute_route", None)
    pace = [1.0] * p  # a rank's lone pace on shared cores (work per second), else 1
    for rank in range(p):
        route = compute_route(rank) if callable(compute_route) else None
        if route is not None:
            pace[rank] = route.lone_bytes_per_s
    plan = getattr(costs, "recompute", None) or {}
    uniform = not plan or (len(plan) == p * vpp * m and len(set(plan.values())) == 1)  # else per micro-batch
    forward = [[costs.compute(r, Op(OpKind.FORWARD, c, 0)) / pace[r] for c in range(vpp)] for r in range(p)]
    backward = [[costs.compute(r, Op(OpKind.BACKWARD, c, 0)) / pace[r] for c in range(vpp)] for r in range(p)]
    # (busy, latency) of a send from rank r, forward and backward; a send to a stage on the same rank is free
    hops = {}
    for r in range(p):
        for dst in {(r + 1) % p, (r - 1) % p} - {r}:
            for kind in (OpKind.FORWARD, OpKind.BACKWARD):
                hops[r, dst, kind is OpKind.FORWARD] = p2p_alone(costs, r, dst, Op(kind, 0, 0))
    training = not options.forward_only
    param_ready = _gathers(config, costs, options, links) if training else [[0.0] * vpp for _ in range(p)]

    arrival: List[Optional[float]] = [None] * (2 * stages * m)  # input of (stage, direction, micro-batch)
    channel_free = {}
    programs = [rank_steps(config, rank, options.forward_only) for rank in range(p)]
    index, free = [0] * p, [0.0] * p
    started = [[False] * vpp for _ in range(p)]
    last_backward = [[0.0] * vpp for _ in range(p)]
    moved = True
    while moved:
        moved = False
        for r in range(p):
            program, i, t = programs[r], index[r], free[r]
            n = len(program)
            fwd_r, bwd_r, ready_r, seen_r = forward[r], backward[r], param_ready[r], started[r]
            while i < n:
                is_forward, c, j = program[i]
                s = c * p + r
                if is_forward:
                    if s > 0:
                        got = arrival[(2 * s) * m + j]
                        if got is None:
                            break
                        if got > t:
                            t = got
                    if not seen_r[c]:
                        seen_r[c] = True
                        if ready_r[c] > t:
                            t = ready_r[c]
                    t += fwd_r[c]
                    target = s + 1
                else:
                    if s < stages - 1:
                        got = arrival[(2 * s + 1) * m + j]
                        if got is None:
                            break
                        if got > t:
                            t = got
                    t += bwd_r[c] if uniform else costs.compute(r, Op(OpKind.BACKWARD, c, j)) / pace[r]
                    last_backward[r][c] = t
                    target = s - 1
                if 0 <= target < stages:
                    slot = (2 * target + (0 if is_forward else 1)) * m + j
                    dst = target % p
                    if dst == r:
                        arrival[slot] = t
                    else:
                        busy, latency = hops[r, dst, is_forward]
                        key = (r, dst, is_forward)
                        begin = channel_free.get(key, 0.0)
                        channel_free[key] = end = (t if t > begin else begin) + busy
                        arrival[slot] = end + latency
                i += 1
            if i != index[r]:
                moved = True
                index[r], free[r] = i, t
    if any(index[r] < len(programs[r]) for r in range(p)):
        return 0.0
    ends = list(free)
    if training and options.grad_sync:
        for r in range(p):
            burst = burst_s(links, links.dp_route(r)) if links is not None else 0.0
            t = free[r] if options.grad_sync_at_end else 0.0
            for c in sorted(range(vpp), key=last_backward[r].__getitem__):  # issued in that order, one at a time
                begin = last_backward[r][c] if last_backward[r][c] > t else t
                t = begin + max(0.0, costs.data_parallel(r, Op(OpKind.GRAD_SYNC, c)) - burst)
            ends[r] = max(ends[r], t)
    finals = getattr(costs, "final_collectives", None)
    for final in (finals() if callable(finals) and training else ()):
        ready = max(ends[q] for q in final.ranks)
        longest = max(max(0.0, seconds - burst_s(links, links.embedding_route(src, dst) if links is not None else None))
                      for src, dst, seconds, _ in final.transfers)
        for q in final.ranks:
            ends[q] = max(ends[q], ready + longest + final.latency_s)
    return max(end + step for end, step in zip(ends, optimizer_s))


def _gathers(config: ScheduleConfig, costs, options: LoweringOptions, links) -> List[List[float]]:
    """Per rank and chunk: when its PARAM_SYNC ends at the earliest (the rank's gathers back to back from time 0, in
    chunk order, each at its lone time); 0 for a chunk without one."""
    out = [[0.0] * config.vpp for _ in range(config.pp)]
    if not options.param_sync:
        return out
    zero3 = set(options.zero3_chunks)
    for r in range(config.pp):
        burst = burst_s(links, links.dp_route(r)) if links is not None else 0.0
        t = 0.0
        for c in range(config.vpp):
            if c not in zero3:
                t += max(0.0, costs.data_parallel(r, Op(OpKind.PARAM_SYNC, c)) - burst)
                out[r][c] = t
    return out
