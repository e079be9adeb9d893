"""The study (``pipemesh study``): rows against stock's whole option set, the limit, the summary."""
import json

import pytest

from megatron_pipemesh import command as cli
from megatron_pipemesh.planning.bounds import virtual_sizes
from megatron_pipemesh.planning.costs import ModelSpec
from megatron_pipemesh.planning.memory import MEMORY_MARGIN
from megatron_pipemesh.study import rows as study_rows
from megatron_pipemesh.study import study
from megatron_pipemesh.study.study import COMMODITY, DATACENTRE, StudyRow, markdown, run_row, summary


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setitem(study_rows.GPT, "GPT-tiny", ModelSpec(8, 1024, 8, 1024, 1))
    return "GPT-tiny"


def test_row_has_the_issue_keys_and_pipemesh_never_loses(tiny):
    """A row names best stock (schedule, V, g, recomputation) and PipeMesh auto (groups, recomputation,
    V); PipeMesh's search contains stock's schedules, so with memory to spare it is never slower."""
    row = run_row(StudyRow("commodity", tiny, 1, 2, 2, 8, 40, 10.0))
    assert row["regime"] == "commodity"
    assert {"schedule", "vpp", "group_size", "recompute", "flags"} <= set(row["best_stock"])
    assert {"forward_groups", "backward_groups", "vpp", "recompute_share"} <= set(row["pipemesh_auto"])
    assert row["ratio_to_best_stock"] >= 0.999
    assert 0 < row["fraction_of_limit"] <= 1.0
    assert row["limit_iteration_s"] <= row["pipemesh_auto"]["iteration_s"]
    assert tiny in markdown([row])
    # Megatron's default command (g = p) is one of stock's settings; the tight bound is below every schedule.
    assert row["default"]["group_size"] in (None, 2) and row["default"]["offload_fraction"] is None
    assert row["ratio_to_default"] >= row["ratio_to_best_stock"] * (1 - 1e-9)
    assert row["ratio_to_default"] == pytest.approx(row["default"]["iteration_s"] / row["pipemesh_auto"]["iteration_s"])
    assert 0 < row["fraction_of_tight_bound"] <= 1.0
    assert row["tight_bound_s"] == row["bound"]["seconds"] <= row["best_stock"]["iteration_s"]
    assert row["fraction_of_tight_bound"] <= row["fraction_of_tight_bound_with_memory"] <= 1.0


def test_tight_memory_makes_both_sides_recompute(tiny):
    """At a device memory where nothing fits without recomputation, both sides recompute."""
    row = run_row(StudyRow("commodity", tiny, 1, 2, 2, 16, 1.8, 10.0))
    assert row["best_stock"]["recompute"] != "no recomputation"
    assert row["pipemesh_recompute_only"]["recompute_share"] > 0


def test_placement_row_is_never_slower_than_recompute_only(tiny):
    """With memory binding, the placement-enabled plan (pipemesh_auto) is at least as fast as recompute-only,
    reports its host placement per rank, and stays within the study's host memory."""
    row = run_row(StudyRow("commodity", tiny, 1, 2, 2, 16, 1.8, 10.0))
    placed, alone = row["pipemesh_auto"], row["pipemesh_recompute_only"]
    assert placed["iteration_s"] <= alone["iteration_s"] and row["placement_speedup"] >= 1.0
    assert len(placed["host_counts"]) == 2 and max(placed["peak_host_gb"]) <= study.HOST_MEMORY_GB
    assert row["ratio_to_best_stock"] == pytest.approx(row["best_stock"]["iteration_s"] / placed["iteration_s"])
    assert "recompute-only" in markdown([row]) and "placement" in markdown([row])


def test_summary_counts_the_targets():
    """The summary reports the share of commodity rows at >= 1.15x, the minimum ratio and the median limit fraction."""
    rows = [{"regime": "commodity", "ratio_to_best_stock": r, "fraction_of_limit": f}
            for r, f in ((1.2, 0.9), (1.0, 0.8), (1.16, 0.95))] + [
        {"regime": "datacentre", "ratio_to_best_stock": 0.98, "fraction_of_limit": 0.9}]
    out = summary(rows)
    assert out["share_at_least_1_15x"] == pytest.approx(2 / 3)
    assert out["min_ratio_all_rows"] == 0.98
    assert out["median_fraction_of_limit_commodity"] == 0.9
    # Rows without a layer spec predate it (local); per spec the same three targets.
    rows[0]["layer_spec"] = rows[2]["layer_spec"] = "te"
    out = summary(rows)
    assert out["te_rows"] == 2 and out["te_share_at_least_1_15x"] == 1.0 and out["te_median_ratio"] == pytest.approx(1.18)
    assert out["local_rows"] == 1 and out["local_share_at_least_1_15x"] == 0.0 and out["local_median_fraction_of_limit"] == 0.8
    # Against Megatron's default command and the tight bound: median and range, median fractions.
    for row, (default, fraction) in zip(rows, ((1.3, 0.97), (1.1, 0.9), (1.2, 0.95), (1.0, 0.5))):
        row.update(ratio_to_default=default, fraction_of_tight_bound=fraction, fraction_of_tight_bound_with_memory=1.0)
    out = summary(rows)
    assert (out["median_ratio_to_default_commodity"], out["min_ratio_to_default_commodity"],
            out["max_ratio_to_default_commodity"]) == (1.2, 1.1, 1.3)
    assert out["median_fraction_of_tight_bound_commodity"] == 0.95 and out["min_ratio_commodity"] == 1.0
    assert out["median_ratio_to_default_te"] == pytest.approx(1.25)


def test_study_rows_cover_the_commodity_sweep():
    """The commodity subset spans 24/32/40 GB, TP 1 / 2 / 2+SP, DP 2-8, every GPT size, 6.25-50 Gbit/s."""
    assert {r.memory_gb for r in COMMODITY} == {24, 32, 40}
    assert {(r.tp, r.sequence_parallel) for r in COMMODITY} == {(1, False), (2, False), (2, True)}
    assert {r.dp for r in COMMODITY} == {2, 4, 8}
    assert {r.model for r in COMMODITY} == {"GPT-1.3B", "GPT-2.7B", "GPT-6.7B", "GPT-13B"}
    assert {r.gbps for r in COMMODITY} == {6.25, 10.0, 25.0, 50.0}
    # Every layout and rate with Megatron's default layer spec (Transformer Engine) and with the local one.
    settings = lambda spec: {(r.model, r.tp, r.sequence_parallel, r.dp, r.memory_gb, r.gbps, r.gpus_per_node)  # noqa: E731
                             for r in COMMODITY if r.layer_spec == spec}
    assert settings("local") <= settings("te") | {(r.model, r.tp, r.sequence_parallel, r.dp, r.memory_gb, r.gbps, r.gpus_per_node)
                                                  for r in COMMODITY if r.gbps in (10.0, 50.0) or r.grad_reduce_in_bf16}
    assert len(settings("te")) >= 19
    assert all(r.regime == "datacentre" for r in DATACENTRE)


def test_cli_study_json(tiny, monkeypatch, capsys):
    """`pipemesh study --json` prints a JSON list of rows with the issue's keys."""
    monkeypatch.setattr(study, "COMMODITY", (StudyRow("commodity", tiny, 1, 2, 2, 8, 40, 10.0),))
    monkeypatch.setattr(study, "DATACENTRE", ())
    assert cli.main(["study", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert isinstance(rows, list) and len(rows) == 1
    assert {"regime", "best_stock", "pipemesh_auto", "ratio_to_best_stock", "fraction_of_limit",
            "pipemesh_recompute_only", "placement_speedup", "default", "ratio_to_default", "tight_bound_s",
            "fraction_of_tight_bound"} <= set(rows[0])


def test_sharded_row_is_never_slower_than_the_best_uniform_plan(tiny):
    """--sharding: PipeMesh's mixed levels lose to some uniform level of its own planner (search or incumbent
    broken), or the row lacks the levels of both sides / the ZeRO-1 view; memory binds, so sharding pays."""
    from megatron_pipemesh.planning.costs import GB, analytic_costs
    from megatron_pipemesh.planning.planner import NoFeasiblePlan, plan_schedule
    from megatron_pipemesh.planning.sharding import ShardingModel, ShardingSpec
    from megatron_pipemesh.schedule.spans import SHARD_LEVELS as LEVELS
    from megatron_pipemesh.planning.stock import STOCK_SHARDING

    row = StudyRow("commodity", tiny, 1, 2, 2, 8, 1.6, 100.0)
    out = run_row(row, sharding=True)
    model, cluster = study_rows.row_specs(row)
    budget = row.memory_gb * GB * (1 - MEMORY_MARGIN)
    uniform = []
    for vpp in virtual_sizes(model, row.pp):
        for level in LEVELS:
            try:
                plan, _ = plan_schedule(row.pp, vpp, row.microbatches, lambda cfg: analytic_costs(model, cluster, cfg),
                                        budget, study._planner_options(row.pp, row.microbatches, "auto"),
                                        sharding=ShardingModel(model, cluster, ShardingSpec((level,) * vpp)))
            except NoFeasiblePlan:
                continue
            uniform.append(plan.result.iteration_s)
    mixed = out["pipemesh_auto"]
    assert mixed["iteration_s"] <= min(uniform) * (1 + 1e-9)
    assert mixed["iteration_s"] < out["pipemesh_unsharded"]["iteration_s"] and set(mixed["sharding"]) != {"optim"}
    assert len(mixed["sharding"]) == mixed["vpp"] and out["best_stock"]["sharding"] in STOCK_SHARDING
    assert out["ratio_without_sharding"] == pytest.approx(
        out["best_stock_unsharded"]["iteration_s"] / out["pipemesh_unsharded"]["iteration_s"])
    assert "ratio without sharding" in markdown([out]) and summary([out])["rows_pipemesh_sharded"] == 1


def test_unsharded_row_names_zero1_on_both_sides(tiny):
    """Without --sharding both sides are ZeRO-1 and say so (stock's flags carry --use-distributed-optimizer)."""
    row = run_row(StudyRow("commodity", tiny, 1, 2, 2, 8, 40, 10.0))
    assert row["best_stock"]["sharding"] == "optim" and "--use-distributed-optimizer" in row["best_stock"]["flags"]
    assert row["pipemesh_auto"]["sharding"] == ["optim"] * row["pipemesh_auto"]["vpp"]
    assert "ratio_without_sharding" not in row and "sharding: stock / PipeMesh" in markdown([row])


def test_cli_study_sharding_flag(tiny, monkeypatch, capsys):
    """`pipemesh study --sharding --json` runs the sharded rows (the flag not reaching run_row)."""
    monkeypatch.setattr(study, "COMMODITY", (StudyRow("commodity", tiny, 1, 2, 2, 8, 40, 10.0),))
    monkeypatch.setattr(study, "DATACENTRE", ())
    assert cli.main(["study", "--json", "--sharding"]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert {"best_stock_unsharded", "pipemesh_unsharded", "ratio_without_sharding"} <= set(row)


def test_advice_ratio_to_default(tiny):
    """A commodity row reports the advice's best (PipeMesh or stock over every TP x PP x DP of its 4 GPUs, micro-batch
    size, V and split): never slower than PipeMesh on the row's own layout (it is one of the candidates and the
    incumbent), so its ratio to Megatron's default command is at least ratio_to_default; the summary gives median,
    min and max."""
    row = run_row(StudyRow("commodity", tiny, 1, 2, 2, 16, 1.8, 10.0))
    best = row["advice_best_layout"]
    assert best["tp"] * best["pp"] * best["dp"] == 4
    assert 0 <= best["advice_simulated"] <= 2 * study.ADVICE_CANDIDATES and isinstance(best["advice_complete"], bool)
    assert best["kind"] in ("pipemesh", "stock") and 16 % (best["micro_batch_size"] * best["dp"]) == 0
    assert best["iteration_s"] <= row["pipemesh_auto"]["iteration_s"] * (1 + 1e-9)
    assert row["advice_ratio_to_default"] == pytest.approx(row["default"]["iteration_s"] / best["iteration_s"])
    assert row["advice_ratio_to_default"] >= row["ratio_to_default"] * (1 - 1e-9)
    assert row["advice_cpu_s"] >= 0
    other = dict(row, advice_ratio_to_default=2 * row["advice_ratio_to_default"])
    out = summary([row, other, dict(row, regime="datacentre", advice_ratio_to_default=None)])
    assert out["min_advice_ratio_to_default_commodity"] == row["advice_ratio_to_default"]
    assert out["max_advice_ratio_to_default_commodity"] == other["advice_ratio_to_default"]
    assert out["median_advice_ratio_to_default_commodity"] == pytest.approx(1.5 * row["advice_ratio_to_default"])


def _setting_only(row, sharding=False):
    """A stand-in for :func:`run_row` (module-level: the workers unpickle it)."""
    return {"setting": row.describe()}


def test_parallel_rows_come_back_in_the_given_order_though_run_longest_first(monkeypatch):
    """Workers take the rows with the most micro-batches (then the largest model) first, yet the result
    lists every row where it was given."""
    monkeypatch.setattr(study, "run_row", _setting_only)
    rows = COMMODITY[:4] + COMMODITY[4:8]  # 16 then 32 micro-batches per replica
    out = study.run_study(rows, jobs=2)
    assert [r["setting"] for r in out] == [row.describe() for row in rows]
