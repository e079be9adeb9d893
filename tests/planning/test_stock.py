"""planning/stock.py: stock Megatron's settings predicted, and the fastest fitting setting."""
from typing import List, Optional, Sequence

import pytest

from megatron_pipemesh.planning.costs import GB, ClusterSpec, ModelSpec
from megatron_pipemesh.planning.stock import (activation_budget, best_per_schedule, best_stock, default_settings,
                                              default_stock, evaluate)
from megatron_pipemesh.planning.stock_memory import order_peaks, uniform_plan
from megatron_pipemesh.planning.stock_options import (STOCK_SHARDING, StockOffload, StockRecompute, StockSetting,
                                                      default_recompute_ladder, recompute_options, schedule_options)
from megatron_pipemesh.planning.costs import analytic_costs
from megatron_pipemesh.planning.simulator import SearchTimeUp, simulate
from megatron_pipemesh.planning.stock_memory import live_states

MODEL = ModelSpec(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=1024)
CLUSTER = ClusterSpec(dp=4, device_tflops=125, dp_gbps=10, p2p_gbps=10)


def stock_settings(pp: int, num_layers: int, microbatches: int, layer_spec: str = "local",
                   grad_reduce_in_bf16: bool = False, sharding: Sequence[Optional[str]] = (None,)) -> List[StockSetting]:
    """The whole stock option set (schedules x recomputation x the ``sharding`` levels)."""
    out = []
    for vpp, g in schedule_options(pp, num_layers, microbatches):
        for recompute in recompute_options(num_layers // (pp * vpp), layer_spec):
            out += [StockSetting(pp, vpp, microbatches, g, recompute, grad_reduce_in_bf16, level) for level in sharding]
    return out


def test_order_peaks_equal_simulated_peaks():
    """The program-order peak of each level equals the simulator's timeline peak (transients included)."""
    setting = StockSetting(2, 2, 8, 4)  # two layers per chunk
    config = setting.config()
    levels = ["none", "selective:mlp", "block:1", "uniform:2"]
    costs = analytic_costs(MODEL, CLUSTER, config, levels=levels)
    peaks = order_peaks(config, costs, levels)
    for level in levels:
        simulated = simulate(config, costs, uniform_plan(config, level))
        assert peaks[level] == pytest.approx(tuple(r.peak_activation_bytes for r in simulated.ranks)), level
    assert peaks["uniform:2"][0] < peaks["block:1"][0] < peaks["none"][0]  # (the last rank holds the logits)


def test_best_stock_is_the_fastest_fitting_setting_of_the_whole_space():
    """Brute force over every stock setting agrees with best_stock for a budget where memory binds."""
    pp, m = 2, 4
    unlimited = best_stock(MODEL, CLUSTER, pp, m, float("inf"))
    assert unlimited.setting.recompute.granularity == "none"
    none_peak = max(unlimited.peak_activation_bytes)
    budget = 0.6 * none_peak
    results = [evaluate(s, MODEL, CLUSTER) for s in stock_settings(pp, MODEL.num_layers, m)]
    fitting = [r for r in results if r.fits(budget)]
    best = best_stock(MODEL, CLUSTER, pp, m, budget)
    assert best.fits(budget) and best.setting.recompute.granularity != "none"
    assert best.iteration_s == pytest.approx(min(r.iteration_s for r in fitting))
    per = best_per_schedule(MODEL, CLUSTER, pp, m, budget)
    for (kind, vpp, g, level), result in per.items():
        same = [r for r in fitting if (r.setting.schedule, r.setting.vpp, r.setting.effective_group_size) == (kind, vpp, g)]
        assert level is None and result.iteration_s == pytest.approx(min(r.iteration_s for r in same)), (kind, vpp, g)
    assert best_stock(MODEL, CLUSTER, pp, m, 1.0) is None
    with pytest.raises(SearchTimeUp):  # asked before each simulation
        best_stock(MODEL, CLUSTER, pp, m, budget, time_up=lambda: True)
    assert best_stock(MODEL, CLUSTER, pp, m, budget, time_up=lambda: False) == best


def test_best_stock_at_some_group_sizes_is_the_fastest_of_those_schedules():
    """``groups`` keeps only those g (None: 1F1B): the fastest of best_per_schedule's entries at them, never faster
    than the whole space's best."""
    pp, m = 2, 8
    budget = 0.6 * max(best_stock(MODEL, CLUSTER, pp, m, float("inf")).peak_activation_bytes)
    per = best_per_schedule(MODEL, CLUSTER, pp, m, budget)
    whole = best_stock(MODEL, CLUSTER, pp, m, budget)
    for groups in ((None,), (pp,), (4,), (None, pp)):
        chosen = best_stock(MODEL, CLUSTER, pp, m, budget, groups=groups)
        assert chosen.setting.effective_group_size in groups
        same = [r.iteration_s for (_, _, g, _), r in per.items() if g in groups]
        assert chosen.iteration_s == pytest.approx(min(same)) and chosen.iteration_s >= whole.iteration_s, groups
    assert best_stock(MODEL, CLUSTER, pp, m, budget, groups=(7,)) is None  # Megatron refuses g = 7 at m = 8, p = 2


def test_default_command_is_g_equal_p_with_the_first_recomputation_that_fits():
    """Megatron's default command: 1F1B and g = p at every V, each with the first of none, selective, full
    block k = 1.. that fits; the best of them is never faster than best stock (whose space contains it)."""
    pp, m = 2, 8
    budget = 0.5 * max(best_stock(MODEL, CLUSTER, pp, m, float("inf")).peak_activation_bytes)
    results = default_settings(MODEL, CLUSTER, pp, m, budget)
    assert {(r.setting.vpp, r.setting.effective_group_size) for r in results} <= {(1, None), (2, 2), (4, 2)}
    assert all(r.setting.offload is None and r.fits(budget) for r in results)
    for r in results:
        ladder = default_recompute_ladder(MODEL.num_layers // (pp * r.setting.vpp))
        earlier = ladder[:ladder.index(r.setting.recompute)]
        assert all(not evaluate(StockSetting(pp, r.setting.vpp, m, r.setting.group_size, o), MODEL, CLUSTER).fits(budget)
                   for o in earlier), r.setting
        assert r.iteration_s == pytest.approx(evaluate(r.setting, MODEL, CLUSTER).iteration_s)
    best = default_stock(MODEL, CLUSTER, pp, m, budget)
    assert best.iteration_s == min(r.iteration_s for r in results)
    assert best.iteration_s >= best_stock(MODEL, CLUSTER, pp, m, budget).iteration_s
    assert [str(o.level) for o in default_recompute_ladder(2)][:2] == ["none", "selective"]
    assert default_stock(MODEL, CLUSTER, pp, m, 1.0) is None


def test_grad_reduce_in_bf16_halves_gradient_traffic():
    """--grad-reduce-in-bf16 makes the stock setting's data-parallel reduction cheaper, never slower."""
    fp32 = evaluate(StockSetting(2, 1, 4), MODEL, CLUSTER)
    bf16 = evaluate(StockSetting(2, 1, 4, grad_reduce_in_bf16=True), MODEL, CLUSTER)
    assert bf16.iteration_s < fp32.iteration_s


def test_activation_budget_subtracts_static_bytes():
    """The activation budget per rank is device memory minus that rank's weights, grads and optimizer."""
    budget = activation_budget(MODEL, CLUSTER, 2, 24 * GB)
    assert len(budget) == 2 and all(0 < b < 24 * GB for b in budget)


def test_best_stock_prunes_by_compute_bound_without_changing_the_answer(monkeypatch):
    """The bound-pruned search returning another setting than the fastest of every schedule (or not pruning)."""
    import megatron_pipemesh.planning.stock as stock

    pp, m = 2, 8
    fast = ClusterSpec(dp=2, device_tflops=125, dp_gbps=1000, p2p_gbps=1000)  # compute-bound: the bound bites
    unlimited = best_per_schedule(MODEL, fast, pp, m, float("inf")).values()
    budget = 0.2 * max(max(r.peak_activation_bytes) for r in unlimited)  # the largest schedule's: recompute to fit
    per = best_per_schedule(MODEL, fast, pp, m, budget)
    fastest = min(per.values(), key=lambda r: r.iteration_s)
    calls = []
    real = stock.simulate
    monkeypatch.setattr(stock, "simulate", lambda *a, **k: calls.append(1) or real(*a, **k))
    best = best_stock(MODEL, fast, pp, m, budget)
    assert best.setting == fastest.setting and best.iteration_s == fastest.iteration_s
    assert 0 < len(calls) < len(per)
    for choice in stock._choices(MODEL, fast, pp, m, budget, False):
        simulated = per[(choice.setting.schedule, choice.setting.vpp, choice.setting.effective_group_size, None)]
        assert choice.lower_bound_s <= choice.path_bound_s() * (1 + 1e-12)
        assert choice.path_bound_s() <= simulated.iteration_s * (1 + 1e-12)


def test_best_stock_simulates_in_the_order_of_the_critical_path_without_changing_the_answer(monkeypatch):
    """On a layout whose bubbles and transfers the compute bound does not see, the critical path
    (_Choice.path_bound_s) rules out choices the compute bound keeps: the same setting as with the compute bound
    alone, in fewer simulations."""
    import megatron_pipemesh.planning.stock as stock

    pp, m = 4, 16
    slow = ClusterSpec(dp=2, device_tflops=125, dp_gbps=2, p2p_gbps=2)
    counted = []
    real = stock.simulate
    monkeypatch.setattr(stock, "simulate", lambda *a, **k: counted.append(1) or real(*a, **k))
    best = best_stock(MODEL, slow, pp, m, float("inf"))
    with_path = len(counted)
    counted.clear()
    monkeypatch.setattr(stock._Choice, "path_bound_s", lambda choice: choice.lower_bound_s)
    plain = best_stock(MODEL, slow, pp, m, float("inf"))
    assert (best.setting, best.iteration_s) == (plain.setting, plain.iteration_s)
    assert with_path < len(counted), (with_path, len(counted))


def test_uniform_zero_levels_fit_where_the_distributed_optimizer_does_not():
    """Stock's Megatron-FSDP levels: missing from the search, wrongly pruned (brute force disagrees), or
    emitted without the real Megatron-FSDP flags, on a row where `optim` cannot fit even recomputing all."""
    pp, m = 2, 4
    optim = [evaluate(s, MODEL, CLUSTER) for s in stock_settings(pp, MODEL.num_layers, m, sharding=("optim",))]
    budget = min(max(r.peak_activation_bytes) for r in optim) - 1e6  # 1 MB short of the least `optim` peak
    assert best_stock(MODEL, CLUSTER, pp, m, budget, sharding=("optim",)) is None
    best = best_stock(MODEL, CLUSTER, pp, m, budget, sharding=STOCK_SHARDING)
    assert best is not None and best.setting.sharding in ("optim_grads", "optim_grads_params") and best.fsdp_model
    flags = best.setting.flags()
    assert flags[flags.index("--data-parallel-sharding-strategy") + 1] == best.setting.sharding
    assert {"--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"} <= set(flags)
    assert best.to_dict()["sharding"] == best.setting.sharding
    assert sum(best.static_bytes) < sum(optim[0].static_bytes)
    every = [evaluate(s, MODEL, CLUSTER, budget) for s in stock_settings(pp, MODEL.num_layers, m, sharding=STOCK_SHARDING)]
    assert best.iteration_s == pytest.approx(min(r.iteration_s for r in every if r.fits(budget)))
    assert StockSetting(pp, 1, m, sharding="optim").flags()[-1] == "--use-distributed-optimizer"
    with pytest.raises(ValueError, match="data-parallel-sharding-strategy"):
        StockSetting(pp, 1, m, sharding="zero3")


TE = ModelSpec(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=1024, layer_spec="te")


def test_offload_frees_the_attention_inputs_of_every_stored_chunk():
    """An offloading setting keeps the same time where the host link keeps up, holds exactly the offloaded
    bytes per stored chunk-micro-batch fewer (two layers' groups in flight) and puts them in host memory."""
    from megatron_pipemesh.planning.costs import activation_shape
    from megatron_pipemesh.planning.memory import offloadable_layer_bytes

    plain = evaluate(StockSetting(2, 2, 8, 8), TE, CLUSTER)
    moved = evaluate(StockSetting(2, 2, 8, 8, offload=StockOffload()), TE, CLUSTER)
    layer = offloadable_layer_bytes(activation_shape(TE, CLUSTER))
    sbh = 1024 * 1024
    assert layer == 6 * sbh * 2  # layer input, norm output, q, k, v, context in bf16
    assert moved.iteration_s == pytest.approx(plain.iteration_s)
    # Rank 0's peak stores the most chunk-micro-batches its program order ever holds (2 layers each).
    config = StockSetting(2, 2, 8, 8).config()
    live = int(live_states(config)[0].counts.sum(axis=1).max())
    assert live == 11  # Megatron's warm-up bounds what g = m holds at once
    assert moved.peak_activation_bytes[0] == pytest.approx(plain.peak_activation_bytes[0] - live * 2 * layer + 2 * layer)
    assert moved.host_peak_bytes[0] == pytest.approx(live * 2 * layer)
    slow = ClusterSpec(dp=4, device_tflops=125, dp_gbps=10, p2p_gbps=10, host_link_gbps=0.5)
    assert evaluate(StockSetting(2, 2, 8, 8, offload=StockOffload()), TE, slow).iteration_s > plain.iteration_s


def test_best_stock_offloads_only_with_a_host_limit_and_te():
    """Between the offloaded and the whole peak of breadth-first, stock offloads instead of recomputing when it
    may (host memory given, Transformer Engine); with too little host memory or the local spec it does not."""

    pp, m = 2, 8
    plain = evaluate(StockSetting(pp, 2, m, m), TE, CLUSTER)
    moved = evaluate(StockSetting(pp, 2, m, m, offload=StockOffload()), TE, CLUSTER)
    budget = (plain.peak_activation_bytes[0] + moved.peak_activation_bytes[0]) / 2
    without = best_stock(TE, CLUSTER, pp, m, budget)
    with_host = best_stock(TE, CLUSTER, pp, m, budget, host_limit=64 * GB)
    assert without.setting.offload is None
    assert with_host.setting.offload is not None and with_host.iteration_s < without.iteration_s
    assert "--fine-grained-activation-offloading" in with_host.setting.flags()
    assert all(h <= 64 * GB for h in with_host.host_peak_bytes)
    tiny = best_stock(TE, CLUSTER, pp, m, budget, host_limit=1.0)
    assert tiny.setting.offload is None and tiny.iteration_s == pytest.approx(without.iteration_s)
    assert best_stock(MODEL, CLUSTER, pp, m, budget, host_limit=64 * GB).setting.offload is None


def _no_pipeline(model: ModelSpec, cluster: ClusterSpec, microbatches: int = 4):
    """A PP = 1 setting evaluated, with its simulator costs: (result, forward, backward, reduction, optimizer)."""
    from megatron_pipemesh.planning.costs import ScheduleCosts
    from megatron_pipemesh.schedule.ops import Op, OpKind

    setting = StockSetting(1, 1, microbatches)
    config = setting.config()
    costs = analytic_costs(model, cluster, config)
    engine = ScheduleCosts(config, costs)
    f, b = (engine.compute(0, Op(kind, 0, 0)) for kind in (OpKind.FORWARD, OpKind.BACKWARD))
    return evaluate(setting, model, cluster), f, b, engine.data_parallel(0, Op(OpKind.GRAD_SYNC, 0)), costs


def test_without_a_pipeline_the_micro_batches_run_in_turn_and_the_reduction_follows():
    """PP = 1 (Megatron's forward_backward_no_pipelining): m forwards and backwards in turn on the one rank, no
    transfer, then the gradients' all-reduce (no --overlap-grad-reduce) and the optimizer step; its flags set PP = 1
    and nothing else; its bound (no bubble) is below the simulation."""
    from megatron_pipemesh.planning.bounds import bound_for
    from megatron_pipemesh.planning.clusters import flat_cluster
    from megatron_pipemesh.planning.costs import ScheduleCosts

    setting = StockSetting(1, 1, 4)
    assert setting.schedule == "no_pipeline" and setting.flags() == ["--pipeline-model-parallel-size", "1"]
    assert setting.describe() == "no pipeline, no recomputation"
    assert schedule_options(1, 8, 4) == [(1, None)]
    cluster = flat_cluster(tp=1, dp=2, device_tflops=10.0, dp_gbps=1.0, p2p_gbps=1.0, latency_us=0.0,
                           distributed_optimizer=False, overlap_grad_reduce=False, overlap_param_gather=False)
    result, f, b, reduce, costs = _no_pipeline(MODEL, cluster)
    assert reduce > 0 and costs.p2p_s == 0.0
    assert result.iteration_s == pytest.approx(4 * (f + b) + reduce + costs.optimizer_s[0], rel=1e-9)
    config = setting.config()
    assert bound_for(config, ScheduleCosts(config, costs)).seconds <= result.iteration_s * (1 + 1e-9)


def test_without_a_pipeline_overlapped_buckets_hide_all_but_one_under_the_last_backward():
    """With --overlap-grad-reduce Megatron reduces the gradients of PP = 1 in buckets of 40M parameters (or 1M x DP)
    as the last backward produces them: what follows that backward is the larger of one bucket's share and what the
    backward cannot hide. A model within one bucket gains nothing (the one reduction follows the backward)."""
    from megatron_pipemesh.planning.clusters import flat_cluster

    big = ModelSpec(num_layers=4, hidden_size=4096, num_attention_heads=32, seq_length=1024)
    fields = dict(tp=1, dp=2, device_tflops=100.0, dp_gbps=100.0, p2p_gbps=100.0, latency_us=0.0,
                  distributed_optimizer=False, overlap_param_gather=False)
    after, f, b, reduce, costs = _no_pipeline(big, flat_cluster(**fields, overlap_grad_reduce=False))
    during, _, _, tail, bucketed = _no_pipeline(big, flat_cluster(**fields, overlap_grad_reduce=True))
    n = bucketed.dp_buckets
    assert n == -(-(costs.static_bytes[0] / 18) // 40e6) and n > 1
    assert tail == pytest.approx(max(reduce / n, reduce - b * (n - 1) / n), rel=1e-9) and tail < reduce
    assert during.iteration_s == pytest.approx(after.iteration_s - reduce + tail, rel=1e-9)
    from megatron_pipemesh.planning.bounds import bound_for
    from megatron_pipemesh.planning.costs import ScheduleCosts

    config = StockSetting(1, 1, 4).config()
    assert bound_for(config, ScheduleCosts(config, bucketed)).seconds <= during.iteration_s * (1 + 1e-9)
    small = ModelSpec(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=256)
    _, _, _, one, single = _no_pipeline(small, flat_cluster(**fields, overlap_grad_reduce=True))
    assert single.dp_buckets == 1 and one == _no_pipeline(small, flat_cluster(**fields, overlap_grad_reduce=False))[3]


def test_the_peaks_of_the_live_states_are_those_of_walking_the_order_by_hand():
    """The live states are arrays built from running sums (stock_memory.live_states): every rank's peak is, to the
    float, the one of walking its compute order op by op and adding each live chunk-micro-batch's bytes kind by kind
    (random bytes, negative ones too; interleaved orders with a kind per chunk of an uneven split)."""
    import random

    from megatron_pipemesh.planning.stock_memory import ChunkKinds, _peaks
    from megatron_pipemesh.schedule.order import rank_steps

    rng = random.Random(7)
    for pp, vpp, m, g in ((2, 2, 8, 4), (4, 2, 32, 8), (4, 2, 64, 64), (2, 4, 48, 16), (3, 1, 9, None)):
        config = StockSetting(pp, vpp, m, g).config()
        kinds = ChunkKinds.of(config)
        if vpp == 4:  # every chunk its own kind
            kinds = ChunkKinds(tuple(tuple(range(vpp)) for _ in range(pp)), tuple(tuple(range(vpp)) for _ in range(pp)))
        counts = live_states(config, kinds)
        for _ in range(20):
            held = [[rng.choice((0.0, rng.random() * 1e9, rng.randint(-10 ** 12, 10 ** 12) * 1.0)) for _ in k]
                    for k in kinds.chunks]
            transient = [[rng.random() * 1e9 for _ in k] for k in kinds.chunks]
            flight = [rng.random() * 1e8 for _ in kinds.chunks]
            by_hand = []
            for rank in range(pp):
                live, peak = [0] * len(kinds.chunks[rank]), -float("inf")
                for forward, chunk, _ in rank_steps(config, rank):
                    kind = kinds.of_chunk[rank][chunk]
                    if forward:
                        live[kind] += 1
                    total = sum(n * size for n, size in zip(live, held[rank]))
                    peak = max(peak, total + (0.0 if forward else transient[rank][kind]) + flight[rank])
                    if not forward:
                        live[kind] -= 1
                by_hand.append(peak)
            assert _peaks(counts, held, transient, flight) == tuple(by_hand)


@pytest.mark.parametrize("model, host", [(MODEL, None), (TE, 64 * GB)])
def test_an_incumbent_leaves_out_only_the_choices_bounded_past_it(model, host):
    """The choices built below an incumbent are the unlimited choices whose first fitting option's compute bound
    is within it, with the same settings and bounds (one kept past it, or one lost within it, fails); an offloading
    choice may lose only a setting without offloading bounded past it. best_stock's answer below the incumbent is
    the same."""
    import megatron_pipemesh.planning.stock as stock
    from megatron_pipemesh.planning.path_bound import SLACK

    pp, m = 2, 8
    unlimited_best = best_per_schedule(model, CLUSTER, pp, m, float("inf"), host_limit=host).values()
    budget = 0.3 * max(max(r.peak_activation_bytes) for r in unlimited_best)  # most settings must recompute
    every = stock._choices(model, CLUSTER, pp, m, budget, False, host_limit=host)
    bounds = sorted(choice.lower_bound_s for choice in every)
    incumbent = bounds[len(bounds) // 2]  # half the choices bounded past it
    kept = stock._choices(model, CLUSTER, pp, m, budget, False, host_limit=host, incumbent_s=incumbent)
    within = [choice for choice in every if not choice.lower_bound_s * (1 - SLACK) > incumbent]
    assert 0 < len(kept) == len(within) < len(every)
    for ours, theirs in zip(kept, within):
        assert (ours.setting, ours.lower_bound_s, ours.config) == (theirs.setting, theirs.lower_bound_s, theirs.config)
        if ours.without_offload != theirs.without_offload:
            assert ours.without_offload is None
            level = theirs.without_offload.recompute.level
            assert stock.compute_bound(theirs.config, theirs.costs, level) * (1 - SLACK) > incumbent
    plain = best_stock(model, CLUSTER, pp, m, budget, host_limit=host)
    limited = best_stock(model, CLUSTER, pp, m, budget, host_limit=host, incumbent_s=plain.iteration_s * 1.01)
    assert (limited.setting, limited.iteration_s) == (plain.setting, plain.iteration_s)
