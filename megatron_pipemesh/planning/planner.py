"""Planner: choose forward/backward groups and where each activation is kept (on the device, recomputed or in host
memory) so that the plan fits a memory budget.

This module is the group search; its pieces are the plan and its file form (:mod:`.plan`), the search's options
(:mod:`.planner_options`), the recomputation knapsack (:mod:`.recompute_fit`) and host placement
(:mod:`.host_placement`). Search (each candidate is simulated with the same engine the runtime's plan is checked
with):

* small spaces: every pair of valid group lists; otherwise
  forward groups = [f_1] + groups of p for the rest; backward groups = groups of p + [b_last]
  (the middle groups only need to be bubble-free, so p is the cheapest size: paper-notes §6);
  f_1 and b_last range over the multiples of p up to m (and m itself);
* for a candidate whose peak memory exceeds the budget on some rank, pipeline-aware
  recomputation is added as a knapsack (:func:`.recompute_fit.recompute_knapsack`): on each rank over budget,
  the chunk-micro-batches alive at that rank's peak are upgraded by bytes freed per second of
  recomputation (per chunk-micro-batch and level: selective module sets, full), those that wait
  longest between their forward and backward first among equals (early micro-batches on early
  ranks), until the rank fits; the extra backward time is part of the simulated time;
* with ``activation_placement='auto'`` the chunk-micro-batches may also go to host memory
  (:func:`.host_placement.fit_with_placement`): offloaded after their forward, reloaded before their backward, where
  the host link carries the bytes within the compute in between; host moves and recomputation
  compete by the same rule, bytes freed per second of added time;
* the fastest candidate that fits on every rank wins (ties: less memory, less recompute).

Pure: no torch, no processes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from ..schedule.config import ScheduleConfig, ScheduleConfigError, depth_first_groups
from ..schedule.levers import DEVICE, PLACEMENT_MODES, RECOMPUTE_ONLY
from ..schedule.ops import Op, OpKind
from ..schedule.order import rank_steps
from .costs import GB, OpCosts, ScheduleCosts
from .host_placement import fit_with_placement, reload_lookahead_for
from .plan import NoFeasiblePlan, Plan
from .planner_options import PlannerOptions, structured_options
from .recompute_fit import allowed_levers, recompute_knapsack
from .path_bound import beyond
from .simulator import DeadlineExceeded, SimulationResult, TimeUp, check_time, lower_bound, simulate

__all__ = [  # the plan, its options and its fits are also reached through the search, their first home
    "NoFeasiblePlan", "Plan", "PLACEMENT_MODES", "PlannerOptions", "structured_options", "fit_with_placement",
    "fit_with_recompute", "reload_lookahead_for", "compositions", "candidate_configs", "least_peaks", "plan_schedule",
    "baseline_plans"]


def fit_with_recompute(config: ScheduleConfig, costs: OpCosts, budget_bytes: float,
                       options: PlannerOptions = PlannerOptions(), sharding=None,
                       bare: Optional[SimulationResult] = None, time_up: TimeUp = None) -> Plan:
    """``config`` fitted to ``budget_bytes`` with the memory levers of ``options.activation_placement``:
    recomputation alone (:func:`.recompute_fit.recompute_knapsack`) or with host placement
    (:func:`.host_placement.fit_with_placement`); the returned plan has ``fits == False`` when nothing fits.
    ``bare``: the simulation of ``config`` without levers (with ``sharding``), where the caller has run it already.
    ``time_up``: asked before each simulation (:class:`.simulator.SearchTimeUp` when it says so)."""
    if options.activation_placement != RECOMPUTE_ONLY:
        return fit_with_placement(config, costs, budget_bytes, options, sharding, bare, time_up)
    return recompute_knapsack(config, costs, budget_bytes, options, sharding, bare, time_up)


def _sizes(pp: int, microbatches: int, given: Optional[Iterable[int]]) -> List[int]:
    if given:
        return sorted({g for g in given if pp <= g <= microbatches})
    return sorted(set(range(pp, microbatches + 1, pp)) | {microbatches})


def compositions(total: int, smallest: int, limit: int) -> Optional[List[Tuple[int, ...]]]:
    """All ordered splits of ``total`` into parts >= ``smallest``; None if there are more than ``limit``."""
    out: List[Tuple[int, ...]] = []

    def extend(prefix: Tuple[int, ...], rest: int) -> bool:
        if rest == 0:
            out.append(prefix)
            return len(out) <= limit
        for part in range(smallest, rest + 1):
            if rest - part == 0 or rest - part >= smallest:
                if not extend(prefix + (part,), rest - part):
                    return False
        return True

    return out if extend((), total) else None


def candidate_configs(pp: int, vpp: int, microbatches: int, options: PlannerOptions = PlannerOptions()) -> List[ScheduleConfig]:
    """Every valid (forward, backward) pair of the search space, depth-first and breadth-first included.

    Small spaces (at most ``exhaustive_limit`` pairs) are searched exhaustively over all group
    lists; larger ones over the structured family of the module docstring.
    """
    configs, seen = [], set()
    if options.first_forward_candidates is None and options.last_backward_candidates is None:
        every = compositions(microbatches, pp, options.exhaustive_limit)
        if every is not None and len(every) ** 2 <= options.exhaustive_limit:
            for forward in every:
                for backward in every:
                    try:
                        configs.append(ScheduleConfig(pp, vpp, microbatches, forward, backward))
                    except ScheduleConfigError:
                        continue
            return configs
    for f1 in _sizes(pp, microbatches, options.first_forward_candidates):
        rest = microbatches - f1
        if 0 < rest < pp:
            continue
        forward = (f1,) + tuple(depth_first_groups(rest, pp) if rest else ())
        for b_last in _sizes(pp, microbatches, options.last_backward_candidates):
            rest_b = microbatches - b_last
            if 0 < rest_b < pp:
                continue
            backward = tuple(depth_first_groups(rest_b, pp) if rest_b else ()) + (b_last,)
            try:
                config = ScheduleConfig(pp, vpp, microbatches, forward, backward)
            except ScheduleConfigError:
                continue
            if (forward, backward) not in seen:
                seen.add((forward, backward))
                configs.append(config)
    # Every stock group size too (Megatron's --microbatch-group-size-per-virtual-pipeline-stage g), so
    # that PipeMesh's search contains every stock interleaved schedule of this V.
    uniform = [ScheduleConfig.uniform(pp, vpp, microbatches, g) for g in range(pp, microbatches + 1)
               if microbatches % g == 0 or microbatches % g >= pp]
    for preset in [ScheduleConfig.depth_first(pp, vpp, microbatches), ScheduleConfig.breadth_first(pp, vpp, microbatches)] + uniform:
        if (preset.forward_groups, preset.backward_groups) not in seen:
            seen.add((preset.forward_groups, preset.backward_groups))
            configs.append(preset)
    return configs



def least_peaks(config: ScheduleConfig, costs: OpCosts, levels: Sequence[str]) -> List[float]:
    """Per rank: a lower bound on the peak device memory of ``config`` under *any* recomputation plan over ``levels``
    (no host placement, no sharding), from its ops' order alone. On the simulator's memory timeline a forward adds
    its chunk-micro-batch's bytes at its start, a backward adds its recomputation's transient bytes at its start and
    frees both at its end, and a rank's ops run one after another; so at each op every chunk-micro-batch alive holds
    at least its least bytes over ``levels``, and the backward running at least its least bytes plus transient. A
    backward that takes no time is not counted (its end sorts before its start on the timeline). The order is the
    compute order (:func:`..schedule.order.rank_steps`): lowering adds no compute op and moves none."""
    adapter = ScheduleCosts(config, costs)
    out = []
    for rank in range(config.pp):
        least = [min(adapter.bytes_at(rank, chunk, level) for level in levels) for chunk in range(config.vpp)]
        running = [min(adapter.bytes_at(rank, chunk, level) + adapter.transient(rank, chunk, level) for level in levels)
                   for chunk in range(config.vpp)]
        # Without recomputation a backward's time is its chunk's, the same for every micro-batch.
        timed = [adapter.compute(rank, Op(OpKind.BACKWARD, chunk, 0)) > 0 for chunk in range(config.vpp)]
        live = peak = 0.0
        for forward, chunk, _ in rank_steps(config, rank):
            if forward:
                live += least[chunk]
                if live > peak:
                    peak = live
            else:
                if timed[chunk]:
                    peak = max(peak, live - least[chunk] + running[chunk])
                live -= least[chunk]
        out.append((costs.static_bytes[rank] if rank < len(costs.static_bytes) else 0.0) + peak)
    return out



_WHAT_WOULD_FIT = ("What would fit: a smaller --micro-batch-size, more pipeline stages (--pipeline-model-parallel-size) or "
                   "tensor parallelism to split weights and activations, the distributed optimizer over more "
                   "data-parallel ranks to shard optimizer state, or a larger budget")


@dataclass
class _Unfitted:
    """A group list simulated without memory levers, waiting for its fit (:func:`plan_schedule`)."""

    bare_s: float
    """Its iteration time without levers: a lower bound of its time with them."""
    order: int
    """Enumeration order (ties go to the earlier list)."""
    config: ScheduleConfig
    costs: OpCosts
    simulation: Optional[SimulationResult]
    """The simulation without levers, kept (with a fit limit, among the fit-limit fastest) for its fit to start from."""

    @property
    def rank(self) -> Tuple[float, int]:
        return self.bare_s, self.order


def _simulate_bare(pp: int, vpp: int, microbatches: int, costs_for, budget_bytes: float, options: PlannerOptions,
                   incumbent_s: float, sharding, time_up: TimeUp
                   ) -> Tuple[List[_Unfitted], Optional[Tuple[float, int, ScheduleConfig]]]:
    """(every candidate ending by the incumbent without levers, fastest first; the least (peak bound, rank, config)
    of the candidates dropped because no recomputation can make them fit).

    Only candidates ending by the incumbent, and (with a fit limit) among the fit_limit fastest so far, can be
    fitted: a simulation stops once its clock passes that, and the candidate is dropped. With a fit limit the
    simulations of the fit_limit fastest so far are kept: their fits start from them. With recomputation the only
    lever (no host placement, no sharding), a candidate whose least peak under any recomputation exceeds the budget
    cannot fit: it is dropped before its simulation.

    The candidates are simulated in order of their critical path (:func:`.simulator.lower_bound`, at most their
    time), so the fit_limit fastest come first and the rest stop at their deadline or, once the path alone passes
    it, are not simulated at all; the order of equal times is the enumeration order, as before."""
    limit = options.fit_limit
    floors = options.activation_placement == RECOMPUTE_ONLY and sharding is None
    unfit: Optional[Tuple[float, int, ScheduleConfig]] = None
    waiting = []
    for order, config in enumerate(candidate_configs(pp, vpp, microbatches, options)):
        costs = costs_for(config)
        if floors:
            least = least_peaks(config, costs, [DEVICE] + allowed_levers(options, costs))
            worst = max(range(pp), key=least.__getitem__)
            if least[worst] > budget_bytes:
                if unfit is None or least[worst] < unfit[0]:
                    unfit = (least[worst], worst, config)
                continue
        waiting.append((lower_bound(config, costs, sharding=sharding), order, config, costs))
    waiting.sort(key=lambda item: item[:2])
    bare: List[_Unfitted] = []
    deadline = incumbent_s
    for path_s, order, config, costs in waiting:
        if beyond(path_s, deadline):
            break  # this one and every later one would end after it: their simulations would stop there
        check_time(time_up)
        try:
            result = simulate(config, costs, sharding=sharding, deadline_s=deadline)
        except DeadlineExceeded:
            continue
        bare.append(_Unfitted(result.iteration_s, order, config, costs, result if limit is not None else None))
        bare.sort(key=lambda item: item.rank)
        if limit is not None and len(bare) >= limit:
            deadline = min(incumbent_s, bare[limit - 1].bare_s)
            for item in bare[limit:]:
                item.simulation = None
    return bare, unfit


def plan_schedule(pp: int, vpp: int, microbatches: int, costs_for, budget_bytes: float,
                  options: PlannerOptions = PlannerOptions(),
                  incumbent_s: float = float("inf"), sharding=None, time_up: TimeUp = None) -> Tuple[Plan, List[Plan]]:
    """Search the candidates; return (best fitting plan, every plan fitted with recomputation).

    Candidates whose time without recomputation already exceeds the best fitting time (or
    ``incumbent_s``, a time known to be reachable otherwise, e.g. with another V) are skipped.

    ``costs_for(config) -> OpCosts`` gives the costs of a candidate (they do not depend on the
    groups for analytic costs, but measured ones may). ``sharding`` (a :class:`.sharding.ShardingModel`)
    simulates every candidate with those per-chunk levels. Raises :class:`NoFeasiblePlan`, and
    :class:`.simulator.SearchTimeUp` when ``time_up`` says so before a simulation (the fits' included: a fit asks
    before each of its own).
    """
    # Recomputation only lengthens backwards, and a fixed-order schedule never finishes earlier when
    # an op gets longer: a candidate's time without recomputation bounds its time with it. Fit the
    # candidates in order of that bound and stop once the bound reaches the best fitting time.
    bare, unfit = _simulate_bare(pp, vpp, microbatches, costs_for, budget_bytes, options, incumbent_s, sharding,
                                 time_up)
    evaluated, best_time = [], incumbent_s
    for item in bare:
        if item.bare_s > best_time or (options.fit_limit is not None and len(evaluated) >= options.fit_limit):
            break
        plan = fit_with_recompute(item.config, item.costs, budget_bytes, options, sharding, item.simulation, time_up)
        evaluated.append(plan)
        if plan.fits:
            best_time = min(best_time, plan.result.iteration_s)
    feasible = [plan for plan in evaluated if plan.fits]
    if not feasible:
        raise _no_feasible_plan(budget_bytes, options, incumbent_s, evaluated, unfit if not bare else None)
    return min(feasible, key=lambda plan: (round(plan.result.iteration_s, 12),
                                           max(r.peak_memory_bytes for r in plan.result.ranks),
                                           plan.recompute_share)), evaluated


def _no_feasible_plan(budget_bytes: float, options: PlannerOptions, incumbent_s: float, evaluated: List[Plan],
                      unfit: Optional[Tuple[float, int, ScheduleConfig]]) -> NoFeasiblePlan:
    """Why no plan fits: every candidate's least peak over the budget (``unfit``, when none was simulated), none
    able to beat the incumbent, none fitting on the device alone, or none fitting at all."""
    if unfit is not None:
        peak, rank, config = unfit
        return NoFeasiblePlan(
            f"no schedule fits the memory budget of {budget_bytes / GB:.2f} GiB per device: the smallest peak, with "
            f"every activation recomputed ({config.describe()}), is at least {peak / GB:.2f} GiB on rank {rank}. "
            + _WHAT_WOULD_FIT)
    if not evaluated:
        return NoFeasiblePlan(f"no candidate can beat the incumbent's {incumbent_s:.6f} s (each is slower even "
                              "without recomputation)")
    least = min(evaluated, key=lambda plan: max(r.peak_memory_bytes for r in plan.result.ranks))
    worst = max(least.result.ranks, key=lambda r: r.peak_memory_bytes)
    if options.activation_placement == "device":
        return NoFeasiblePlan(
            f"--pipemesh-activation-placement device keeps every activation on the device, and no schedule fits the "
            f"memory budget of {budget_bytes / GB:.2f} GiB per device that way: the smallest peak "
            f"({least.config.describe()}) is {worst.peak_memory_bytes / GB:.2f} GiB on rank {worst.rank}. What would fit: "
            "--pipemesh-activation-placement auto (host offload and recomputation) or recompute-only, a smaller "
            "--micro-batch-size, more pipeline stages, or a larger budget")
    return NoFeasiblePlan(
        f"no schedule fits the memory budget of {budget_bytes / GB:.2f} GiB per device: the smallest peak, with "
        f"every activation recomputed ({least.config.describe()}), is {worst.peak_memory_bytes / GB:.2f} GiB on rank "
        f"{worst.rank}. " + _WHAT_WOULD_FIT)


def baseline_plans(pp: int, vpp: int, microbatches: int, costs_for, budget_bytes: float,
                   options: PlannerOptions = PlannerOptions(), sharding=None) -> Dict[str, Plan]:
    """Depth-first and breadth-first, each with the recomputation it needs to fit (if any)."""
    return {name: fit_with_recompute(config, costs_for(config), budget_bytes, options, sharding)
            for name, config in (("depth-first", ScheduleConfig.depth_first(pp, vpp, microbatches)),
                                 ("breadth-first", ScheduleConfig.breadth_first(pp, vpp, microbatches)))}
