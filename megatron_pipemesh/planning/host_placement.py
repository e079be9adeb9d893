"""Host placement: with ``activation_placement='auto'`` the chunk-micro-batches may also go to host memory
(:func:`fit_with_placement`): offloaded after their forward, reloaded before their backward, where the host link
carries the bytes within the compute in between; host moves and recomputation compete by the same rule, bytes freed
per second of added time. A fitting plan is then improved by trading recomputation for hidden copies.

Pure: no torch, no processes.
"""
from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
from typing import Dict, List, Optional, Sequence, Tuple

from ..schedule.config import ScheduleConfig
from ..schedule.levers import DEVICE, HOST, Lever
from ..schedule.lower import DEFAULT_RELOAD_LOOKAHEAD, lower
from ..schedule.ops import Op, OpKind
from .costs import OpCosts, ScheduleCosts
from .memory import host_block_bytes
from .plan import Plan
from .planner_options import RECOMPUTE_ONLY, PlannerOptions
from .rank_model import RankModel
from .recompute_fit import allowed_levers, recompute_knapsack
from .simulator import (DeadlineExceeded, PlacementPlan, SimulationResult, TimeUp, check_time, lowering_for,
                        simulate)


def _place_rank(result: SimulationResult, adapter: ScheduleCosts, plan: PlacementPlan, rank: int, budget: float,
                allowed: Sequence[Lever], options: PlannerOptions) -> bool:
    """Moves for a rank over budget, chosen on :class:`RankModel` (no re-simulation): at the estimated
    peak, a knapsack step (:func:`_place_at`), then the peak is estimated again (offloads move it), until
    the estimate fits or nothing is left to move. ``plan`` is :func:`fit_with_placement`'s own: its values
    are levers (of ``allowed``, or HOST), asked without parsing in these loops."""
    model = RankModel(result, adapter, rank, options.reload_lookahead)
    changed = False
    for _ in range(4 * len(model.keys)):
        windows, _ = model.windows({(c, j) for (r, c, j), level in plan.items() if r == rank and level.is_host})
        peak_time, peak = model.device_peak(plan, windows)
        if peak <= budget or not _place_at(model, plan, peak_time, peak - budget, allowed, options):
            break
        changed = True
    return changed


def _place_at(model: RankModel, plan: PlacementPlan, peak_time: float, excess: float, allowed: Sequence[Lever],
              options: PlannerOptions) -> bool:
    """One knapsack step at ``peak_time``: among the chunk-micro-batches on the device then, take the moves
    (to host memory, to a recompute level) with the most bytes freed per second of added time until
    ``excess`` is covered. Added time: the extra backward time of a recompute level; for a host move the
    estimated exposed reload wait it adds to the rank's copies (contention included), minus any
    recomputation it replaces. A host move frees bytes at the peak only if its offload ends before it
    and its reload starts after it, and only within the host budget."""
    rank, adapter = model.rank, model.adapter
    host = {(c, j) for (r, c, j), level in plan.items() if r == rank and level.is_host}
    windows, exposed = model.windows(host)
    host_budget = float("inf") if options.host_budget_bytes is None else options.host_budget_bytes

    def host_move(key, level):
        """(ratio, freed) of moving ``key`` (now at ``level``) to the host, or None."""
        if model.keys[key][1] + model.keys[key][7] > peak_time:
            return None  # even on an idle link the offload would end after the peak
        windows_new, exposed_new = model.windows(host | {key})
        off_end, rel_start = windows_new[key][1], windows_new[key][2]
        if not off_end <= peak_time < rel_start:
            return None
        if host_budget < float("inf") and model.host_peak(windows_new) > host_budget:
            return None
        freed = adapter.bytes_at(rank, key[0], level)
        cost = exposed_new - exposed - adapter.stage_costs(rank, key[0]).recompute_s.get(level, 0.0)
        return (freed / cost if cost > 1e-12 else float("inf")), freed

    heap = []
    for key, (f_start, _, _, _, _, _, b_end, _, _) in model.keys.items():
        if not f_start <= peak_time < b_end:
            continue
        level = plan.get((rank,) + key, DEVICE)
        if level.is_host:
            if windows[key][1] <= peak_time < windows[key][2]:
                continue  # already off the device at the peak
            saved = exposed - model.windows(host - {key})[1]
        else:
            saved = 0.0
        kept = level.kept
        wait = model.wait_before_backward(key)
        spent = adapter.stage_costs(rank, key[0]).recompute_s
        for new in allowed if not level.is_host else [new for new in allowed if not new.is_selective]:
            freed = adapter.bytes_at(rank, key[0], kept) - adapter.bytes_at(rank, key[0], new)
            cost = spent[new] - spent.get(kept, 0.0) - saved
            if freed > 0:
                ratio = freed / cost if cost > 1e-12 else float("inf")
                heapq.heappush(heap, (-ratio, -freed, -wait, key, new))
        # Levels only go forward along none -> selective -> host -> full (a selective chunk-micro-batch may
        # trade its recomputation for a copy, a host one only for full recomputation): the search cannot cycle.
        if (level.is_device or level.is_selective) and options.activation_placement == "auto":
            move = host_move(key, level)
            if move is not None:
                heapq.heappush(heap, (-move[0], -move[1], -wait, key, HOST))
    changed, moved = False, set()
    while heap and excess > 0:
        _, neg_freed, neg_wait, key, new = heapq.heappop(heap)
        if key in moved:
            continue
        if new.is_host:
            # The copies chosen since this estimate share the link: re-estimate, and requeue if it got worse.
            move = host_move(key, plan.get((rank,) + key, DEVICE))
            if move is None:
                continue
            if heap and (-move[0], -move[1], neg_wait) > heap[0][:3]:
                heapq.heappush(heap, (-move[0], -move[1], neg_wait, key, new))
                continue
            neg_freed = -move[1]
            host.add(key)
            windows, exposed = model.windows(host)
        elif plan.get((rank,) + key, DEVICE).is_host:
            host.discard(key)
            windows, exposed = model.windows(host)
        plan[(rank,) + key] = new
        moved.add(key)
        excess += neg_freed  # neg_freed = -bytes freed
        changed = True
    return changed


def _relieve_host(result: SimulationResult, adapter: ScheduleCosts, plan: PlacementPlan, rank: int, excess: float,
                  allowed: Sequence[Lever]) -> bool:
    """A rank over its host budget (the estimate of :func:`_place_rank` missed): recompute, at the allowed
    level keeping the fewest bytes, the offloaded chunk-micro-batches held on the host at its host peak,
    longest held first, until ``excess`` bytes are off the host."""
    if not allowed or not result.host_memory[rank]:
        return False
    peak_time = max(result.host_memory[rank], key=lambda step: step[1])[0]
    held: Dict[Tuple[int, int], List[float]] = {}
    for c in result.timeline.comms:
        if c.src == rank and c.lane in ("d2h", "h2d"):
            span = held.setdefault((c.op.chunk, c.op.microbatch), [0.0, 0.0])
            if c.lane == "d2h":
                span[0] = c.start
            else:
                span[1] = c.end
    changed = False
    for _, key in sorted(((end - start, key) for key, (start, end) in held.items() if start <= peak_time < end), reverse=True):
        if excess <= 0:
            break
        plan[(rank,) + key] = min(allowed, key=lambda level: adapter.bytes_at(rank, key[0], level))
        excess -= host_block_bytes(adapter.bytes_at(rank, key[0], DEVICE))
        changed = True
    return changed


class _Curve:
    """A rank's device memory as steps (time, bytes from then on), edited by intervals."""

    def __init__(self, steps: List[Tuple[float, float]]):
        self.times, self.values = [], []
        for t, value in steps:
            if self.times and self.times[-1] == t:
                self.values[-1] = value
            else:
                self.times.append(t)
                self.values.append(value)

    def _index(self, t: float) -> int:
        """Index of the step starting at ``t`` (inserted if missing)."""
        i = bisect.bisect_left(self.times, t)
        if i < len(self.times) and self.times[i] == t:
            return i
        self.times.insert(i, t)
        self.values.insert(i, self.values[i - 1] if i else 0.0)
        return i

    def peak(self, start: float, end: float) -> float:
        """Largest value on [start, end)."""
        if end <= start:
            return -math.inf
        i = max(bisect.bisect_right(self.times, start) - 1, 0)
        j = bisect.bisect_left(self.times, end)
        return max(self.values[i:max(j, i + 1)])

    def add(self, start: float, end: float, delta: float) -> None:
        if end <= start:
            return
        i, j = self._index(start), self._index(end)
        for k in range(i, j):
            self.values[k] += delta


def _offload_recomputation(config: ScheduleConfig, costs: OpCosts, start: Plan, options: PlannerOptions,
                           rounds: int = 2, sharding=None, time_up: TimeUp = None) -> Plan:
    """Improve a fitting plan by trading recomputation for host copies: per rank, the recomputed
    chunk-micro-batches that save the most backward time first (longest-waiting first among equals) go
    to the host where the estimated copies (:class:`RankModel`, contention included) expose less wait
    than the recomputation saved and the device memory stays within the budget while the bytes are on
    the device (from the forward to the offload's end, from the reload's start to the backward's end).
    The estimate holds compute times fixed; the re-simulation is the judge: if the plan no longer fits
    or is not faster, only the first half of each rank's moves is kept, and so on (at most 4 halvings)."""
    best = start
    host_budget = math.inf if options.host_budget_bytes is None else options.host_budget_bytes
    for _ in range(rounds):
        moves = [_host_moves(best, costs, rank, options, host_budget) for rank in range(config.pp)]
        if not any(moves):
            break
        improved = False
        for halving in range(5):
            plan = dict(best.placement)
            for rank_moves in moves:
                for key in rank_moves[:math.ceil(len(rank_moves) / 2 ** halving)]:
                    plan[key] = HOST
            check_time(time_up)
            lowering = lowering_for(costs, plan, options.reload_lookahead)
            schedule = lower(config, sharding.lowering(lowering) if sharding is not None else lowering)
            try:  # kept only if faster than the best
                result = simulate(config, costs, plan, schedule, sharding, deadline_s=best.result.iteration_s)
            except DeadlineExceeded:
                continue
            candidate = Plan(config, plan, result, best.budget_bytes, sharding, options.host_budget_bytes,
                             options.reload_lookahead)
            if candidate.fits and candidate.result.iteration_s < best.result.iteration_s:
                best, improved = candidate, True
                break
        if not improved:
            break
    return best


def _host_moves(plan: Plan, costs: OpCosts, rank: int, options: PlannerOptions, host_budget: float) -> List[Tuple[int, int, int]]:
    """The recomputed chunk-micro-batches of ``rank`` that :func:`_offload_recomputation` moves to the host,
    in the order chosen (most recomputation saved first)."""
    result, levels = plan.result, plan.placement
    adapter = ScheduleCosts(plan.config, costs, levels)
    model = RankModel(result, adapter, rank, options.reload_lookahead)
    curve = _Curve(result.memory[rank])
    host = {(c, j) for (r, c, j), level in levels.items() if r == rank and Lever.parse(level).is_host}
    _, exposed = model.windows(host)
    saved_s = {(c, j): adapter.stage_costs(rank, c).recompute_s.get(level, 0.0)
               for (r, c, j), level in levels.items() if r == rank and Lever.parse(level).recomputes}
    candidates = sorted(((saved, model.wait_before_backward(key), key) for key, saved in saved_s.items() if saved > 0),
                        reverse=True)
    chosen = []
    for saved, _, key in candidates:
        f_start, f_end, _, _, ready, b_start, b_end, copy, _ = model.keys[key]
        if f_end + 2 * copy > ready:
            continue  # both copies cannot fit between the forward and the backward
        trial = host | {key}
        trial_windows, trial_exposed = model.windows(trial)
        if trial_exposed - exposed >= saved:
            continue
        if host_budget < math.inf and model.host_peak(trial_windows) > host_budget:
            continue
        level = levels[(rank,) + key]
        whole, kept = adapter.bytes_at(rank, key[0], DEVICE), adapter.bytes_at(rank, key[0], level)
        transient = adapter.transient(rank, key[0], level)
        off_end, rel_start = trial_windows[key][1], trial_windows[key][2]
        if max(curve.peak(f_start, off_end), curve.peak(rel_start, b_end)) + whole - kept > plan.budget_bytes:
            continue
        curve.add(f_start, off_end, whole - kept)
        curve.add(off_end, rel_start, -kept)
        curve.add(rel_start, b_end, whole - kept)
        curve.add(b_start, b_end, -transient)
        chosen.append((rank,) + key)
        host, exposed = trial, trial_exposed
    return chosen


def reload_lookahead_for(config: ScheduleConfig, costs: OpCosts, options: PlannerOptions) -> int:
    """``options.reload_lookahead``, or (None) the compute ops a reload needs to hide behind: its copy time
    over the shortest compute op (a forward), at least the lowering's default. Reloading earlier keeps the
    bytes on the device longer; the simulation charges both."""
    if options.reload_lookahead is not None:
        return options.reload_lookahead
    adapter = ScheduleCosts(config, costs)
    copy = max(adapter.host_copy(rank, Op(OpKind.RELOAD, chunk, 0)) for rank in range(config.pp) for chunk in range(config.vpp))
    shortest = min(adapter.compute(rank, Op(OpKind.FORWARD, chunk, 0)) for rank in range(config.pp) for chunk in range(config.vpp))
    return max(DEFAULT_RELOAD_LOOKAHEAD, math.ceil(copy / shortest) if shortest > 0 else DEFAULT_RELOAD_LOOKAHEAD)


def fit_with_placement(config: ScheduleConfig, costs: OpCosts, budget_bytes: float,
                       options: PlannerOptions = PlannerOptions(activation_placement="auto"), sharding=None,
                       bare: Optional[SimulationResult] = None, time_up: TimeUp = None) -> Plan:
    """The memory levers of ``options.activation_placement`` applied to ``config`` until every rank fits.

    'device': none (the plan is the bare schedule; ``fits`` says whether it fits). 'auto': per round, on
    each rank over budget, the joint knapsack of :func:`_place_rank` (host memory, selective and full
    recomputation by bytes freed per second of added time, the copy slack estimated from the current
    simulation), then one re-simulation (the truth: the peak may move, copies may contend); a rank
    over the host budget gives back offloads to recomputation. A plan that recomputes, waits on host
    copies or does not fit is compared with recomputation alone (same budget); the fitting ones are then
    improved by trading recomputation for hidden copies (:func:`_offload_recomputation`), and the fastest
    is returned, so 'auto' is never slower than 'recompute-only' on a candidate. ``bare``, ``time_up``: as for
    :func:`.recompute_fit.recompute_knapsack` (without host copies the reload lookahead changes nothing).
    """
    allowed = allowed_levers(options, costs)
    plan: PlacementPlan = {}
    options = dataclasses.replace(options, reload_lookahead=reload_lookahead_for(config, costs, options))

    def run(plan):
        check_time(time_up)
        lowering = lowering_for(costs, plan, options.reload_lookahead)
        schedule = lower(config, sharding.lowering(lowering) if sharding is not None else lowering)
        return simulate(config, costs, plan, schedule, sharding)

    result = bare or run(plan)
    host_budget = float("inf") if options.host_budget_bytes is None else options.host_budget_bytes
    for _ in range(options.max_recompute_rounds if options.activation_placement == "auto" else 0):
        adapter = sharding.adapter(config, costs, plan) if sharding is not None else ScheduleCosts(config, costs, plan)
        changed = False
        for r in result.ranks:
            if r.peak_pinned_bytes > host_budget:
                changed |= _relieve_host(result, adapter, plan, r.rank, r.peak_pinned_bytes - host_budget, allowed)
        for r in result.ranks:
            if r.peak_memory_bytes > budget_bytes:
                changed |= _place_rank(result, adapter, plan, r.rank, budget_bytes, allowed, options)
        if not changed:
            break
        result = run(plan)
    placed = Plan(config, plan, result, budget_bytes, sharding, options.host_budget_bytes, options.reload_lookahead)
    # Without recomputation and without a wait on the host link the plan runs exactly as the bare schedule
    # (copies block nothing else): nothing can be faster. Otherwise recomputation alone may be.
    costly = any(r.recompute_s > 0 or r.exposed_host_s > 0 for r in result.ranks)
    if options.activation_placement != "auto" or (placed.fits and not costly):
        return placed
    alone = recompute_knapsack(config, costs, budget_bytes, dataclasses.replace(options, activation_placement=RECOMPUTE_ONLY),
                               sharding, bare, time_up)
    fitting = [_offload_recomputation(config, costs, plan, options, sharding=sharding, time_up=time_up)
               for plan in (placed, alone) if plan.fits]
    return min(fitting, key=lambda plan: plan.result.iteration_s) if fitting else placed
