"""The memory-fair benchmark's pure parts: budget, stock rows, PipeMesh plans, fits, best stock."""
import json

import pytest

from megatron_pipemesh.bench.memory_fair import (auto_budget_bytes, best_stock, cluster_spec, fits, pipemesh_spec,
                                                 stock_specs)
from megatron_pipemesh.bench.runner import AutoPlanSettings, ModelSetup, ParallelConfig, bench_gpt
from megatron_pipemesh.integration.auto_plan import load_plan
from megatron_pipemesh.planning.stock import StockRecompute, default_settings, group_sizes

MODEL = ModelSetup(bench_gpt(hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=1), microbatches=4, vpp=2)
CONFIG = ParallelConfig(2, 2)
AUTO = AutoPlanSettings(device_tflops=0.02, mfu=0.45)
GBPS = 0.2


def test_fits_needs_every_rank_measured_and_within_budget():
    """No budget: always fits; otherwise every rank's peak must be known and <= the budget."""
    assert fits(None, None) and fits([5, 7], None)
    assert fits([5, 7], 7) and not fits([5, 8], 7)
    assert not fits([5, None], 7) and not fits(None, 7) and not fits([], 7)


def test_best_stock_is_fastest_fitting_stock_row():
    """A faster row that does not fit never wins, nor does a PipeMesh row; None when no stock row fits."""
    rows = [{"name": "bf", "stock": True, "fits": False, "tokens_per_s": 300.0},
            {"name": "df", "stock": True, "fits": True, "tokens_per_s": 200.0},
            {"name": "g4", "stock": True, "fits": True, "tokens_per_s": 250.0},
            {"name": "pipemesh", "stock": False, "fits": True, "tokens_per_s": 400.0},
            {"name": "failed", "stock": True, "fits": True, "tokens_per_s": None}]
    assert best_stock(rows)["name"] == "g4"
    assert best_stock([r for r in rows if r["name"] in ("bf", "pipemesh")]) is None


def test_auto_budget_lies_between_depth_first_and_breadth_first():
    """'auto' is strictly between the two no-recompute peaks, so breadth-first must recompute and depth-first need not."""
    budget = auto_budget_bytes(MODEL, CONFIG, AUTO, GBPS)
    rows = {r.name: r for r in stock_specs(MODEL, CONFIG, None, AUTO, GBPS)}
    depth, breadth = max(rows["interleaved-V2-g2"].predicted_peak_bytes), max(rows["interleaved-V2-g4"].predicted_peak_bytes)
    assert depth < budget < breadth
    fitted = {r.name: r for r in stock_specs(MODEL, CONFIG, budget, AUTO, GBPS)}
    assert fitted["interleaved-V2-g2"].setting.recompute.granularity == "none"
    assert fitted["interleaved-V2-g4"].setting.recompute.granularity != "none"


def test_stock_rows_cover_every_schedule_and_fit_or_say_so():
    """One row per stock (V, g) Megatron accepts; each predicted to fit the budget with its recomputation,
    except where nothing can (then the least-memory setting, marked predicted_fits False)."""
    budget = auto_budget_bytes(MODEL, CONFIG, AUTO, GBPS)
    rows = stock_specs(MODEL, CONFIG, budget, AUTO, GBPS)
    expected = ["1f1b"] + [f"interleaved-V2-g{g}" for g in group_sizes(2, 4)]
    assert [r.name for r in rows] == expected
    for row in rows:
        assert row.predicted_fits == (max(row.predicted_peak_bytes) <= budget)
        assert row.stock_flags == tuple(row.setting.flags()[2:])
    tiny = stock_specs(MODEL, CONFIG, 1.0, AUTO, GBPS)
    assert not any(r.predicted_fits for r in tiny)
    assert all(r.setting.recompute.granularity != "none" for r in tiny)
    only = stock_specs(MODEL, CONFIG, budget, AUTO, GBPS, families=("interleaved",), group_sizes=[4])
    assert [r.name for r in only] == ["interleaved-V2-g4"]


def test_default_rows_are_megatrons_default_command():
    """1F1B and g = p are Megatron's default command: marked default when their fastest fitting setting is one the
    default command uses (none, selective with core_attn, full block k); g = m is not. With a tighter budget the
    default interleaved row recomputes, still within that set."""
    budget = auto_budget_bytes(MODEL, CONFIG, AUTO, GBPS)
    rows = {r.name: r for r in stock_specs(MODEL, CONFIG, budget, AUTO, GBPS)}
    assert [n for n, r in rows.items() if r.default] == ["1f1b", "interleaved-V2-g2"]
    tight = 0.8 * max(rows["interleaved-V2-g2"].predicted_peak_bytes)
    tight_rows = stock_specs(MODEL, CONFIG, tight, AUTO, GBPS)
    row = {r.name: r for r in tight_rows}["interleaved-V2-g2"]
    assert row.default and row.setting.recompute.granularity != "none" and row.setting.recompute.method in (None, "block")
    # the same settings as the study's baseline (planning.stock.default_settings) on the bench's network
    study = default_settings(MODEL.model_spec(2), cluster_spec(CONFIG, AUTO, GBPS), 2, 4, tight)
    assert sorted(r.setting.describe() for r in study) == sorted(r.setting.describe() for r in tight_rows if r.default)


def test_a_default_setting_other_than_the_best_runs_as_its_own_row(monkeypatch):
    """Where the best stock setting of a g = p schedule is not one Megatron's default command uses, the row keeps
    the best setting (not default) and a `-default` row runs the default command's: here, with the default set
    narrowed to no recomputation, the least-memory default setting, predicted not to fit."""
    from megatron_pipemesh.bench import memory_fair

    monkeypatch.setattr(memory_fair, "default_recompute_ladder", lambda layers: [StockRecompute()])
    budget = 0.8 * max(stock_specs(MODEL, CONFIG, None, AUTO, GBPS)[1].predicted_peak_bytes)
    rows = {r.name: r for r in stock_specs(MODEL, CONFIG, budget, AUTO, GBPS, families=("interleaved",),
                                           group_sizes=[2])}
    assert list(rows) == ["interleaved-V2-g2", "interleaved-V2-g2-default"]
    best, default = rows.values()
    assert not best.default and best.predicted_fits and best.setting.recompute.granularity != "none"
    assert default.default and not default.predicted_fits and default.setting.recompute.granularity == "none"
    assert default.stock_flags == tuple(default.setting.flags()[2:])


def test_best_default_is_the_fastest_fitting_default_row():
    """best_stock(default_only=True) looks only at rows marked default."""
    rows = [{"name": "g4", "stock": True, "default": False, "fits": True, "tokens_per_s": 300.0},
            {"name": "g2", "stock": True, "default": True, "fits": True, "tokens_per_s": 200.0},
            {"name": "1f1b", "stock": True, "default": True, "fits": False, "tokens_per_s": 250.0}]
    assert best_stock(rows)["name"] == "g4" and best_stock(rows, default_only=True)["name"] == "g2"


@pytest.mark.parametrize("family", ["pipemesh", "pipemesh-auto"])
def test_pipemesh_rows_are_planned_for_the_budget(tmp_path, family):
    """The plan file loads for this run's p, V, m, predicts every rank within the budget and recomputes
    (or places on the host) where the unplanned schedule would not fit."""
    budget = auto_budget_bytes(MODEL, CONFIG, AUTO, GBPS)
    spec = pipemesh_spec(MODEL, CONFIG, family, budget, AUTO, GBPS, str(tmp_path), ((4,), (4,)))
    plan = load_plan(spec.plan_path, 2, 2, 4)
    assert (plan.schedule.forward_groups, plan.schedule.backward_groups) == spec.groups
    assert max(spec.predicted_peak_bytes) <= budget and spec.predicted_fits
    if family == "pipemesh":  # breadth-first groups exceed the budget without recomputation
        assert spec.groups == ((4,), (4,)) and spec.recomputed + spec.host_placed > 0
        assert len(plan.placement) == spec.recomputed + spec.host_placed
    assert json.load(open(spec.plan_path))["memory_budget_gb"] == pytest.approx(budget / 2 ** 30)


def test_runnable_options_leave_out_modules_broken_on_cpu():
    """Stock keeps none, selective core_attn and every full uniform/block k; no layernorm or mlp module sets for
    the bench's GPT (biases, no Transformer Engine); without biases the mlp sets run and are offered."""
    from dataclasses import replace

    from megatron_pipemesh.bench.memory_fair import runnable_options

    spec = MODEL.model_spec(CONFIG.pp)
    options = runnable_options(2, spec)
    assert [o.describe() for o in options][:2] == ["no recomputation", "--recompute-granularity selective"]
    assert all(not ({"layernorm", "mlp"} & set(o.modules)) for o in options)
    assert sum(o.granularity == "full" for o in options) == 4  # block and uniform, k = 1, 2
    bias_free = runnable_options(2, replace(spec, linear_bias=False))
    assert {o.modules for o in bias_free if o.granularity == "selective"} == {(), ("mlp",), ("core_attn", "mlp")}


def test_planner_sees_the_bench_network_for_data_parallel():
    """Plans see the bench's topology: with a NIC per rank a ring runs at the rate per rank; on the shared
    loopback the d ranks of a ring share the one shaped bucket (rate / d)."""
    from dataclasses import replace

    from megatron_pipemesh.bench.memory_fair import cluster_spec

    cluster = cluster_spec(CONFIG, AUTO, GBPS)
    assert cluster.p2p_gbps == GBPS and cluster.dp_gbps == GBPS
    shared = cluster_spec(CONFIG, replace(AUTO, per_rank_network=False), GBPS)
    assert shared.p2p_gbps == GBPS and shared.dp_gbps == pytest.approx(GBPS / CONFIG.dp)


@pytest.mark.parametrize("slower", [1, 1000])
def test_placement_mode_reaches_the_pipemesh_plans(tmp_path, slower):
    """'auto' (the default) moves activations to the host where the CPU memcpy, which holds the rank's compute
    thread, costs less than recomputing them (a CPU 1000x slower than the bench's: recomputation dear); at the bench's
    rate recomputing is cheaper than the copy, and 'auto' recomputes like 'recompute-only'. Never slower than it."""
    from dataclasses import replace
    settings = replace(AUTO, device_tflops=AUTO.device_tflops / slower)
    budget = auto_budget_bytes(MODEL, CONFIG, settings, GBPS)
    auto = pipemesh_spec(MODEL, CONFIG, "pipemesh", budget, settings, GBPS, str(tmp_path), ((4,), (4,)))
    only = pipemesh_spec(MODEL, CONFIG, "pipemesh", budget, replace(settings, activation_placement="recompute-only"),
                         GBPS, str(tmp_path / "only"), ((4,), (4,)))
    assert only.host_placed == 0 and only.recomputed > 0
    if slower > 1:
        assert auto.host_placed > 0 and "on the host" in auto.describe()
        assert auto.predicted_iteration_s < only.predicted_iteration_s
    else:
        assert auto.host_placed == 0 and auto.recomputed > 0
        assert auto.predicted_iteration_s == only.predicted_iteration_s


def test_sharded_stock_rows_are_zero1_and_fit_state_plus_activations():
    """--sharding: every stock row is ZeRO-1 (optim per chunk, fp32: 4 + 4 + 8/d bytes per parameter) and its
    recomputation is chosen for state + activations: a budget the activations alone fit no longer suffices."""
    from megatron_pipemesh.bench.memory_fair import cluster_spec, state_bytes

    rows = stock_specs(MODEL, CONFIG, None, AUTO, GBPS, sharding=True)
    assert {r.name: r.sharding for r in rows} == {"1f1b": ("optim",), "interleaved-V2-g2": ("optim", "optim"),
                                                 "interleaved-V2-g4": ("optim", "optim")}
    depth = next(r for r in rows if r.name == "interleaved-V2-g2")
    sched = depth.setting.config()
    zero2 = state_bytes(MODEL, CONFIG, sched, ("optim_grads",) * 2, cluster_spec(CONFIG, AUTO, GBPS, True))
    for one, two in zip(depth.predicted_state_bytes, zero2):
        assert two == pytest.approx(one * 10 / 12)  # ZeRO-2 at d = 2 frees half the fp32 gradients
    assert depth.predicted_peak_memory_bytes == tuple(a + s for a, s in zip(depth.predicted_peak_bytes,
                                                                            depth.predicted_state_bytes))
    budget = max(depth.predicted_peak_bytes) + 1.0  # activations alone fit, with the model state they do not
    alone = {r.name: r for r in stock_specs(MODEL, CONFIG, budget, AUTO, GBPS)}["interleaved-V2-g2"]
    assert alone.predicted_fits and alone.setting.recompute.granularity == "none" and alone.sharding is None
    shared = {r.name: r for r in stock_specs(MODEL, CONFIG, budget, AUTO, GBPS, sharding=True)}["interleaved-V2-g2"]
    assert not shared.predicted_fits and shared.setting.recompute.granularity != "none"
    ample = auto_budget_bytes(MODEL, CONFIG, AUTO, GBPS, sharding=True)
    assert ample > auto_budget_bytes(MODEL, CONFIG, AUTO, GBPS) + min(depth.predicted_state_bytes)


@pytest.mark.parametrize("family", ["pipemesh", "pipemesh-auto"])
def test_pipemesh_rows_plan_levels_into_plan_file_and_flags(tmp_path, family):
    """--sharding on the --quick --sharding model: PipeMesh rows get a level per chunk from the planner (here some
    chunks above ZeRO-1), the same in the plan file, in the loaded plan and after --pipemesh-sharding; the predicted
    peak covers the state the optimizer step holds."""
    from megatron_pipemesh.bench.memory_fair import cluster_spec, step_state_bytes
    from megatron_pipemesh.bench.runner import training_args

    model = ModelSetup(bench_gpt(hidden_size=256, num_attention_heads=4, seq_length=128, micro_batch_size=1), microbatches=4, vpp=4)
    auto, gbps = AutoPlanSettings(device_tflops=0.025, mfu=0.45), 0.2
    budget = auto_budget_bytes(model, CONFIG, auto, gbps, 0.2, sharding=True)
    spec = pipemesh_spec(model, CONFIG, family, budget, auto, gbps, str(tmp_path), ((4,), (4,)), sharding=True)
    assert len(spec.sharding) == 4 and set(spec.sharding) <= {"optim", "optim_grads", "optim_grads_params"}
    assert any(level != "optim" for level in spec.sharding) and spec.predicted_fits
    assert json.load(open(spec.plan_path))["sharding"] == list(spec.sharding)
    assert load_plan(spec.plan_path, 2, 4, 4).sharding == spec.sharding
    args = training_args(model, CONFIG, spec, ["--data-path", "/d"], str(tmp_path))
    assert args[args.index("--pipemesh-sharding") + 1:] == list(spec.sharding)
    step = step_state_bytes(model, CONFIG, spec.schedule_config(2, 4, 4), spec.sharding,
                            cluster_spec(CONFIG, auto, gbps, True))
    assert all(peak >= s for peak, s in zip(spec.predicted_peak_memory_bytes, step))
    assert max(spec.predicted_peak_memory_bytes) <= budget
    assert all(s < p for s, p in zip(spec.predicted_state_bytes, spec.predicted_peak_memory_bytes))
