"""Pipeline-aware recomputation as a knapsack (:func:`recompute_knapsack`): on each rank over budget, the
chunk-micro-batches alive at its peak are upgraded by bytes freed per second of recomputation (per chunk-micro-batch
and level: selective module sets, full), those that wait longest between their forward and backward first among
equals (early micro-batches on early ranks), until the rank fits; the extra backward time is part of the simulated
time.

Pure: no torch, no processes.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from ..schedule.config import ScheduleConfig
from ..schedule.levers import DEVICE, Lever
from ..schedule.lower import DEFAULT_RELOAD_LOOKAHEAD, lower
from ..schedule.ops import OpKind
from .costs import OpCosts, ScheduleCosts, StageCosts
from .plan import Plan
from .planner_options import PlannerOptions
from .rank_model import RankModel
from .simulator import PlacementPlan, SimulationResult, TimeUp, check_time, lowering_for, simulate


def _live_at_peak(result: SimulationResult, rank: int) -> List[Tuple[float, int, int]]:
    """(wait between forward end and backward start, chunk, micro-batch) of activations alive at the rank's peak."""
    events = result.timeline.compute[rank]
    forward_end = {(e.op.chunk, e.op.microbatch): (e.start, e.end) for e in events if e.op.kind is OpKind.FORWARD}
    backward = {(e.op.chunk, e.op.microbatch): (e.start, e.end) for e in events if e.op.kind is OpKind.BACKWARD}
    peak_time, peak = 0.0, -1.0
    for t, size in result.memory[rank]:
        if size > peak:
            peak_time, peak = t, size
    alive = []
    for key, (f_start, f_end) in forward_end.items():
        b_start, b_end = backward[key]
        if f_start <= peak_time < b_end:
            alive.append((b_start - f_end, key[0], key[1]))
    return sorted(alive, reverse=True)



def allowed_levers(options: PlannerOptions, costs: OpCosts) -> List[Lever]:
    """The levers of ``options.allow_recompute`` that ``costs`` price."""
    return [Lever.parse(level) for level in options.allow_recompute if level in costs.activation_bytes]


def _moves(costs: StageCosts, level: Lever, allowed: Sequence[Lever]) -> List[Tuple[float, float, Lever]]:
    """(bytes freed per second of recomputation, bytes freed, new level) of every upgrade from
    ``level`` that frees memory in a chunk-micro-batch of a stage with these ``costs``, best ratio first.
    (A backward's transient recomputation bytes are held once per rank, by the one backward running, not
    per chunk-micro-batch: the simulation that follows each round accounts for them.)"""
    have, spent = costs.activation_bytes[level], costs.recompute_s.get(level, 0.0)
    out = []
    for new in allowed:
        freed = have - costs.activation_bytes[new]
        extra = costs.recompute_s[new] - spent
        if freed > 0:
            out.append((freed / extra if extra > 0 else float("inf"), freed, new))
    return sorted(out, reverse=True)



def recompute_knapsack(config: ScheduleConfig, costs: OpCosts, budget_bytes: float,
                       options: PlannerOptions = PlannerOptions(), sharding=None,
                       bare: Optional[SimulationResult] = None, time_up: TimeUp = None) -> Plan:
    """Add pipeline-aware recomputation to ``config`` until every rank fits ``budget_bytes``
    (or nothing is left to recompute; the returned plan then has ``fits == False``).

    A knapsack by bytes freed per second of recomputation: on each rank over budget, among the
    chunk-micro-batches alive at its peak, take the upgrades (to any allowed level: selective
    module sets, full) with the most bytes freed per second of extra backward time first, the
    longest-waiting chunk-micro-batch first among equals, one upgrade per chunk-micro-batch per
    round, until the excess is covered; then re-simulate (the peak may move) and repeat. ``bare``: the
    simulation of ``config`` without levers (with ``sharding``), where the caller has run it already. ``time_up``:
    asked before each simulation (:class:`.simulator.SearchTimeUp` when it says so).
    """
    plan: PlacementPlan = {}
    allowed = allowed_levers(options, costs)
    options_ = lowering_for(costs)
    schedule = lower(config, sharding.lowering(options_) if sharding is not None else options_)
    result = bare or simulate(config, costs, plan, schedule, sharding)
    for _ in range(options.max_recompute_rounds):
        over = [r for r in result.ranks if r.peak_memory_bytes > budget_bytes]
        if not over:
            break
        changed = False
        for rank_result in over:
            changed |= _recompute_rank(result, costs, plan, rank_result, budget_bytes, allowed, sharding is None)
        if not changed:
            break
        check_time(time_up)
        result = simulate(config, costs, plan, schedule, sharding)
    return Plan(config, plan, result, budget_bytes, sharding, options.host_budget_bytes, options.reload_lookahead or DEFAULT_RELOAD_LOOKAHEAD)


def _recompute_rank(result: SimulationResult, costs: OpCosts, plan: PlacementPlan, rank_result, budget_bytes: float,
                    allowed: Sequence[Lever], estimate: bool) -> bool:
    """One round of :func:`recompute_knapsack` on a rank over budget: the knapsack at its simulated peak, then
    (``estimate``) the same rule at each next peak of its memory estimated at this simulation's times
    (:meth:`RankModel.device_peak`; recomputation lengthens backwards, so the re-simulation that follows the
    round may still find excess), one upgrade per chunk-micro-batch per round."""
    config, rank = result.config, rank_result.rank
    excess = rank_result.peak_memory_bytes - budget_bytes
    alive = _live_at_peak(result, rank)
    model, upgraded = None, set()
    while True:
        candidates = []
        for wait, chunk, microbatch in alive:
            key = (rank, chunk, microbatch)
            moves = _moves(costs.stage(config.stage(rank, chunk)), plan.get(key, DEVICE), allowed) if key not in upgraded else ()
            if moves:
                ratio, freed, new = moves[0]
                candidates.append((ratio, wait, freed, key, new))
        took = False
        for _, _, freed, key, new in sorted(candidates, reverse=True):
            if excess <= 0:
                break
            plan[key] = new
            upgraded.add(key)
            excess -= freed
            took = True
        if not took or not estimate:
            return bool(upgraded)
        model = model or RankModel(result, ScheduleCosts(config, costs), rank, DEFAULT_RELOAD_LOOKAHEAD)
        peak_time, peak = model.device_peak(plan, {})
        excess = peak - budget_bytes
        if excess <= 0:
            return True
        alive = sorted(((times[5] - times[1], key[0], key[1]) for key, times in model.keys.items()
                        if times[0] <= peak_time < times[6]), reverse=True)
