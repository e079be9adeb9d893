"""planning/plan.py: the planner's plan names where each activation is kept 'placement', in its report and in the
RunPlan (and plan file) it makes."""
from megatron_pipemesh.planning.costs import OpCosts
from megatron_pipemesh.planning.planner import PlannerOptions, fit_with_recompute
from megatron_pipemesh.schedule import ScheduleConfig
from megatron_pipemesh.schedule.plan import PREDICTION_KEYS, RunPlan

CFG = ScheduleConfig.breadth_first(2, 2, 4)
BYTES = 1e8


def _costs() -> OpCosts:
    """Copies of 0.1 s against 1 s forwards: the host link hides them (as tests/planning/test_host_placement.py)."""
    return OpCosts(forward_s=1.0, backward_s=2.0, p2p_s=0.0,
                   activation_bytes={"none": BYTES, "selective": BYTES / 2, "full": BYTES / 10},
                   recompute_s={"none": 0.0, "selective": 0.2, "full": 1.0},
                   host_link_gbps=BYTES * 8 / 0.1 / 1e9, static_bytes=(0.0, 0.0))


def test_the_placement_holds_host_and_recomputation_and_reaches_the_plan_file():
    plan = fit_with_recompute(CFG, _costs(), 5.5 * BYTES, PlannerOptions(activation_placement="auto"))
    assert plan.fits and "host" in set(plan.placement.values())
    report = plan.to_dict()
    assert "recompute" not in report
    assert {(e["rank"], e["chunk"], e["microbatch"]): e["level"] for e in report["placement"]} == plan.placement
    assert sum(report["placement_counts"][0].values()) == CFG.vpp * CFG.microbatches
    run = plan.run_plan()
    assert run.placement == plan.placement and run.reload_lookahead == plan.reload_lookahead
    assert set(run.predicted) == set(PREDICTION_KEYS)
    saved = run.to_dict()
    assert "recompute" not in saved and RunPlan.from_dict(saved) == run
