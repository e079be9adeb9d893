"""planning/advice.py: the layouts searched, the bound-pruned search against an exhaustive one, and the rows."""
import dataclasses
import time

import pytest

from megatron_pipemesh.planning import advice as adv
from megatron_pipemesh.planning import advice_search as search
from megatron_pipemesh.planning.search_control import brief
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
    """TP divides the node and the heads; PP at most the layers, PP = 1 (no pipeline) included; m = batch / (b x DP)
    >= p; max_tp caps TP."""
    layouts = parallel_layouts(problem(), CLUSTER)
    assert ParallelLayout(1, 4, 2) in layouts and ParallelLayout(2, 2, 2) in layouts
    assert ParallelLayout(1, 1, 8) in layouts and ParallelLayout(2, 1, 4) in layouts
    for layout in layouts:
        assert layout.tp * layout.pp * layout.dp == 8 and CLUSTER.gpus_per_node % layout.tp == 0
        assert layout.pp >= 1 and 32 // layout.dp >= layout.pp
    assert {l.tp for l in parallel_layouts(problem(max_tp=1), CLUSTER)} == {1}
    assert ParallelLayout(1, 8, 1) in layouts  # one stage per GPU: whole stages per node


def test_candidates_are_sorted_by_their_bound_and_drop_what_cannot_hold_its_weights():
    found = candidates(problem(), CLUSTER)
    assert [c.bound_s for c in found] == sorted(c.bound_s for c in found)
    small = dataclasses.replace(CLUSTER, device_memory_gb=0.05)
    assert len(candidates(problem(), small)) < len(found)


def _first_rows(p: AdviceProblem, cluster: AdviceCluster):
    """Per side, every first row of the least-bound candidates (:func:`.advice_search.first_row`), without limits."""
    out = {"pipemesh": [], "stock": []}
    for candidate, side in search.first_tasks(candidates(p, cluster), True, (float("inf"), float("inf"))):
        row = search.first_row(p, cluster, candidate, side)
        if row is not None:
            out[side].append(row)
    return out


def _exhaustive(p: AdviceProblem, cluster: AdviceCluster):
    """The best PipeMesh and stock times over every candidate, without pruning, and over the first rows."""
    first = _first_rows(p, cluster)
    pm = min((row.iteration_s for row in first["pipemesh"] if row.fits), default=float("inf"))
    st = float("inf")
    for c in candidates(p, cluster):
        if c.vpp >= 2:
            plan = search.plan_candidate(c, cluster)
            if plan is not None and plan.fits:
                pm = min(pm, plan.result.iteration_s)
        result = search.stock_candidate(c, p, cluster)
        if result is not None:
            st = min(st, result.iteration_s)
    # stock's first rows are settings its search compares: never below its best
    assert all(row.iteration_s >= st * (1 - 1e-12) for row in first["stock"])
    return pm, st


@pytest.fixture(scope="module")
def full():
    """The advice for :func:`problem` without limits, and the progress lines it said."""
    lines: list = []
    return advise(problem(), CLUSTER, progress=lines.append), lines


def test_pruning_finds_the_exhaustive_best_and_simulates_fewer(full):
    """Pruned by the tight bound, the search finds the same best times as simulating every candidate, and skips some:
    a bound that were not a lower bound, or a prune against the wrong side's time, would fail here."""
    advice, _ = full
    pm, st = _exhaustive(problem(), CLUSTER)
    assert advice.rows["best_layout"].iteration_s == pytest.approx(pm, rel=1e-9)
    assert advice.rows["best_layout_stock"].iteration_s == pytest.approx(st, rel=1e-9)
    simulated = advice.search.simulated
    assert simulated["pipemesh"] < advice.candidates and simulated["stock"] < advice.candidates
    assert advice.search.stopped_by is None and not any("stopped" in note for note in advice.notes)


def test_the_first_rows_start_the_layout_search(monkeypatch):
    """The first rows of the least-bound candidates (PipeMesh's Megatron order fitted to the memory; stock at g = p)
    are real rows, and the faster of them and the user layout's is where the layout search starts: a search stopped at
    its first candidate answers with them, not with the user's layout (PP = 2 here, slower than what they find)."""
    p = problem(layout=ParallelLayout(1, 2, 4), stock=StockSetting(2, 2, 8))
    first = _first_rows(p, CLUSTER)
    for row in first["pipemesh"]:
        groups = row.plan.config.forward_groups
        assert row.fits and row.plan.config.backward_groups == groups and set(groups) == {row.layout.pp}
    for row in first["stock"]:
        assert row.stock.effective_group_size in (None, row.layout.pp)
    started = {}

    def stopped_search(problem_, cluster, found, best_pm, best_st, **kwargs):
        started.update(pipemesh=best_pm, stock=best_st)
        kwargs["log"].stop("max_simulated", found[0].bound_s)
        return best_pm, best_st

    monkeypatch.setattr(adv, "search_layouts", stopped_search)
    advice = advise(p, CLUSTER)
    for side, own in (("pipemesh", "pipemesh"), ("stock", "best_stock")):
        best = min([advice.rows[own]] + first[side], key=lambda row: row.iteration_s)
        assert started[side].iteration_s == best.iteration_s and started[side].describe() == best.describe()
    assert advice.rows["best_layout"].iteration_s < advice.rows["pipemesh"].iteration_s  # the first rows won here
    assert advice.rows["best_layout_stock"].iteration_s < advice.rows["best_stock"].iteration_s


def _a_long_first_row(problem_, cluster, candidate, side, deadline_s=None, time_up=None):
    time.sleep(120)


def test_first_rows_not_back_by_the_deadline_are_left_out_and_not_waited_for(monkeypatch):
    """With workers, a first row still running at the deadline is left out and its worker ended with the user layout's
    pool: the layout search does not start late, nor beside it."""
    p = problem(layout=ParallelLayout(1, 2, 4), stock=StockSetting(2, 2, 8))
    found = candidates(p, CLUSTER)
    monkeypatch.setattr(search, "first_row", _a_long_first_row)
    started = time.monotonic()
    with search.UserLayout(p, CLUSTER, search.user_candidate(p, CLUSTER, p.vpp), True, 2) as own:
        own.start_first(found, True, None)
        assert own.stock() is not None and own.plan() is not None
        assert own.first_rows(found, True, (float("inf"),) * 2, time.monotonic() + 0.5) == (None, None)
    assert time.monotonic() - started < 30


def test_progress_says_each_row_found_and_the_last_is_the_best(full):
    advice, lines = full
    rows = advice.rows
    assert lines[0] == f"user: {rows['user'].iteration_s:.3f} s, {rows['user'].describe()}"
    assert f"best_stock: {rows['best_stock'].iteration_s:.3f} s, {rows['best_stock'].describe()}" in lines
    assert any(line.startswith(f"{advice.candidates} candidates (TP x PP x DP") for line in lines)
    found = [line for line in lines if line.startswith(("pipemesh:", "best_layout:"))]
    assert found[-1].endswith(f"{rows['best_layout'].iteration_s:.3f} s, {rows['best_layout'].describe()}")
    found = [line for line in lines if line.startswith(("best_stock:", "best_layout_stock:"))]
    assert found[-1].startswith(f"{'best_layout_stock' if len(found) > 1 else 'best_stock'}: "
                                f"{rows['best_layout_stock'].iteration_s:.3f} s")


def test_a_search_out_of_time_keeps_the_rows_of_the_user_layout_and_bounds_what_it_left(full):
    """With no time left the layout search stops before its first candidate: best_layout is PipeMesh for the user's
    layout, and the note's bound (the least candidate's) is below every layout's time, so the full search's best is
    at least the lesser of the two; the note says how much faster a layout left could be."""
    advice, _ = full
    found = candidates(problem(), CLUSTER)
    assert advise(problem(), CLUSTER, search_seconds=0).search.stopped_by is None  # 0: to the end
    stopped = advise(problem(), CLUSTER, search_seconds=1e-9)
    assert stopped.search.stopped_by == "search_seconds" and stopped.search.unsearched_bound_s == found[0].bound_s
    assert stopped.search.simulated == {"pipemesh": 0, "stock": 0}
    assert stopped.rows["best_layout"].iteration_s == stopped.rows["pipemesh"].iteration_s
    for name in ("best_layout", "best_layout_stock"):
        assert advice.rows[name].iteration_s >= min(stopped.rows[name].iteration_s, found[0].bound_s) - 1e-12
    gain = stopped.rows["best_layout"].iteration_s / found[0].bound_s
    note = [n for n in stopped.notes if n.startswith(f"the layout search stopped at its deadline, --search-seconds "
                                                     f"1e-09, after 0 of {len(found)} candidates ")]
    assert len(note) == 1 and f"at most {100 * (gain - 1):.1f}% faster than best_layout" in note[0], stopped.notes
    assert "--search-seconds 0 searches to the end" in note[0]


def test_rows_user_first_and_best_fits(full):
    advice, _ = full
    user = advice.rows["user"]
    assert user.layout == ParallelLayout(1, 4, 2) and user.vpp == 2 and user.stock == StockSetting(4, 2, 16)
    assert advice.rows["pipemesh"].keeps(user) and advice.rows["pipemesh"].plan is not None
    best = advice.best()
    assert best.fits and all(best.iteration_s <= r.iteration_s for r in advice.rows.values() if r and r.fits)


def test_a_user_command_that_does_not_fit_is_a_row_that_does_not_fit():
    """Micro-batches of 8 sequences on 1 GiB: the user's row (no recomputation) exceeds the memory, and is never best."""
    p = problem(model=dataclasses.replace(MODEL, micro_batch_size=8), global_batch=64,
                stock=StockSetting(4, 2, 16))
    cluster = dataclasses.replace(CLUSTER, device_memory_gb=1.5)
    advice = advise(p, cluster)
    assert not advice.rows["user"].fits
    assert advice.best() is None or advice.best().name != "user"


def test_v1_command_has_no_pipemesh_row_and_says_why():
    advice = advise(problem(vpp=1, stock=StockSetting(4, 1, 16)), CLUSTER)
    assert advice.rows["pipemesh"] is None and any(n.startswith("pipemesh:") for n in advice.notes)
    assert advice.rows["best_layout"] is not None and advice.rows["best_layout"].vpp >= 2


def test_a_capped_search_says_so_and_keeps_real_plans(monkeypatch):
    """max_simulated stops a side after that many candidates (least bounds first) and says so with the bound of the
    first candidate it left; what it returns is one of the plans the full search priced, never faster than the full
    search's best, which is at least the lesser of that plan and that bound. Progress comes between simulations."""
    p = problem()
    found = candidates(p, CLUSTER)
    full_log = adv.SearchLog()
    best_pm, _ = adv.search_layouts(p, CLUSTER, found, stock=False, log=full_log)
    monkeypatch.setattr(search, "HEARTBEAT_S", 0.0)
    capped, lines = adv.SearchLog(), []
    first_pm, _ = adv.search_layouts(p, CLUSTER, found, stock=False, log=capped, max_simulated=1,
                                     progress=lines.append)
    assert capped.simulated["pipemesh"] == 1 and capped.stopped_by == "max_simulated" and full_log.stopped_by is None
    assert full_log.simulated["pipemesh"] > 1 and first_pm.iteration_s >= best_pm.iteration_s
    pm_candidates = [c for c in found if c.vpp >= 2]
    assert capped.unsearched_bound_s == pm_candidates[1].bound_s < first_pm.iteration_s
    assert best_pm.iteration_s >= min(first_pm.iteration_s, capped.unsearched_bound_s)
    first = found[0]
    assert lines[0].startswith(f"0 of {len(found)} candidates done, {len(found)} left whose bound may beat the rows "
                               f"(0 ruled out); simulating {brief(first)} (")
    assert f"bound {first.bound_s:.3f} s, 0 s so far" in lines[0]
    index = next(i for i, c in enumerate(found) if c.vpp >= 2)  # PipeMesh's first: more than one simulation
    inside = [line for line in lines if line.startswith(f"{index} of {len(found)} candidates done, ")
              and f"simulating {brief(found[index])} (pipemesh, " in line]
    assert len(inside) > 1  # progress also between the simulations of one candidate


def test_time_up_inside_a_layout_drops_it_once_its_side_has_a_row(full):
    """time_up is asked before each candidate and, once the side has a row, before each simulation inside one: the
    candidate in progress is then dropped and its bound is the one left. A side without a row finishes its first
    candidate, so a limit never leaves it empty for want of time alone."""
    advice, _ = full
    p = problem()
    found = [c for c in candidates(p, CLUSTER) if c.vpp >= 2]  # PipeMesh's side only: each candidate is simulated
    start = advice.rows["pipemesh"]
    assert found[0].bound_s < start.iteration_s

    def stop_at_second_ask(asked):
        return lambda: asked.append(1) is None and len(asked) >= 2

    asked, log = [], adv.SearchLog()
    best, _ = adv.search_layouts(p, CLUSTER, found, best_pm=start, stock=False, log=log,
                                 time_up=stop_at_second_ask(asked))
    assert len(asked) == 2 and best is start  # the second ask came inside the first candidate
    assert log.stopped_by == "search_seconds" and log.unsearched_bound_s == found[0].bound_s
    asked, log = [], adv.SearchLog()
    best, _ = adv.search_layouts(p, CLUSTER, found, stock=False, log=log, time_up=stop_at_second_ask(asked))
    assert len(asked) == 2 and log.simulated["pipemesh"] == 1 and log.unsearched_bound_s == found[1].bound_s
    assert best is not None and best.plan.result.iteration_s == search.plan_candidate(found[0], CLUSTER).result.iteration_s


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


def test_micro_batch_sizes_divide_the_replica_batch_into_p_or_more_the_commands_first():
    """Every size dividing the per-replica batch (global batch / DP) into at least p micro-batches, the command's own
    first (it wins ties); none where DP does not divide the global batch; only the command's when switched off."""
    assert adv.micro_batch_sizes(problem(), 4, 2) == [1, 2, 4]  # 16 sequences per replica, 4 or more micro-batches
    assert adv.micro_batch_sizes(problem(), 1, 8) == [1, 2, 4]  # 4 per replica, no pipeline
    two = problem(model=dataclasses.replace(MODEL, micro_batch_size=2))
    assert adv.micro_batch_sizes(two, 2, 2) == [2, 1, 4, 8]
    assert adv.micro_batch_sizes(problem(global_batch=12), 1, 8) == []
    assert adv.micro_batch_sizes(problem(search_micro_batch_size=False), 4, 2) == [1]


def test_candidates_without_a_pipeline_run_at_v1_and_add_the_distributed_optimizer_where_missing():
    """PP = 1 candidates (stock only) have V = 1; without --use-distributed-optimizer each comes again priced with it
    and flagged to add it (sharding level optim), and without the overlap flags once more with both added (and the
    distributed optimizer); every candidate's bound is below its simulation, and candidates at other micro-batch
    sizes carry theirs."""
    p = problem(distributed_optimizer=False)
    found = candidates(p, CLUSTER)
    flat = [c for c in found if c.layout.pp == 1]
    assert flat and all(c.vpp == 1 for c in flat)
    assert {c.stock_sharding for c in flat} == {(None,), ("optim",)}
    assert all(c.cluster.distributed_optimizer == (c.stock_sharding == ("optim",)) for c in flat)
    assert {c.stock_sharding for c in candidates(problem(), CLUSTER) if c.layout.pp == 1} == {(None,)}
    bare = problem(distributed_optimizer=False, overlap_grad_reduce=False, overlap_param_gather=False)
    ways = {(c.stock_sharding, c.added_flags, c.cluster.distributed_optimizer, c.cluster.overlap_grad_reduce,
             c.cluster.overlap_param_gather) for c in candidates(bare, CLUSTER) if c.layout.pp == 1}
    assert ways == {((None,), (), False, False, False), (("optim",), (), True, False, False),
                    (("optim",), ("--overlap-grad-reduce", "--overlap-param-gather"), True, True, True)}
    assert all(not c.added_flags for c in found if c.layout.pp > 1)
    assert {c.micro_batch_size for c in found} == {None, 2, 4, 8, 16}
    assert all(c.model.micro_batch_size == (c.micro_batch_size or 1) for c in found)
    for c in flat[:6]:
        result = search.stock_candidate(c, p, CLUSTER)
        assert result is not None and c.bound_s <= result.iteration_s * (1 + 1e-9)
        assert result.setting.sharding == c.stock_sharding[0]


FAST = dataclasses.replace(CLUSTER, nic_gbps=400.0, intra_node_gbps=2400.0)
"""A network fast enough that the small model's data-parallel traffic costs less than a pipeline's bubble."""


def test_no_pipeline_is_advised_where_it_is_best_and_a_pp1_command_is_confirmed():
    """On a fast network a pipeline's bubble costs more than data parallelism's reduction: the best stock layout of a
    PP = 4 command runs no pipeline; a PP = 1 command is priced as it is (its best_stock row is itself, and no
    PipeMesh row: PipeMesh schedules a pipeline)."""
    advice = advise(problem(), FAST)
    best = advice.rows["best_layout_stock"]
    assert best.layout.pp == 1 and best.vpp == 1 and "no pipeline" in best.describe()
    assert best.iteration_s < advice.rows["user"].iteration_s
    flat = problem(layout=ParallelLayout(1, 1, 8), vpp=1, stock=StockSetting(1, 1, 4))
    confirmed = advise(flat, FAST)
    user = confirmed.rows["user"]
    assert user.layout.pp == 1 and user.describe() == "TP1 PP1 DP8 V=1: no pipeline, no recomputation"
    assert confirmed.rows["best_stock"].iteration_s == pytest.approx(user.iteration_s, rel=1e-12)
    assert confirmed.rows["pipemesh"] is None and any("runs no pipeline" in n for n in confirmed.notes)


def test_a_micro_batch_size_the_profile_measured_faster_is_advised():
    """A profile in which two sequences per micro-batch take no longer than one (a device the size-1 batch leaves
    idle): the advised row changes the micro-batch size, says so, and is predicted faster than the command."""
    from megatron_pipemesh.planning.profile import ComputePoint, Profile, shape_of

    def point(mbs: int) -> ComputePoint:
        return ComputePoint(tp=1, micro_batch_size=mbs, layer_forward_s=2e-3, layer_backward_s=4e-3,
                            recompute_extra_s={}, layer_activation_bytes={"none": 2e6 * mbs},
                            embedding_forward_s=1e-4, embedding_backward_s=1e-4, embedding_activation_bytes=1e4 * mbs,
                            output_forward_s=1e-3, output_backward_s=2e-3, output_activation_bytes=1e5 * mbs)

    measured = Profile(device_kind="cpu", device_name="test", torch_version="2.13", megatron_core_version="0.19.2",
                       shape=shape_of(MODEL, "bf16"), compute=(point(1), point(2)), optimizer_s_per_param=None)
    advice = advise(problem(profile=measured, max_tp=1), CLUSTER)
    best = advice.best()
    assert best.micro_batch_size in (2, 4, 8, 16) and f"mbs {best.micro_batch_size}" in best.describe()
    assert best.iteration_s < advice.rows["user"].iteration_s and advice.rows["user"].micro_batch_size is None


def test_a_search_stopped_early_says_what_it_did_not_reach_not_that_nothing_fits():
    """A V = 1 command has no PipeMesh row of its own: stopped before its first candidate, the search found no
    PipeMesh layout and says it did not reach them, never that no PipeMesh plan fits (which the complete search says
    only where it simulated them all)."""
    p = problem(vpp=1, stock=StockSetting(4, 1, 16))
    stopped = advise(p, CLUSTER, search_seconds=1e-9)
    assert stopped.rows["best_layout"] is None and stopped.search.stopped_by == "search_seconds"
    assert not any("no PipeMesh plan (PP >= 2, V >= 2) fits" in note for note in stopped.notes), stopped.notes
    assert any(note.startswith("best_layout: no PipeMesh plan found before the layout search stopped at its deadline")
               and "not reached" in note for note in stopped.notes), stopped.notes


def test_a_stop_request_ends_the_search_with_the_rows_found_and_the_bound_left():
    """A stop request (the CLI's SIGINT / SIGTERM) before the layout search: the rows of the user's layout stay, the
    search is 'interrupted' at the least bound and the note names the signal."""
    p = problem()
    found = candidates(p, CLUSTER)
    stop = adv.StopRequest()
    stop.request("SIGINT")
    stop.request("SIGTERM")  # the first request wins
    stopped = advise(p, CLUSTER, stop=stop)
    assert stopped.search.stopped_by == "interrupted" and stopped.search.unsearched_bound_s == found[0].bound_s
    assert stopped.rows["user"] is not None
    assert any(note.startswith("the layout search was interrupted (SIGINT) after 0 of ") for note in stopped.notes)
