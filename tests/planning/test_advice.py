"""planning/advice.py: the layouts searched, the bound-pruned search against an exhaustive one, and the rows."""
import dataclasses

import pytest

from megatron_pipemesh.planning import advice as adv
from megatron_pipemesh.planning.advice import (AdviceCluster, AdviceProblem, ParallelLayout, advise, candidates,
                                               parallel_layouts)
from megatron_pipemesh.planning.costs import ModelSpec
from megatron_pipemesh.planning.stock import StockSetting

MODEL = ModelSpec(num_layers=8, hidden_size=512, num_attention_heads=8, seq_length=512, micro_batch_size=1,
                  vocab_size=8192)
CLUSTER = AdviceCluster(nodes=2, gpus_per_node=4, nic_gbps=10.0, intra_node_gbps=100.0, device_memory_gb=8.0,
                        device_tflops=50.0)


def problem(**changes) -> AdviceProblem:
    base = AdviceProblem(MODEL, ParallelLayout(1, 4, 2), 2, 32, StockSetting(4, 2, 16), distributed_optimizer=True)
    return dataclasses.replace(base, **changes)


def test_layouts_keep_tp_in_a_node_and_whole_microbatches():
    """TP divides the node and the heads; PP >= 2 and at most the layers; m = batch / (b x DP) >= p; max_tp caps TP."""
    layouts = parallel_layouts(problem(), CLUSTER)
    assert ParallelLayout(1, 4, 2) in layouts and ParallelLayout(2, 2, 2) in layouts
    for layout in layouts:
        assert layout.tp * layout.pp * layout.dp == 8 and CLUSTER.gpus_per_node % layout.tp == 0
        assert layout.pp >= 2 and 32 // layout.dp >= layout.pp
    assert {l.tp for l in parallel_layouts(problem(max_tp=1), CLUSTER)} == {1}
    assert ParallelLayout(1, 8, 1) in layouts  # one stage per GPU: whole stages per node


def test_candidates_are_sorted_by_their_bound_and_drop_what_cannot_hold_its_weights():
    found = candidates(problem(), CLUSTER)
    assert [c.bound_s for c in found] == sorted(c.bound_s for c in found)
    small = dataclasses.replace(CLUSTER, device_memory_gb=0.05)
    assert len(candidates(problem(), small)) < len(found)


def _exhaustive(p: AdviceProblem, cluster: AdviceCluster):
    """The best PipeMesh and stock times over every candidate, without pruning."""
    pm, st = float("inf"), float("inf")
    for c in candidates(p, cluster):
        if c.vpp >= 2:
            plan = adv._plan(c, cluster)
            if plan is not None and plan.fits:
                pm = min(pm, plan.result.iteration_s)
        result = adv._stock(c, p, cluster)
        if result is not None:
            st = min(st, result.iteration_s)
    return pm, st


def test_pruning_finds_the_exhaustive_best_and_simulates_fewer():
    """Pruned by the tight bound, the search finds the same best times as simulating every candidate, and skips some:
    a bound that were not a lower bound, or a prune against the wrong side's time, would fail here."""
    p = problem()
    advice = advise(p, CLUSTER)
    pm, st = _exhaustive(p, CLUSTER)
    assert advice.rows["best_layout"].iteration_s == pytest.approx(pm, rel=1e-9)
    assert advice.rows["best_layout_stock"].iteration_s == pytest.approx(st, rel=1e-9)
    assert advice.searched["pipemesh"] < advice.candidates and advice.searched["stock"] < advice.candidates


def test_rows_user_first_and_best_fits():
    advice = advise(problem(), CLUSTER)
    user = advice.rows["user"]
    assert user.layout == ParallelLayout(1, 4, 2) and user.vpp == 2 and user.stock == StockSetting(4, 2, 16)
    assert advice.rows["pipemesh"].keeps(user) and advice.rows["pipemesh"].plan is not None
    best = advice.best()
    assert best.fits and all(best.iteration_s <= r.iteration_s for r in advice.rows.values() if r and r.fits)


def test_a_user_command_that_does_not_fit_is_a_row_that_does_not_fit():
    """Micro-batches of 8 sequences on 1 GiB: the user's row (no recomputation) exceeds the memory, and is never best."""
    p = problem(model=dataclasses.replace(MODEL, micro_batch_size=8), global_batch=256,
                stock=StockSetting(4, 2, 16))
    cluster = dataclasses.replace(CLUSTER, device_memory_gb=1.5)
    advice = advise(p, cluster)
    assert not advice.rows["user"].fits
    assert advice.best() is None or advice.best().name != "user"


def test_v1_command_has_no_pipemesh_row_and_says_why():
    advice = advise(problem(vpp=1, stock=StockSetting(4, 1, 16)), CLUSTER)
    assert advice.rows["pipemesh"] is None and any(n.startswith("pipemesh:") for n in advice.notes)
    assert advice.rows["best_layout"] is not None and advice.rows["best_layout"].vpp >= 2


def test_a_capped_search_says_so_and_keeps_real_plans():
    """max_simulated stops a side after that many candidates (least bounds first) and flags it; what it returns is
    one of the plans the full search priced, never faster than the full search's best."""
    p = problem()
    found = candidates(p, CLUSTER)
    full: dict = {}
    best_pm, _ = adv.search_layouts(p, CLUSTER, found, stock=False, searched=full)
    capped: dict = {}
    first_pm, _ = adv.search_layouts(p, CLUSTER, found, stock=False, searched=capped, max_simulated=1)
    assert capped["pipemesh"] == 1 and capped.get("capped") == 1 and not full.get("capped")
    assert full["pipemesh"] > 1 and first_pm.iteration_s >= best_pm.iteration_s


def test_placement_flags_without_host_memory_recompute_only():
    """A PipeMesh row's flags ask the runtime for --pipemesh-activation-placement auto with --pipemesh-host-memory-gb 0
    where no host memory was given: fitted that way, the row's groups fit the same budget with no activation on the
    host, as the advice planned them (recomputation only)."""
    from megatron_pipemesh.planning.costs import analytic_costs, planning_levels
    from megatron_pipemesh.planning.planner import PlannerOptions, fit_with_recompute

    p = problem(model=dataclasses.replace(MODEL, micro_batch_size=4), global_batch=128, stock=StockSetting(4, 2, 16))
    cluster = dataclasses.replace(CLUSTER, device_memory_gb=0.7)  # the user's command (no recomputation) does not fit
    row = advise(p, cluster).rows["pipemesh"]
    assert row is not None and row.plan.recompute_share > 0 and not any(r.host_placed for r in row.plan.result.ranks)
    spec = cluster.spec(1, 2, False, True)
    costs = analytic_costs(p.model, spec, row.plan.config, planning_levels(p.model))
    runtime = fit_with_recompute(row.plan.config, costs, cluster.budget_bytes,
                                 PlannerOptions(activation_placement="auto", host_budget_bytes=0.0))
    assert runtime.fits and not any(r.host_placed for r in runtime.result.ranks)
