"""Planner: choose forward/backward groups and a recomputation plan that fit a memory budget.

Search (each candidate is simulated with the same engine the runtime's plan is checked with):

* small spaces: every pair of valid group lists; otherwise
  forward groups = [f_1] + groups of p for the rest; backward groups = groups of p + [b_last]
  (the middle groups only need to be bubble-free, so p is the cheapest size: paper-notes §6);
  f_1 and b_last range over the multiples of p up to m (and m itself);
* for a candidate whose peak memory exceeds the budget on some rank, pipeline-aware
  recomputation is added as a knapsack (:func:`fit_with_recompute`): on each rank over budget,
  the chunk-micro-batches alive at that rank's peak are upgraded by bytes freed per second of
  recomputation (per chunk-micro-batch and level: selective module sets, full), those that wait
  longest between their forward and backward first among equals (early micro-batches on early
  ranks), until the rank fits; the extra backward time is part of the simulated time;
* the fastest candidate that fits on every rank wins (ties: less memory, less recompute).

Pure: no torch, no processes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from ..schedule.config import ScheduleConfig, ScheduleConfigError, depth_first_groups
from ..schedule.ops import OpKind
from .costs import GB, RECOMPUTE_LEVELS, OpCosts
from ..schedule.lower import lower
from .simulator import RecomputePlan, SimulationResult, lowering_for, simulate


class NoFeasiblePlan(ValueError):
    """Nothing fits the memory budget; the message says what would."""


@dataclass
class Plan:
    """A chosen schedule with its recomputation and predicted behaviour."""

    config: ScheduleConfig
    recompute: RecomputePlan
    result: SimulationResult
    budget_bytes: float
    sharding: object = None
    """The :class:`.sharding.ShardingModel` the plan was simulated with (None: no mixed sharding)."""

    @property
    def fits(self) -> bool:
        return all(r.peak_memory_bytes <= self.budget_bytes for r in self.result.ranks)

    @property
    def recompute_share(self) -> float:
        """Recompute time as a fraction of the iteration (mean over ranks)."""
        ranks = self.result.ranks
        return sum(r.recompute_s for r in ranks) / (len(ranks) * self.result.iteration_s) if self.result.iteration_s else 0.0

    def summary(self) -> str:
        """One line: the group flags, predicted iteration time, peak memory per rank, recompute share."""
        peaks = " ".join(f"{r.peak_memory_bytes / GB:.2f}" for r in self.result.ranks)
        return (f"{self.config.group_flags()}; predicted iteration {self.result.iteration_s * 1e3:.1f} ms, peak memory "
                f"GiB per rank {peaks}, recompute {100 * self.recompute_share:.2f}% of the time")

    def to_dict(self) -> dict:
        counts = {level: 0 for level in RECOMPUTE_LEVELS if level != "none"}
        for level in self.recompute.values():
            if level != "none":
                counts[level] = counts.get(level, 0) + 1
        return {
            "forward_groups": list(self.config.forward_groups),
            "backward_groups": list(self.config.backward_groups),
            "predicted_iteration_time_s": self.result.iteration_s,
            "idle_fraction": self.result.idle_fraction,
            "exposed_comm_s": [r.exposed_p2p_s + r.exposed_dp_s for r in self.result.ranks],
            "peak_memory_gb": [r.peak_memory_bytes / GB for r in self.result.ranks],
            "memory_budget_gb": self.budget_bytes / GB,
            "fits": self.fits,
            "recompute_share": self.recompute_share,
            "recompute_counts": counts,
            "recompute": [{"rank": r, "chunk": c, "microbatch": j, "level": level}
                          for (r, c, j), level in sorted(self.recompute.items()) if level != "none"],
            **({"sharding": list(self.sharding.spec.levels), "shard_scope": self.sharding.spec.scope}
               if self.sharding is not None else {}),
        }


@dataclass(frozen=True)
class PlannerOptions:
    """Search space and limits."""

    first_forward_candidates: Optional[Tuple[int, ...]] = None
    """f_1 values to try; default: multiples of p up to m, and m."""
    last_backward_candidates: Optional[Tuple[int, ...]] = None
    """b_last values to try; default: multiples of p up to m, and m."""
    allow_recompute: Tuple[str, ...] = ("selective", "full")
    """Recompute levels the planner may use (:func:`.memory.parse_level` names; PipeMesh's runtime
    applies 'selective' (core_attn) and 'full' per chunk-micro-batch)."""
    max_recompute_rounds: int = 64
    """Re-simulations per candidate while adding recomputation."""
    exhaustive_limit: int = 400
    """Search every pair of group lists when there are at most this many pairs."""


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


def _moves(costs: OpCosts, level: str, allowed: Sequence[str]) -> List[Tuple[float, float, str]]:
    """(bytes freed per second of recomputation, bytes freed, new level) of every upgrade from
    ``level`` that frees memory, best ratio first. (A backward's transient recomputation bytes are
    held once per rank, by the one backward running, not per chunk-micro-batch: the simulation
    that follows each round accounts for them.)"""
    have, spent = costs.activation_bytes[level], costs.recompute_s.get(level, 0.0)
    out = []
    for new in allowed:
        freed = have - costs.activation_bytes[new]
        extra = costs.recompute_s[new] - spent
        if freed > 0:
            out.append((freed / extra if extra > 0 else float("inf"), freed, new))
    return sorted(out, reverse=True)


def fit_with_recompute(config: ScheduleConfig, costs: OpCosts, budget_bytes: float,
                       options: PlannerOptions = PlannerOptions(), sharding=None) -> Plan:
    """Add pipeline-aware recomputation to ``config`` until every rank fits ``budget_bytes``
    (or nothing is left to recompute; the returned plan then has ``fits == False``).

    A knapsack by bytes freed per second of recomputation: on each rank over budget, among the
    chunk-micro-batches alive at its peak, take the upgrades (to any allowed level: selective
    module sets, full) with the most bytes freed per second of extra backward time first, the
    longest-waiting chunk-micro-batch first among equals, one upgrade per chunk-micro-batch per
    round, until the excess is covered; then re-simulate (the peak may move) and repeat.
    """
    plan: RecomputePlan = {}
    allowed = [level for level in options.allow_recompute if level in costs.activation_bytes]
    options_ = lowering_for(costs)
    schedule = lower(config, sharding.lowering(options_) if sharding is not None else options_)
    result = simulate(config, costs, plan, schedule, sharding)
    for _ in range(options.max_recompute_rounds):
        over = [r for r in result.ranks if r.peak_memory_bytes > budget_bytes]
        if not over:
            break
        changed = False
        for rank_result in over:
            rank = rank_result.rank
            excess = rank_result.peak_memory_bytes - budget_bytes
            candidates = []
            for wait, chunk, microbatch in _live_at_peak(result, rank):
                key = (rank, chunk, microbatch)
                moves = _moves(costs, plan.get(key, "none"), allowed)
                if moves:
                    ratio, freed, new = moves[0]
                    candidates.append((ratio, wait, freed, key, new))
            for _, _, freed, key, new in sorted(candidates, reverse=True):
                if excess <= 0:
                    break
                plan[key] = new
                excess -= freed
                changed = True
        if not changed:
            break
        result = simulate(config, costs, plan, schedule, sharding)
    return Plan(config, plan, result, budget_bytes, sharding)


def plan_schedule(pp: int, vpp: int, microbatches: int, costs_for, budget_bytes: float,
                  options: PlannerOptions = PlannerOptions(),
                  incumbent_s: float = float("inf"), sharding=None) -> Tuple[Plan, List[Plan]]:
    """Search the candidates; return (best fitting plan, every plan fitted with recomputation).

    Candidates whose time without recomputation already exceeds the best fitting time (or
    ``incumbent_s``, a time known to be reachable otherwise, e.g. with another V) are skipped.

    ``costs_for(config) -> OpCosts`` gives the costs of a candidate (they do not depend on the
    groups for analytic costs, but measured ones may). ``sharding`` (a :class:`.sharding.ShardingModel`)
    simulates every candidate with those per-chunk levels. Raises :class:`NoFeasiblePlan`.
    """
    # Recomputation only lengthens backwards, and a fixed-order schedule never finishes earlier when
    # an op gets longer: a candidate's time without recomputation bounds its time with it. Fit the
    # candidates in order of that bound and stop once the bound reaches the best fitting time.
    bare = []
    for config in candidate_configs(pp, vpp, microbatches, options):
        costs = costs_for(config)
        bare.append((simulate(config, costs, sharding=sharding).iteration_s, config, costs))
    bare.sort(key=lambda item: item[0])
    evaluated, best_time = [], incumbent_s
    for bound, config, costs in bare:
        if bound > best_time:
            break
        plan = fit_with_recompute(config, costs, budget_bytes, options, sharding)
        evaluated.append(plan)
        if plan.fits:
            best_time = min(best_time, plan.result.iteration_s)
    feasible = [plan for plan in evaluated if plan.fits]
    if not evaluated:
        raise NoFeasiblePlan(f"no candidate can beat the incumbent's {incumbent_s:.6f} s (each is slower even "
                             "without recomputation)")
    if not feasible:
        least = min(evaluated, key=lambda plan: max(r.peak_memory_bytes for r in plan.result.ranks))
        peak = max(r.peak_memory_bytes for r in least.result.ranks)
        static = max(least.result.ranks, key=lambda r: r.peak_memory_bytes)
        raise NoFeasiblePlan(
            f"no schedule fits the memory budget of {budget_bytes / GB:.2f} GiB per device: the smallest peak, with "
            f"every activation recomputed ({least.config.describe()}), is {peak / GB:.2f} GiB on rank {static.rank}. "
            "What would fit: a smaller --micro-batch-size, more pipeline stages (--pipeline-model-parallel-size) or "
            "tensor parallelism to split weights and activations, the distributed optimizer over more data-parallel "
            "ranks to shard optimizer state, or a larger budget")
    best = min(feasible, key=lambda plan: (round(plan.result.iteration_s, 12),
                                           max(r.peak_memory_bytes for r in plan.result.ranks),
                                           plan.recompute_share))
    return best, evaluated


def baseline_plans(pp: int, vpp: int, microbatches: int, costs_for, budget_bytes: float,
                   options: PlannerOptions = PlannerOptions(), sharding=None) -> Dict[str, Plan]:
    """Depth-first and breadth-first, each with the recomputation it needs to fit (if any)."""
    return {name: fit_with_recompute(config, costs_for(config), budget_bytes, options, sharding)
            for name, config in (("depth-first", ScheduleConfig.depth_first(pp, vpp, microbatches)),
                                 ("breadth-first", ScheduleConfig.breadth_first(pp, vpp, microbatches)))}
