"""``resolve(request) -> Resolution``: the one place a run's :class:`~..schedule.plan.RunPlan` is made.

Every plan source of :class:`.request.PlanRequest` ends here: a plan file (its groups, levers, levels and reload
lookahead, with the request's lowering settings), the planner (``auto``: groups and memory levers, optionally the
sharding levels), given groups (or Megatron's group size), given groups with the planner's memory levers. The plan
comes out complete; nobody changes it afterwards (the measured re-planner resolves a new request instead).

Pure: no torch, no processes.
"""
from __future__ import annotations

import dataclasses

from dataclasses import dataclass
from typing import Optional

from ..schedule.config import ScheduleConfig
from ..schedule.plan import RunPlan, RunPlanError, megatron_groups
from .costs import GB
from .planner import NoFeasiblePlan, Plan, fit_with_recompute, plan_schedule
from .request import AUTO, GROUPS, PLACED_GROUPS, PLAN_FILE, SHARDING_AUTO, PlanRequest


@dataclass(frozen=True)
class Resolution:
    """A resolved request: the plan the runtime runs, and what the planner made it from."""

    plan: RunPlan
    """The complete plan."""
    chosen: Optional[Plan] = None
    """The planner's plan (its prediction and summary); None for a plan file or given groups alone."""
    candidates: int = 0
    """Candidates the planner evaluated (group lists, or level mixes with their best groups)."""


def resolve(request: PlanRequest) -> Resolution:
    """The plan of ``request``. Raises ValueError (a :class:`~..schedule.plan.RunPlanError` for a plan file,
    :class:`~..schedule.config.ScheduleConfigError` for groups, :class:`.planner.NoFeasiblePlan` when nothing fits)
    with a message naming what is wrong."""
    if request.source == PLAN_FILE:
        return Resolution(_from_file(request))
    if request.source == AUTO:
        return _planned(request)
    config = given_config(request)
    if request.source == GROUPS:
        lowering = request.lowering
        given = request.forward_groups is not None or request.backward_groups is not None
        return Resolution(RunPlan(config if given else None, sharding=lowering.levels,
                                  shard_scope=lowering.shard_scope, recv_lookahead=lowering.recv_lookahead))
    assert request.source == PLACED_GROUPS
    chosen = fit_with_recompute(config, request.costs_for(config), request.budget_bytes, request.planner)
    if not chosen.fits:
        peak = max(r.peak_memory_bytes for r in chosen.result.ranks)
        raise NoFeasiblePlan(f"{config.describe()} does not fit the memory budget of {request.budget_bytes / GB:.2f} GiB "
                             f"per device even with host placement and recomputation (peak {peak / GB:.2f} GiB)")
    return Resolution(_run_plan(chosen, request), chosen, 1)


def given_config(request: PlanRequest) -> ScheduleConfig:
    """The schedule of given groups: a missing forward list is Megatron's group size (as the runtime would choose
    it), a missing backward list the forward's; neither given: Megatron's group size in both directions."""
    pp, vpp, m = request.pp, request.vpp, request.microbatches
    forward, backward = request.forward_groups, request.backward_groups
    if forward is None and backward is None:
        return ScheduleConfig.uniform(pp, vpp, m, request.group_size or pp)
    return ScheduleConfig(pp, vpp, m, forward or megatron_groups(pp, m, request.group_size), backward or ())


def _run_plan(chosen: Plan, request: PlanRequest) -> RunPlan:
    lowering = request.lowering
    return chosen.run_plan(lowering.recv_lookahead, lowering.levels, lowering.shard_scope)


def _planned(request: PlanRequest) -> Resolution:
    """``auto``: the planner's groups and memory levers (and, with sharding auto, the levels per chunk; with priced
    given levels, the groups and levers for them)."""
    pp, vpp, m = request.pp, request.vpp, request.microbatches
    if request.prices_sharding:
        from .sharding import plan_with_sharding

        chosen, by_levels = plan_with_sharding(pp, vpp, m, request.costs_for, request.budget_bytes, request.model,
                                               request.cluster, request.lowering.shard_scope, request.lowering.sharding,
                                               request.planner)
        evaluated = [plan for plan in by_levels.values() if plan is not None]
    else:
        chosen, evaluated = plan_schedule(pp, vpp, m, request.costs_for, request.budget_bytes, request.planner)
    return Resolution(_run_plan(chosen, request), chosen, len(evaluated))


def _from_file(request: PlanRequest) -> RunPlan:
    """The saved plan with the request's lowering settings; its sharding levels, when it has any, are the run's."""
    saved = load_plan_file(request.plan_file, request.pp, request.vpp, request.microbatches)
    lowering = request.lowering
    if saved.sharding and lowering.sharding not in ((), SHARDING_AUTO) and lowering.sharding != saved.sharding:
        raise RunPlanError(f"--pipemesh-sharding {' '.join(lowering.sharding)} and --pipemesh-plan {request.plan_file} "
                           f"(sharding {' '.join(saved.sharding)}) disagree; the plan file holds the levels. Drop one of "
                           "them")
    # Everything else the file holds (placement, lookaheads, host blocks, prediction) is kept as saved.
    return dataclasses.replace(saved, sharding=saved.sharding or lowering.levels, shard_scope=lowering.shard_scope,
                               recv_lookahead=lowering.recv_lookahead)


def load_plan_file(path: str, pp: int, vpp: int, microbatches: int) -> RunPlan:
    """A plan saved by ``pipemesh plan --output``; raises ValueError naming the mismatch."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as error:
        raise ValueError(f"--pipemesh-plan {path}: cannot read the plan ({error}). Create one with "
                         "`pipemesh plan ... --output plan.json`") from error
    try:
        plan = RunPlan.from_json(text)
    except RunPlanError as error:
        raise ValueError(f"--pipemesh-plan {path}: {error}") from error
    found = (plan.schedule.pp, plan.schedule.vpp, plan.schedule.microbatches)
    if found != (pp, vpp, microbatches):
        raise ValueError(f"--pipemesh-plan {path} was made for p, V, m = {found} but this run has {(pp, vpp, microbatches)}; "
                         "re-run `pipemesh plan` with this run's sizes")
    return plan
