"""Planner: plans fit the budget, auto beats every manual group list, recompute goes where the
queue is longest, and the `pipemesh plan` command."""
import json

import pytest
from hypothesis import given, settings, strategies as st

from megatron_pipemesh.command import main
from megatron_pipemesh.planning.costs import GB, ClusterSpec, ModelSpec, OpCosts, analytic_costs
from megatron_pipemesh.planning.planner import (NoFeasiblePlan, candidate_configs, compositions, fit_with_recompute,
                                                 plan_schedule)
from megatron_pipemesh.planning.simulator import SearchTimeUp
from megatron_pipemesh.schedule.config import ScheduleConfig, ScheduleConfigError


def _direct_costs(pp, act_mb=100.0, dp_ms=20.0):
    mb = 1024 ** 2
    return OpCosts(forward_s=1e-3, backward_s=2e-3, p2p_s=1e-4, dp_reduce_s=dp_ms * 1e-3, dp_gather_s=dp_ms * 1e-3,
                   activation_bytes={"none": act_mb * mb, "selective": 0.4 * act_mb * mb, "full": 0.05 * act_mb * mb},
                   recompute_s={"none": 0.0, "selective": 0.2e-3, "full": 1e-3},
                   static_bytes=tuple(1.0 * GB for _ in range(pp)))


def test_compositions():
    """compositions lists the ordered group lists with parts >= the minimum, or None above the limit."""
    assert compositions(6, 2, 100) == [(2, 2, 2), (2, 4), (3, 3), (4, 2), (6,)]
    assert compositions(40, 2, 10) is None


@settings(max_examples=40, deadline=None)
@given(pp=st.sampled_from([2, 4]), vpp=st.sampled_from([2, 3]), factor=st.integers(1, 3),
       hidden=st.sampled_from([512, 1024, 2048]), seq=st.sampled_from([512, 1024, 2048]),
       dp=st.sampled_from([1, 2, 4]), budget_gb=st.floats(0.5, 40.0))
def test_plan_always_fits_the_budget(pp, vpp, factor, hidden, seq, dp, budget_gb):
    """Whatever the model and budget: the returned plan fits every rank, or NoFeasiblePlan says why."""
    model = ModelSpec(num_layers=pp * vpp * 2, hidden_size=hidden, num_attention_heads=8, seq_length=seq)
    cluster = ClusterSpec(dp=dp, dp_gbps=10, p2p_gbps=10)
    m = pp * factor
    try:
        best, evaluated = plan_schedule(pp, vpp, m, lambda cfg: analytic_costs(model, cluster, cfg), budget_gb * GB)
    except NoFeasiblePlan as error:
        assert "What would fit" in str(error)
        return
    assert best.fits
    assert all(r.peak_memory_bytes <= budget_gb * GB for r in best.result.ranks)
    assert best.result.iteration_s == min(p.result.iteration_s for p in evaluated if p.fits)


def _all_pairs(pp, vpp, m):
    lists = compositions(m, pp, 10_000)
    for forward in lists:
        for backward in lists:
            try:
                yield ScheduleConfig(pp, vpp, m, forward, backward)
            except ScheduleConfigError:
                continue


@pytest.mark.parametrize("pp, vpp, m", [(2, 2, 4), (2, 2, 6), (2, 3, 8), (3, 2, 6), (4, 2, 8)])
@pytest.mark.parametrize("budget_gb", [1.5, 2.0, 4.0])
def test_auto_matches_or_beats_every_manual_group_list(pp, vpp, m, budget_gb):
    """The planner's choice is at least as fast as every manual group pair that fits the budget."""
    costs = _direct_costs(pp)
    best, _ = plan_schedule(pp, vpp, m, lambda cfg: costs, budget_gb * GB)
    for config in _all_pairs(pp, vpp, m):
        manual = fit_with_recompute(config, costs, budget_gb * GB)
        if manual.fits:
            assert best.result.iteration_s <= manual.result.iteration_s + 1e-12, config.describe()


def test_a_search_out_of_time_stops_before_its_next_simulation():
    """time_up is asked before each simulation and fit: the search stops at the first True with SearchTimeUp, and
    a limit that never passes changes nothing."""
    costs = _direct_costs(2)
    best, evaluated = plan_schedule(2, 2, 6, lambda cfg: costs, 2.0 * GB)
    asked = []
    same, again = plan_schedule(2, 2, 6, lambda cfg: costs, 2.0 * GB, time_up=lambda: asked.append(1) is not None)
    assert same.config == best.config and same.result.iteration_s == best.result.iteration_s
    assert len(again) == len(evaluated) and len(asked) > len(evaluated)
    for stop_at in (1, len(asked) - 1):  # before the first simulation; before the last one
        asked.clear()
        with pytest.raises(SearchTimeUp):
            plan_schedule(2, 2, 6, lambda cfg: costs, 2.0 * GB, time_up=lambda: len(asked) >= stop_at or asked.append(1))
        assert len(asked) == stop_at


def test_no_plan_fits_names_what_would():
    """When nothing fits, the error names what would (e.g. a smaller --micro-batch-size)."""
    with pytest.raises(NoFeasiblePlan, match="smaller --micro-batch-size"):
        plan_schedule(2, 2, 4, lambda cfg: _direct_costs(2), 0.5 * GB)


def test_candidates_include_presets_for_large_spaces():
    """Large search spaces are cut below 100 candidates but keep depth-first and breadth-first."""
    configs = candidate_configs(8, 4, 64)
    names = {c.preset_name() for c in configs}
    assert {"depth-first", "breadth-first"} <= names
    assert len(configs) < 100


PLAN = ["plan", "--pp", "4", "--vpp", "2", "-m", "12", "--num-layers", "24", "--hidden-size", "2048",
        "--num-attention-heads", "16", "--seq-length", "2048", "--dp", "2"]


def test_plan_command_table_and_json(capsys, tmp_path):
    """`pipemesh plan` prints a table with the baselines and JSON whose peaks fit the budget, and saves the plan."""
    assert main(PLAN + ["--device-memory-gb", "12", "--output", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "pipemesh" in out and "depth-first" in out and "breadth-first" in out and "--forward-groups" in out
    assert main(PLAN + ["--memory-budget-gb", "10.8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in ("forward_groups", "backward_groups", "predicted_iteration_time_s", "peak_memory_gb", "baselines"):
        assert key in data
    assert len(data["peak_memory_gb"]) == 4 and max(data["peak_memory_gb"]) <= 10.8
    saved = json.loads((tmp_path / "p.json").read_text())
    assert saved["pp"] == 4 and saved["microbatches"] == 12


def test_plan_command_nothing_fits_exits_2(capsys):
    """`pipemesh plan` with an impossible budget exits 2 naming what would fit, no traceback."""
    assert main(PLAN + ["--memory-budget-gb", "1"]) == 2
    err = capsys.readouterr().err
    assert "no schedule fits" in err and "What would fit" in err and "Traceback" not in err


@pytest.mark.parametrize("pp,vpp,m,budget_gb,incumbent", [(4, 2, 16, 1.6, float("inf")), (4, 2, 16, 1.6, 0.162),
                                                          (2, 3, 12, 1.8, float("inf")), (4, 2, 24, 100.0, 0.2016),
                                                          (4, 2, 24, 100.0, 0.1)])
def test_fit_limit_and_incumbent_fit_the_fastest_lists_as_without_pruning(pp, vpp, m, budget_gb, incumbent):
    """With a fit limit the planner stops simulating a group list once it ends after the limit-th fastest so far
    (or the incumbent) and starts each fit from the list's own simulation: it fits exactly the lists, and returns
    exactly the plan, of simulating every list that can fit to its end and fitting the fastest from scratch."""
    from megatron_pipemesh.planning.planner import PlannerOptions, least_peaks
    from megatron_pipemesh.planning.simulator import simulate

    costs = _direct_costs(pp)
    options = PlannerOptions(first_forward_candidates=(pp, m), last_backward_candidates=(pp, m), fit_limit=2)
    can_fit = [config for config in candidate_configs(pp, vpp, m, options)
               if max(least_peaks(config, costs, ["none", "selective", "full"])) <= budget_gb * GB]
    bare = sorted(((simulate(config, costs).iteration_s, i, config) for i, config in enumerate(can_fit)),
                  key=lambda item: item[:2])
    fitted, best_time = [], incumbent
    for time, _, config in bare:
        if time > best_time or len(fitted) == 2:
            break
        fitted.append(fit_with_recompute(config, costs, budget_gb * GB, options))
        if fitted[-1].fits:
            best_time = min(best_time, fitted[-1].result.iteration_s)
    if not fitted:
        with pytest.raises(NoFeasiblePlan, match="can beat the incumbent"):
            plan_schedule(pp, vpp, m, lambda cfg: costs, budget_gb * GB, options, incumbent_s=incumbent)
        return
    best, evaluated = plan_schedule(pp, vpp, m, lambda cfg: costs, budget_gb * GB, options, incumbent_s=incumbent)
    assert [(p.config, p.placement, p.result.iteration_s) for p in evaluated] == \
        [(p.config, p.placement, p.result.iteration_s) for p in fitted]
    assert best.result.iteration_s == min(p.result.iteration_s for p in fitted if p.fits)


def _uneven_costs(pp, vpp, layers, dp=2):
    """Analytic costs of a small GPT whose stages hold ``layers`` (embedding and loss on their stages), every level
    the planner uses priced."""
    from megatron_pipemesh.planning.costs import planning_levels
    from megatron_pipemesh.planning.layout import LayerSplit

    model = ModelSpec(num_layers=sum(layers), hidden_size=1024, num_attention_heads=8, seq_length=1024,
                      vocab_size=32000, layer_split=LayerSplit.of_stages(layers))
    cluster = ClusterSpec(dp=dp, dp_gbps=10, p2p_gbps=10)
    return lambda config: analytic_costs(model, cluster, config, planning_levels(model))


@pytest.mark.parametrize("pp, vpp, m, layers", [(2, 2, 6, (1, 2, 2, 1)), (4, 2, 8, (1, 2, 2, 2, 2, 2, 2, 0)),
                                                (3, 2, 9, (2, 2, 2, 2, 2, 2)), (2, 2, 6, (2, 0, 2, 2))])
def test_least_peaks_equal_the_bare_peak_and_bound_every_recomputation_plan(pp, vpp, m, layers):
    """least_peaks is the simulator's peak where one level is allowed (the bare schedule: equal, rank by rank), and
    under random per chunk-micro-batch recomputation plans over every level no rank peaks below it."""
    import random

    from megatron_pipemesh.planning.planner import least_peaks
    from megatron_pipemesh.planning.simulator import simulate
    from megatron_pipemesh.schedule.levers import DEVICE

    costs_for = _uneven_costs(pp, vpp, layers)
    rng = random.Random(7)
    configs = candidate_configs(pp, vpp, m)
    for config in configs[:: max(1, len(configs) // 6)]:
        costs = costs_for(config)
        levels = [DEVICE] + [level for level in costs.activation_bytes if level != DEVICE]
        bare = simulate(config, costs)
        assert least_peaks(config, costs, [DEVICE]) == pytest.approx([r.peak_memory_bytes for r in bare.ranks], rel=1e-12)
        floor = least_peaks(config, costs, levels)
        for _ in range(4):
            plan = {(r, c, j): rng.choice(levels) for r in range(pp) for c in range(vpp) for j in range(m)}
            peaks = [r.peak_memory_bytes for r in simulate(config, costs, plan).ranks]
            assert all(p >= f * (1 - 1e-12) for p, f in zip(peaks, floor)), (config.describe(), peaks, floor)


def test_least_peaks_skip_the_transient_of_a_backward_that_takes_no_time():
    """A backward of zero time frees before it allocates on the simulator's timeline, so its recomputation's transient
    never counts: least_peaks equals the peak of recomputing everything, where counting that transient would put the
    bound above it."""
    from megatron_pipemesh.planning.planner import least_peaks
    from megatron_pipemesh.planning.simulator import simulate

    mb, pp, vpp, m = 1024 ** 2, 2, 2, 4
    costs = OpCosts(forward_s=1e-3, backward_s=0.0, p2p_s=1e-4, activation_bytes={"none": 100 * mb, "full": 5 * mb},
                    recompute_s={"none": 0.0, "full": 0.0}, transient_bytes={"full": 200 * mb},
                    static_bytes=(1.0 * GB,) * pp)
    config = ScheduleConfig.depth_first(pp, vpp, m)
    everything = {(r, c, j): "full" for r in range(pp) for c in range(vpp) for j in range(m)}
    peaks = [r.peak_memory_bytes for r in simulate(config, costs, everything).ranks]
    assert least_peaks(config, costs, ["none", "full"]) == pytest.approx(peaks, rel=1e-12)


@pytest.mark.parametrize("budget_gb", [1.06, 1.075, 1.09])
def test_lists_that_cannot_fit_are_not_simulated_and_the_plan_is_the_same(budget_gb):
    """Group lists whose least peak under any recomputation is over the budget are dropped before their simulation:
    the planner simulates fewer lists and, fitting every list that may win, returns the plan it returns when it
    simulates them all; with every list over, it says so before simulating anything."""
    import megatron_pipemesh.planning.planner as planner
    from megatron_pipemesh.planning.planner import PlannerOptions

    pp, vpp, m = 4, 2, 12
    costs = _direct_costs(pp)
    options = PlannerOptions(activation_placement="recompute-only")
    calls, real_simulate, real_floor = [], planner.simulate, planner.least_peaks
    planner.simulate = lambda *args, **kwargs: calls.append(1) or real_simulate(*args, **kwargs)
    try:
        best, _ = plan_schedule(pp, vpp, m, lambda cfg: costs, budget_gb * GB, options)
        pruned = len(calls)
        calls.clear()
        planner.least_peaks = lambda config, costs, levels: [0.0] * config.pp
        every, _ = plan_schedule(pp, vpp, m, lambda cfg: costs, budget_gb * GB, options)
        unpruned = len(calls)
    finally:
        planner.simulate, planner.least_peaks = real_simulate, real_floor
    assert (best.config, best.placement, best.result.iteration_s) == (every.config, every.placement, every.result.iteration_s)
    floors = [max(real_floor(config, costs, ["none", "selective", "full"])) for config in candidate_configs(pp, vpp, m)]
    over = sum(f > budget_gb * GB for f in floors)
    assert over > 0 and pruned <= unpruned - over, (over, pruned, unpruned)
    calls.clear()
    planner.simulate = lambda *args, **kwargs: calls.append(1) or real_simulate(*args, **kwargs)
    try:
        with pytest.raises(NoFeasiblePlan, match=r"with every activation recomputed .* is at least 1\.\d\d GiB on rank"):
            plan_schedule(pp, vpp, m, lambda cfg: costs, 1.05 * GB, options)
    finally:
        planner.simulate = real_simulate
    assert not calls


@pytest.mark.parametrize("incumbent", [float("inf"), 0.195])
def test_lists_whose_critical_path_passes_the_deadline_are_not_simulated_and_the_plan_is_the_same(incumbent):
    """With a fit limit the lists are simulated in order of their critical path (simulator.lower_bound), and those
    whose path alone ends after the limit-th fastest time (or the incumbent) are not simulated: fewer simulations,
    and the same plans fitted and returned as when every list is simulated (the path made 0: the old order)."""
    import megatron_pipemesh.planning.planner as planner
    from megatron_pipemesh.planning.planner import PlannerOptions

    pp, vpp, m = 4, 2, 24
    costs = _direct_costs(pp)
    options = PlannerOptions(first_forward_candidates=(4, 8, 12, 24), last_backward_candidates=(4, 8, 12, 24),
                             fit_limit=2)
    calls, real_simulate, real_bound = [], planner.simulate, planner.lower_bound
    planner.simulate = lambda *args, **kwargs: calls.append(1) or real_simulate(*args, **kwargs)
    try:
        best, evaluated = plan_schedule(pp, vpp, m, lambda cfg: costs, 100 * GB, options, incumbent_s=incumbent)
        pruned = len(calls)
        calls.clear()
        planner.lower_bound = lambda *args, **kwargs: 0.0
        every, every_evaluated = plan_schedule(pp, vpp, m, lambda cfg: costs, 100 * GB, options, incumbent_s=incumbent)
        unpruned = len(calls)
    finally:
        planner.simulate, planner.lower_bound = real_simulate, real_bound
    assert [(p.config, p.result.iteration_s) for p in evaluated] == \
        [(p.config, p.result.iteration_s) for p in every_evaluated]
    assert (best.config, best.result.iteration_s) == (every.config, every.result.iteration_s)
    assert pruned < unpruned, (pruned, unpruned)
