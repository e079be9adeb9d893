"""resolve(request) -> RunPlan (planning/resolve.py): every plan source, complete plans, nothing patched after."""
import json

import pytest

from megatron_pipemesh.planning.clusters import PLANNING_CLUSTER, costs_for
from megatron_pipemesh.planning.costs import GB, ModelSpec
from megatron_pipemesh.planning.planner import NoFeasiblePlan, PlannerOptions, fit_with_recompute, plan_schedule
from megatron_pipemesh.planning.request import AUTO, GROUPS, PLACED_GROUPS, PLAN_FILE, LoweringSettings, PlanRequest
from megatron_pipemesh.planning.resolve import resolve
from megatron_pipemesh.schedule.config import ScheduleConfig
from megatron_pipemesh.schedule.plan import RunPlan, RunPlanError

MODEL = ModelSpec(num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=128)
CLUSTER = PLANNING_CLUSTER


def _planned(source=AUTO, budget=1.0, **fields):
    return PlanRequest(4, 2, 12, source, model=MODEL, cluster=CLUSTER, budget_bytes=budget * GB, **fields)


def test_auto_is_the_planners_best_with_the_requests_lowering():
    """auto: the planner's best plan, carrying the request's receive lookahead and levels (nothing set afterwards)."""
    lowering = LoweringSettings(recv_lookahead=3, sharding=("optim", "optim"))
    resolution = resolve(_planned(lowering=lowering))
    best, evaluated = plan_schedule(4, 2, 12, lambda cfg: costs_for(MODEL, CLUSTER, cfg), GB, PlannerOptions())
    assert resolution.plan == best.run_plan(3, ("optim", "optim"))
    assert resolution.candidates == len(evaluated) and resolution.chosen.config == best.config


def test_given_groups_fill_a_missing_list_with_megatrons_group_size():
    """A missing forward list is Megatron's group size; neither list: the plan follows Megatron's size per call."""
    plan = resolve(PlanRequest(4, 2, 12, GROUPS, backward_groups=(6, 6), group_size=6)).plan
    assert plan.schedule.forward_groups == (6, 6) and plan.schedule.backward_groups == (6, 6)
    assert resolve(PlanRequest(4, 2, 12, GROUPS)).plan.schedule is None


def test_placed_groups_fit_or_name_the_budget():
    """Given groups with placement: the fitted plan of those groups, or NoFeasiblePlan naming groups and budget."""
    config = ScheduleConfig(4, 2, 12, (6, 6), (6, 6))
    resolution = resolve(_planned(PLACED_GROUPS, budget=0.05, forward_groups=(6, 6), backward_groups=(6, 6)))
    fitted = fit_with_recompute(config, costs_for(MODEL, CLUSTER, config), 0.05 * GB, PlannerOptions())
    assert resolution.plan == fitted.run_plan()
    with pytest.raises(NoFeasiblePlan, match=r"--forward-groups 6 6 .* does not fit the memory budget of 0\.00 GiB"):
        resolve(_planned(PLACED_GROUPS, budget=0.001, forward_groups=(6, 6), backward_groups=(6, 6)))


def test_plan_file_keeps_its_levels_and_takes_the_requests_lookahead(tmp_path):
    """A plan file: its groups, levers, levels and reload lookahead, with the request's receive lookahead; levels
    that disagree with the file's are refused naming both."""
    saved = RunPlan(ScheduleConfig(4, 2, 12, (8, 4), (6, 6)), {(0, 0, 1): "full"}, ("optim", "optim_grads"),
                    reload_lookahead=3)
    path = tmp_path / "plan.json"
    path.write_text(saved.to_json())
    request = PlanRequest(4, 2, 12, PLAN_FILE, plan_file=str(path), lowering=LoweringSettings(recv_lookahead=2))
    plan = resolve(request).plan
    assert (plan.schedule, plan.placement, plan.sharding, plan.reload_lookahead, plan.recv_lookahead) == (
        saved.schedule, saved.placement, saved.sharding, 3, 2)
    with pytest.raises(RunPlanError, match="disagree"):
        resolve(PlanRequest(4, 2, 12, PLAN_FILE, plan_file=str(path),
                            lowering=LoweringSettings(sharding=("optim", "optim"))))
    with pytest.raises(ValueError, match="was made for p, V, m"):
        resolve(PlanRequest(4, 2, 24, PLAN_FILE, plan_file=str(path)))
    assert json.loads(path.read_text())["forward_groups"] == [8, 4]
