"""planning/recompute_fit.py: recomputation goes where the queue is longest, to the module set that frees memory
cheapest, and a round covers every estimated peak of a rank."""
from megatron_pipemesh.planning.costs import GB, ClusterSpec, ModelSpec, OpCosts, analytic_costs
from megatron_pipemesh.planning.planner import fit_with_recompute
from megatron_pipemesh.schedule.config import ScheduleConfig
from tests.planning.test_planner import _direct_costs


def test_recompute_goes_to_early_ranks_and_long_waits():
    """Under a tight budget recomputation goes to early ranks and long-waiting micro-batches, and costs time."""
    pp, vpp, m = 4, 2, 12
    costs = _direct_costs(pp)
    plan = fit_with_recompute(ScheduleConfig.breadth_first(pp, vpp, m), costs, 2.0 * GB)
    assert plan.fits and plan.placement
    per_rank = [sum(1 for (r, _, _) in plan.placement if r == rank) for rank in range(pp)]
    assert per_rank[0] >= per_rank[-1]
    # On rank 0 the first micro-batches of chunk 0 wait longest (their backward comes last).
    rank0 = {(c, j) for (r, c, j) in plan.placement if r == 0}
    assert (0, 0) in rank0
    assert plan.result.iteration_s > fit_with_recompute(ScheduleConfig.breadth_first(pp, vpp, m), costs, 100 * GB).result.iteration_s


def test_module_set_levels_are_chosen_where_they_free_memory_cheapest():
    """With a module set that frees most of a chunk for a fraction of full recomputation's time, the planner
    fits the budget with it and is faster than with core_attn / full only; the analytic costs price every
    level the runtime can apply to the model."""
    import dataclasses

    from megatron_pipemesh.planning.costs import planning_levels
    from megatron_pipemesh.planning.planner import PlannerOptions

    pp, vpp, m = 4, 2, 12
    mb = 1024 ** 2
    base = _direct_costs(pp)
    # core_attn frees 5 MB per 0.2 ms, mlp 70 MB per 0.4 ms, full 95 MB per 1 ms: mlp first.
    costs = dataclasses.replace(base, activation_bytes={**base.activation_bytes, "selective": 0.95 * 100 * mb,
                                                        "selective:mlp": 0.3 * 100 * mb},
                                recompute_s={**base.recompute_s, "selective:mlp": 0.4e-3})
    config = ScheduleConfig.breadth_first(pp, vpp, m)
    both = fit_with_recompute(config, costs, 2.0 * GB)
    old = fit_with_recompute(config, costs, 2.0 * GB, PlannerOptions(allow_recompute=("selective", "full")))
    assert both.fits and old.fits and "selective:mlp" in set(both.placement.values())
    assert both.result.iteration_s < old.result.iteration_s
    assert "selective:mlp" in both.to_dict()["recompute_counts"]
    # The levels the runtime applies: mlp sets only without linear biases, layernorm never (needs TE installed).
    biased, bias_free = ModelSpec(num_layers=8, hidden_size=512), ModelSpec(num_layers=8, hidden_size=512, linear_bias=False)
    assert planning_levels(biased) == ("none", "selective", "full")
    assert planning_levels(bias_free) == ("none", "selective", "selective:mlp", "selective:core_attn+mlp", "full")
    assert planning_levels(dataclasses.replace(bias_free, layer_spec="te")) == planning_levels(bias_free)
    model = ModelSpec(num_layers=8, hidden_size=512, num_attention_heads=8, seq_length=512, linear_bias=False)
    analytic = analytic_costs(model, ClusterSpec(), ScheduleConfig.depth_first(2, 2, 4), planning_levels(model))
    assert set(planning_levels(model)) <= set(analytic.activation_bytes) <= set(analytic.recompute_s)


def test_a_recomputation_round_covers_every_estimated_peak_of_a_rank():
    """Breadth-first holds its activations long: the excess shows at many times on each rank. A round takes the
    upgrades at the simulated peak, then at each next peak estimated at the same times, so the fit needs few
    re-simulations (one peak per round took one per peak) and still fits."""
    import megatron_pipemesh.planning.recompute_fit as recompute_fit

    pp, vpp, m = 4, 2, 24
    costs = _direct_costs(pp)
    calls = []
    real = recompute_fit.simulate
    recompute_fit.simulate = lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs)
    try:
        plan = fit_with_recompute(ScheduleConfig.breadth_first(pp, vpp, m), costs, 2.2 * GB)
    finally:
        recompute_fit.simulate = real
    assert plan.fits and plan.placement
    assert len(calls) <= 4, f"{len(calls)} simulations"
