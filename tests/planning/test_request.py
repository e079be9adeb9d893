"""The typed plan request (planning/request.py): each field checked where it is declared."""
import pytest

from megatron_pipemesh.planning.clusters import PLANNING_CLUSTER
from megatron_pipemesh.planning.costs import GB, ModelSpec, OpCosts
from megatron_pipemesh.planning.request import AUTO, GROUPS, PLACED_GROUPS, PLAN_FILE, LoweringSettings, PlanRequest


def test_lowering_settings_are_checked_where_declared():
    """A negative receive lookahead names the flag and an example; unknown levels and scopes name the valid ones."""
    with pytest.raises(ValueError, match=r"--pipemesh-recv-lookahead -1 is invalid.*Example"):
        LoweringSettings(recv_lookahead=-1)
    with pytest.raises(ValueError, match="unknown sharding level"):
        LoweringSettings(sharding=("optim", "zero9"))
    with pytest.raises(ValueError, match="shard scope"):
        LoweringSettings(shard_scope="rack")
    assert LoweringSettings(sharding=["optim", "optim_grads"]).levels == ("optim", "optim_grads")
    assert LoweringSettings(sharding="auto").levels == ()


def test_planner_sources_need_what_the_planner_prices():
    """auto and placed groups need the model, cluster and budget (or direct costs); a plan file its path; sharding
    auto the planner; direct costs no sharding to price."""
    with pytest.raises(ValueError, match="model, cluster"):
        PlanRequest(4, 2, 12, AUTO, budget_bytes=GB)
    with pytest.raises(ValueError, match="budget_bytes"):
        PlanRequest(4, 2, 12, PLACED_GROUPS, forward_groups=(6, 6), model=ModelSpec(), cluster=PLANNING_CLUSTER)
    with pytest.raises(ValueError, match="must be > 0"):
        PlanRequest(4, 2, 12, AUTO, model=ModelSpec(), cluster=PLANNING_CLUSTER, budget_bytes=0.0)
    with pytest.raises(ValueError, match="path"):
        PlanRequest(4, 2, 12, PLAN_FILE)
    with pytest.raises(ValueError, match="sharding auto"):
        PlanRequest(4, 2, 12, GROUPS, lowering=LoweringSettings(sharding="auto"))
    with pytest.raises(ValueError, match="plan source"):
        PlanRequest(4, 2, 12, "guess")
    direct = OpCosts(forward_s=1.0, backward_s=2.0, p2p_s=0.0, static_bytes=(0.0,) * 4)
    request = PlanRequest(4, 2, 12, AUTO, budget_bytes=GB, direct_costs=direct)
    first, second = request.costs_for(None), request.costs_for(None)
    assert first.forward_s == 1.0 and first is not second and first.activation_bytes is not second.activation_bytes
    with pytest.raises(ValueError, match="directly"):
        PlanRequest(4, 2, 12, AUTO, budget_bytes=GB, direct_costs=direct, price_sharding=True,
                    lowering=LoweringSettings(sharding=("optim", "optim")))
