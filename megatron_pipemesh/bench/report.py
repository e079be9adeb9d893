"""Aggregate benchmark runs into per-schedule numbers; render a table, JSON and a chart."""
from __future__ import annotations

import statistics
from typing import Dict, List, Optional, Sequence

from .calibrate import MeasuredCompute, fit_transfer_overhead, predict_iteration_ms
from .logparse import ParsedLog
from .memory_fair import STOCK_SHARDING_NOTE, RunSpec, best_stock, fits
from .runner import ModelSetup, ParallelConfig, RunResult


def _median(values: Sequence[float]) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def rank_timer_medians(logs: Sequence[ParsedLog], warmup: int, name: str, world: int) -> List[Optional[float]]:
    """Per rank: median of timer ``name`` (ms per iteration) over the measured iterations of all ``logs``."""
    out = []
    for rank in range(world):
        values = [it.timers.get(name, {}).get(rank) for log in logs for it in log.measured(warmup)]
        out.append(_median([v for v in values if v is not None]))
    return out


def max_per_rank(per_run: Sequence[Optional[Sequence[Optional[float]]]], world: int) -> List[Optional[float]]:
    """Per rank: the largest of the runs' values (None where no run has one)."""
    return [max((values[rank] for values in per_run if values and values[rank] is not None), default=None)
            for rank in range(world)]


def variant_metrics(runs: Sequence[RunResult], model: ModelSetup, config: ParallelConfig) -> Optional[dict]:
    """Numbers of one (configuration, schedule, shaped/unshaped) over its repeats; None without a good run."""
    good = [r for r in runs if r.returncode == 0 and r.parsed.measured(model.warmup_iters)]
    failed = len(runs) - len(good)
    if not good:
        return {"runs": 0, "failed_runs": failed, "errors": [r.error for r in runs if r.error][:2]}
    tokens = model.tokens_per_iteration(config.dp)
    per_run_ms = [statistics.median(it.elapsed_ms for it in r.parsed.measured(model.warmup_iters)) for r in good]
    per_run_tps = [tokens / (ms / 1e3) for ms in per_run_ms]
    all_iters = [it.elapsed_ms for r in good for it in r.parsed.measured(model.warmup_iters)]
    logs = [r.parsed for r in good]
    world = config.world
    fb = rank_timer_medians(logs, model.warmup_iters, "forward-backward", world)
    fwd = rank_timer_medians(logs, model.warmup_iters, "forward-compute", world)
    bwd = rank_timer_medians(logs, model.warmup_iters, "backward-compute", world)
    compute = [(f or 0.0) + (b or 0.0) if f is not None or b is not None else None for f, b in zip(fwd, bwd)]
    idle = [x - c if x is not None and c is not None else None for x, c in zip(fb, compute)]
    tps_med = statistics.median(per_run_tps)
    rss = [_median([r.peak_rss_mb.get(rank) for r in good if rank in r.peak_rss_mb]) for rank in range(world)]
    peaks = max_per_rank([r.activation_peak_bytes for r in good], world)
    return {
        "runs": len(good), "failed_runs": failed, "errors": [r.error for r in runs if r.error][:2],
        "tokens_per_s_median": tps_med,
        "tokens_per_s_runs": per_run_tps,
        "tokens_per_s_spread": (max(per_run_tps) - min(per_run_tps)) / tps_med if len(per_run_tps) > 1 else 0.0,
        "iteration_ms_median": statistics.median(all_iters),
        "iteration_ms_min": min(all_iters), "iteration_ms_max": max(all_iters),
        "forward_backward_ms": fb, "forward_compute_ms": fwd, "backward_compute_ms": bwd,
        "idle_ms": idle, "peak_rss_mb": rss, "peak_activation_bytes": peaks,
        "model_state_bytes": max_per_rank([r.model_state_bytes for r in good], world),
        "peak_memory_bytes": max_per_rank([r.peak_memory_bytes for r in good], world),
        "auto_groups": ([logs[0].auto_forward_groups, logs[0].auto_backward_groups]
                        if logs[0].auto_forward_groups else None),
        "loss_last": good[0].parsed.iterations[-1].loss if good[0].parsed.iterations else None,
    }


def summarize(results: Sequence[RunResult], model: ModelSetup, configs: Sequence[ParallelConfig],
              specs: Dict[str, Sequence[RunSpec]], budgets: Dict[str, Optional[float]], bytes_per_s: Optional[float],
              latency_s: float, link_share: float = 1.0, sharding: bool = False, per_rank: bool = True) -> List[dict]:
    """Per configuration: one row per run spec (shaped/unshaped metrics, measured peak activation bytes per
    rank, ``fits`` the budget), the best stock row that fits, PipeMesh's ratios to it, calibration (on the
    network's topology: ``per_rank`` NICs or one shared bucket). With ``sharding`` the budget is per-rank
    memory (model state + activations) and rows carry their levels."""
    out = []
    for config in configs:
        budget = budgets.get(config.name)
        entry = {"config": config.name, "pp": config.pp, "dp": config.dp, "world": config.world,
                 "activation_budget_bytes": None if sharding else budget,
                 "memory_budget_bytes": budget if sharding else None, "sharding": sharding, "schedules": []}
        if sharding:
            entry["stock_sharding"] = STOCK_SHARDING_NOTE
        for spec in specs[config.name]:
            runs = [r for r in results if r.config == config.name and r.schedule == spec.name]
            shaped = variant_metrics([r for r in runs if r.shaped], model, config) if any(r.shaped for r in runs) else None
            unshaped = variant_metrics([r for r in runs if not r.shaped], model, config) \
                if any(not r.shaped for r in runs) else None
            entry["schedules"].append(_row(spec, shaped, unshaped, budget, config))
        overhead = fit_overhead(entry, model, config, specs[config.name], bytes_per_s, latency_s, link_share, per_rank)
        entry["fitted_transfer_overhead_ms"] = None if overhead is None else overhead * 1e3
        ok = lambda v: v is not None and v.get("runs")  # noqa: E731
        for spec, row in zip(specs[config.name], entry["schedules"]):
            shaped, unshaped = row["shaped"], row["unshaped"]
            base = unshaped if ok(unshaped) else (shaped if ok(shaped) else None)
            if base is not None and None not in base["forward_compute_ms"] and None not in base["backward_compute_ms"]:
                row["calibration"] = calibration_row(model, config, spec, base, shaped if ok(shaped) else None,
                                                     unshaped if ok(unshaped) else None, bytes_per_s, latency_s,
                                                     link_share, overhead or 0.0, per_rank)
        _ratios(entry)
        out.append(entry)
    return out


def _row(spec: RunSpec, shaped: Optional[dict], unshaped: Optional[dict], budget: Optional[float],
         config: ParallelConfig) -> dict:
    """One schedule row: the spec's settings and the measured numbers of its main variant (shaped when
    measured, else unshaped)."""
    ok = lambda v: v is not None and v.get("runs")  # noqa: E731
    main = shaped if ok(shaped) else (unshaped if ok(unshaped) else None)
    variants = [v for v in (shaped, unshaped) if ok(v)]

    def measured(key: str) -> Optional[List[Optional[float]]]:
        """The larger of the shaped and unshaped runs' values, per rank (None when none was measured)."""
        values = max_per_rank([v.get(key) for v in variants], config.world)
        return values if any(x is not None for x in values) else None

    peaks, state, total = measured("peak_activation_bytes"), measured("model_state_bytes"), measured("peak_memory_bytes")
    per_global = lambda values: (None if values is None  # noqa: E731  (per pipeline rank -> per global rank)
                                 else [values[pipeline_rank(r, config)] for r in range(config.world)])
    predicted = per_global(spec.predicted_peak_bytes)
    row = {"name": spec.name, "schedule": spec.name, "family": spec.family, "stock": spec.stock, "default": spec.default,
           "group_size": spec.group_size, "recompute": spec.recompute, "stock_flags": list(spec.stock_flags),
           "setting": spec.describe(), "predicted_fits": spec.predicted_fits, "plan_file": spec.plan_path,
           # --sharding: the budget holds model state + activations, so the measured peak of both decides
           "fits": fits(total if spec.sharding else peaks, budget), "peak_activation_bytes": peaks,
           "predicted_peak_activation_bytes": predicted,
           "sharding": list(spec.sharding) if spec.sharding else None, "model_state_bytes": state,
           "peak_memory_bytes": total, "predicted_model_state_bytes": per_global(spec.predicted_state_bytes),
           "predicted_peak_memory_bytes": per_global(spec.predicted_peak_memory_bytes),
           "predicted_iteration_ms": spec.predicted_iteration_s * 1e3 if spec.predicted_iteration_s else None,
           "tokens_per_s": main["tokens_per_s_median"] if main else None,
           "tokens_per_s_spread": main["tokens_per_s_spread"] if main else None,
           "tokens_per_s_runs": main["tokens_per_s_runs"] if main else None,
           "groups": [list(spec.groups[0]), list(spec.groups[1])] if spec.groups else None,
           "recomputed_chunk_microbatches": spec.recomputed if not spec.stock else None,
           "host_placed_chunk_microbatches": spec.host_placed if not spec.stock else None,
           "shaped": shaped, "unshaped": unshaped}
    if ok(shaped) and ok(unshaped):
        row["fraction_of_unshaped"] = shaped["tokens_per_s_median"] / unshaped["tokens_per_s_median"]
        row["comm_share"] = 1.0 - unshaped["iteration_ms_median"] / shaped["iteration_ms_median"]
        row["exposed_comm_ms"] = [s - u if s is not None and u is not None else None
                                  for s, u in zip(shaped["idle_ms"], unshaped["idle_ms"])]
    return row


def _measured_compute(base: dict, config: ParallelConfig) -> MeasuredCompute:
    # per pipeline rank: Megatron's global rank r has pipeline rank r % pp (pipeline is the outer dimension
    # only for PP > 1 with DP; with the default order tp-cp-ep-dp-pp, ranks 0..dp-1 share pipeline rank 0)
    fwd, bwd = [], []
    for stage in range(config.pp):
        members = [r for r in range(config.world) if pipeline_rank(r, config) == stage]
        fwd.append(statistics.mean(base["forward_compute_ms"][r] for r in members))
        bwd.append(statistics.mean(base["backward_compute_ms"][r] for r in members))
    fb_max = max(x for x in base["forward_backward_ms"] if x is not None)
    return MeasuredCompute(fwd, bwd, max(0.0, base["iteration_ms_median"] - fb_max))


def pipeline_rank(rank: int, config: ParallelConfig) -> int:
    """Pipeline rank of global rank ``rank`` under Megatron's default order (tp-cp-ep-dp-pp, TP = CP = 1)."""
    return rank // config.dp


def fit_overhead(entry: dict, model: ModelSetup, config: ParallelConfig, specs: Sequence[RunSpec],
                 bytes_per_s: Optional[float] = None, latency_s: float = 0.0, link_share: float = 1.0,
                 per_rank: bool = True) -> Optional[float]:
    """Per-transfer overhead (s) fitted on one stock row without recomputation (depth-first preferred, then 1F1B,
    then any other group size): on its unshaped run, or on its shaped run (``bytes_per_s``, the network modelled)
    when no row has an unshaped one. Records the row and the variant in ``entry``."""
    order = sorted((i for i, spec in enumerate(specs) if spec.stock and spec.setting.recompute.granularity == "none"),
                   key=lambda i: (specs[i].group_size != config.pp, specs[i].family != "1f1b"))
    complete = lambda v: (v and v.get("runs") and None not in  # noqa: E731
                          v["forward_compute_ms"] + v["backward_compute_ms"] + v["forward_backward_ms"])
    for variant, rate in [("unshaped", None)] + ([("shaped", bytes_per_s)] if bytes_per_s else []):
        for i in order:
            measured = entry["schedules"][i].get(variant)
            if complete(measured):
                sched = specs[i].schedule_config(config.pp, model.vpp, model.microbatches)
                entry["overhead_fitted_on"], entry["overhead_fitted_variant"] = specs[i].name, variant
                return fit_transfer_overhead(model, config, sched, _measured_compute(measured, config),
                                             max(measured["forward_backward_ms"]), bytes_per_s=rate,
                                             latency_s=latency_s if rate else 0.0, link_share=link_share,
                                             sharding=specs[i].sharding, per_rank=per_rank, megatron_p2p=True)
    return None


def calibration_row(model, config, spec: RunSpec, base, shaped, unshaped, bytes_per_s, latency_s, link_share,
                    overhead_s: float = 0.0, per_rank: bool = True) -> dict:
    try:
        sched = spec.schedule_config(config.pp, model.vpp, model.microbatches)
    except ValueError as error:
        return {"error": str(error)}
    compute = _measured_compute(base, config)
    row = {}
    for name, measured, bw in (("shaped", shaped, bytes_per_s), ("unshaped", unshaped, None)):
        if measured is None or (name == "shaped" and not bytes_per_s):
            continue
        pred = predict_iteration_ms(model, config, sched, compute, bw, (latency_s if bw else 0.0) + overhead_s, link_share,
                                    spec.sharding, per_rank, spec.stock)
        meas = measured["iteration_ms_median"]
        row[name] = {**pred, "measured_iteration_ms": meas,
                     "error": (pred["iteration_ms"] - meas) / meas}
    return row


def _ratios(entry: dict) -> None:
    """Best stock row and best row of Megatron's default command (fastest that fits) and each PipeMesh row's
    ratio to each; best stock also per variant."""
    rows = entry["schedules"]
    for key, best in (("best_stock", best_stock(rows)), ("best_default", best_stock(rows, default_only=True))):
        entry[key] = best["name"] if best else None
        entry[f"{key}_setting"] = best["setting"] if best else None
        for row in rows:
            if not row["stock"]:
                row[f"ratio_to_{key}"] = (row["tokens_per_s"] / best["tokens_per_s"]
                                          if best and row["tokens_per_s"] else None)
    for variant in ("shaped", "unshaped"):
        view = [{**r, "tokens_per_s": (r.get(variant) or {}).get("tokens_per_s_median")} for r in rows]
        top = best_stock(view)
        entry[f"best_stock_{variant}"] = top["name"] if top else None
        entry[f"pipemesh_vs_best_stock_{variant}"] = {
            r["name"]: (r["tokens_per_s"] / top["tokens_per_s"] if top and r["tokens_per_s"] else None)
            for r in view if not r["stock"]}


def _fmt(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def _ranks(values, spec=".0f") -> str:
    if not values:
        return "-"
    return "/".join(_fmt(v, spec) for v in values)


def _mib(values) -> str:
    return _ranks([v / 2 ** 20 if v is not None else None for v in values], ".2f") if values else "-"


def format_table(summary: Sequence[dict], shaping_desc: str) -> str:
    """The bench's table: per layout its heading, one line per row, the best rows and ratios, the simulator's
    calibration; then what the columns mean."""
    lines = []
    sharded = any(entry.get("sharding") for entry in summary)
    for entry in summary:
        lines += _entry_heading(entry, shaping_desc)
        width = max([17] + [len(row["name"]) + bool(row.get("default")) for row in entry["schedules"]])  # with its mark
        lines += _row_lines(entry, width)
        lines += _best_lines(entry)
        lines += _calibration_lines(entry, width)
        lines.append("")
    lines.append(_legend(sharded))
    return "\n".join(lines)


def _entry_heading(entry: dict, shaping_desc: str) -> List[str]:
    """A layout's title (its budget) and its notes."""
    lines = []
    budget = entry.get("memory_budget_bytes" if entry.get("sharding") else "activation_budget_bytes")
    lines.append(f"## {entry['config']} (PP={entry['pp']}, DP={entry['dp']}, {entry['world']} ranks); shaped: "
                 f"{shaping_desc}; {'memory (model state + activations)' if entry.get('sharding') else 'activation'} "
                 f"budget per rank: " + (f"{budget / 2 ** 20:.2f} MiB" if budget is not None else "none"))
    if entry.get("stock_sharding"):
        lines.append(f"   note: {entry['stock_sharding']}")
    if entry.get("oversubscribed"):
        lines.append(f"   note: {entry['world']} ranks on {entry.get('cores')} cores: oversubscribed "
                     f"(1 thread per rank{'; ranks pinned to the core of their pipeline stage' if entry.get('pinned') else ''}; "
                     "compute times are inflated and noisy)")
    return lines


def _row_lines(entry: dict, width: int) -> List[str]:
    """The column header and one line per row (with its failed runs)."""
    lines = []
    memory = (f"{'state+act peak MiB/rank (pred.)':<35} {'state MiB/rank (pred.)':<35} " if entry.get("sharding")
              else "")
    header = (f"{'schedule':<{width}} {'fits':<4} {'tok/s':>7} {'spread':>6} {'iter ms':>8} {'unsh tok/s':>10} "
              f"{'comm %':>6}  {memory}{'act. peak MiB/rank (pred.)':<30} {'idle ms per rank':<17} setting")
    lines.append(header)
    lines.append("-" * len(header))
    for row in entry["schedules"]:
        s, u = row["shaped"] or {}, row["unshaped"] or {}
        main = s if s.get("runs") else u
        predicted = row.get("predicted_peak_activation_bytes")
        peaks = f"{_mib(row.get('peak_activation_bytes'))} ({_mib(predicted)})"
        if entry.get("sharding"):
            total = f"{_mib(row.get('peak_memory_bytes'))} ({_mib(row.get('predicted_peak_memory_bytes'))})"
            state = f"{_mib(row.get('model_state_bytes'))} ({_mib(row.get('predicted_model_state_bytes'))})"
            peaks = f"{total:<35} {state:<35} {peaks}"
        lines.append(
            f"{row['name'] + ('*' if row.get('default') else ''):<{width}} {'yes' if row['fits'] else 'NO':<4} {_fmt(row.get('tokens_per_s'), '.0f'):>7} "
            f"{_fmt(100 * row['tokens_per_s_spread'] if row.get('tokens_per_s_spread') is not None else None, '.1f'):>5}% "
            f"{_fmt(main.get('iteration_ms_median'), '.0f'):>8} {_fmt(u.get('tokens_per_s_median'), '.0f'):>10} "
            f"{_fmt(100 * row['comm_share'] if row.get('comm_share') is not None else None, '.0f'):>6}  "
            f"{peaks:<30} {_ranks(main.get('idle_ms')):<17} {row['setting']}")
        for variant in ("shaped", "unshaped"):
            v = row.get(variant) or {}
            if v.get("failed_runs"):
                lines.append(f"   {variant}: {v['failed_runs']} run(s) failed" + (f": {v['errors'][0]}" if v.get("errors") else ""))
    return lines


def _best_lines(entry: dict) -> List[str]:
    """The best stock and best default rows, and PipeMesh's ratio to each, shaped and unshaped."""
    lines = []
    for key, what in (("best_stock", "best stock"), ("best_default", "best default command")):
        best = entry.get(key)
        if best:
            ratios = ", ".join(f"{r['name']} {_fmt(r.get(f'ratio_to_{key}'), '.3f')}"
                               for r in entry["schedules"] if not r["stock"])
            lines.append(f"{what} (fastest that fits): {best} [{entry.get(f'{key}_setting')}]; "
                         f"PipeMesh / {what}: {ratios}")
        else:
            lines.append(f"{what}: no such row fits the budget")
    for variant in ("shaped", "unshaped"):
        ratios = entry.get(f"pipemesh_vs_best_stock_{variant}") or {}
        top = entry.get(f"best_stock_{variant}")
        if top and ratios and any(r.get("shaped") for r in entry["schedules"]) and \
                any(r.get("unshaped") for r in entry["schedules"]):
            parts = ", ".join(f"{k} {_fmt(v, '.3f')}" for k, v in ratios.items())
            lines.append(f"   {variant}: best stock {top}; PipeMesh / best stock: {parts}")
    return lines


def _calibration_lines(entry: dict, width: int) -> List[str]:
    """The simulator's predicted vs measured iteration time per row (none without a calibration)."""
    lines: List[str] = []
    cal = [(row["name"], row.get("calibration") or {}) for row in entry["schedules"]]
    if any(c for _, c in cal):
        fitted = entry.get("fitted_transfer_overhead_ms")
        lines.append("simulator calibration (measured costs -> simulate): predicted vs measured iteration ms"
                     + (f"; per-transfer overhead {fitted:.2f} ms fitted on the "
                        f"{entry.get('overhead_fitted_variant', 'unshaped')} {entry.get('overhead_fitted_on')} run"
                        if fitted is not None else ""))
        for name, c in cal:
            parts = []
            for variant in ("shaped", "unshaped"):
                if variant in c:
                    x = c[variant]
                    parts.append(f"{variant} {x['iteration_ms']:.0f} vs {x['measured_iteration_ms']:.0f} "
                                 f"({100 * x['error']:+.1f}%)")
            if c.get("error"):
                parts.append(c["error"])
            lines.append(f"   {name:<{width}} " + "; ".join(parts))
    return lines


def _legend(sharded: bool) -> str:
    """What the columns mean."""
    fits_text = ("fits: every rank's measured peak of model state (weights + gradients + optimizer state, with "
                 "gathered ZeRO-3 weights, ZeRO-2/3 gradient buffers and the optimizer step's whole buffers) + "
                 "activations within the memory budget (--sharding: every row runs Megatron's distributed optimizer "
                 "with --overlap-grad-reduce --overlap-param-gather); state: the least model state held while the "
                 "schedule ran" if sharded else
                 "fits: every rank's measured peak activation bytes (activation meter: saved-for-backward tensors on "
                 "CPU, the CUDA allocator on GPU) within the budget")
    return (fits_text + "; a row that does not fit never counts as best. *: Megatron's default command (1F1B, "
            "or interleaved with g = p; the first of none / selective / full block k predicted to fit). "
            "tok/s: median over repeats (shaped when measured); spread: (max-min)/median over repeats; iter ms: "
            "median over measured iterations; comm %: 1 - unshaped/shaped iteration time; idle = forward-backward "
            "- (forward-compute + backward-compute) per rank (Megatron timers); pred.: the memory model's peak.")


def plot_summary(summary: Sequence[dict], path: str, shaping_desc: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(summary)
    fig, axes = plt.subplots(1, n, figsize=(6.5 * n, 4.5), squeeze=False)
    for ax, entry in zip(axes[0], summary):
        rows = entry["schedules"]
        names = [r["name"] for r in rows]
        xs = range(len(rows))
        shaped = [(r["shaped"] or {}).get("tokens_per_s_median") or 0 for r in rows]
        unshaped = [(r["unshaped"] or {}).get("tokens_per_s_median") or 0 for r in rows]
        err = []
        for r in rows:
            runs = (r["shaped"] or {}).get("tokens_per_s_runs") or [0]
            med = (r["shaped"] or {}).get("tokens_per_s_median") or 0
            err.append((med - min(runs), max(runs) - med))
        w = 0.38
        ax.bar([x - w / 2 for x in xs], unshaped, w, label="unshaped (limit)", color="#bbbbbb")
        ax.bar([x + w / 2 for x in xs], shaped, w, label=f"shaped ({shaping_desc})", color="#3b75af",
               yerr=list(zip(*err)) if any(any(e) for e in err) else None, capsize=3)
        for x, r, s in zip(xs, rows, shaped):
            frac = r.get("fraction_of_unshaped")
            if frac is not None and s:
                ax.text(x + w / 2, s, f"{100 * frac:.0f}%", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs))
        ax.set_xticklabels(names, rotation=20, ha="right")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{entry['config']} ({entry['world']} ranks)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
