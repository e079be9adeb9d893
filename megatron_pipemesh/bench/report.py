"""Aggregate benchmark runs into per-schedule numbers; render a table, JSON and a chart."""
from __future__ import annotations

import statistics
from typing import Dict, List, Optional, Sequence

from .calibrate import MeasuredCompute, fit_transfer_overhead, predict_iteration_ms, schedule_config
from .logparse import ParsedLog
from .runner import STOCK, SCHEDULE_LABELS, ModelSetup, ParallelConfig, RunResult


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
    return {
        "runs": len(good), "failed_runs": failed, "errors": [r.error for r in runs if r.error][:2],
        "tokens_per_s_median": tps_med,
        "tokens_per_s_runs": per_run_tps,
        "tokens_per_s_spread": (max(per_run_tps) - min(per_run_tps)) / tps_med if len(per_run_tps) > 1 else 0.0,
        "iteration_ms_median": statistics.median(all_iters),
        "iteration_ms_min": min(all_iters), "iteration_ms_max": max(all_iters),
        "forward_backward_ms": fb, "forward_compute_ms": fwd, "backward_compute_ms": bwd,
        "idle_ms": idle, "peak_rss_mb": rss,
        "auto_groups": ([logs[0].auto_forward_groups, logs[0].auto_backward_groups]
                        if logs[0].auto_forward_groups else None),
        "loss_last": good[0].parsed.iterations[-1].loss if good[0].parsed.iterations else None,
    }


def summarize(results: Sequence[RunResult], model: ModelSetup, configs: Sequence[ParallelConfig],
              schedules: Sequence[str], groups: Dict[str, tuple], bytes_per_s: Optional[float], latency_s: float,
              link_share: float = 1.0) -> List[dict]:
    """Per configuration: per schedule shaped/unshaped metrics, fractions of the limit, calibration."""
    out = []
    for config in configs:
        entry = {"config": config.name, "pp": config.pp, "dp": config.dp, "world": config.world, "schedules": []}
        for schedule in schedules:
            runs = [r for r in results if r.config == config.name and r.schedule == schedule]
            shaped = variant_metrics([r for r in runs if r.shaped], model, config) if any(r.shaped for r in runs) else None
            unshaped = variant_metrics([r for r in runs if not r.shaped], model, config) \
                if any(not r.shaped for r in runs) else None
            row = {"schedule": schedule, "label": SCHEDULE_LABELS[schedule], "shaped": shaped, "unshaped": unshaped}
            g = groups.get((config.name, schedule))
            if schedule == "pipemesh-auto":
                for v in (shaped, unshaped):
                    if v and v.get("auto_groups"):
                        g = tuple(tuple(x) for x in v["auto_groups"])
                        break
            row["groups"] = [list(g[0]), list(g[1])] if g else None
            ok = lambda v: v is not None and v.get("runs")  # noqa: E731
            if ok(shaped) and ok(unshaped):
                row["fraction_of_unshaped"] = shaped["tokens_per_s_median"] / unshaped["tokens_per_s_median"]
                row["comm_share"] = 1.0 - unshaped["iteration_ms_median"] / shaped["iteration_ms_median"]
                row["exposed_comm_ms"] = [s - u if s is not None and u is not None else None
                                          for s, u in zip(shaped["idle_ms"], unshaped["idle_ms"])]
            entry["schedules"].append(row)
        overhead = fit_overhead(entry, model, config)
        entry["fitted_transfer_overhead_ms"] = None if overhead is None else overhead * 1e3
        for row in entry["schedules"]:
            shaped, unshaped = row["shaped"], row["unshaped"]
            ok = lambda v: v is not None and v.get("runs")  # noqa: E731
            base = unshaped if ok(unshaped) else (shaped if ok(shaped) else None)
            if base is not None and None not in base["forward_compute_ms"] and None not in base["backward_compute_ms"]:
                row["calibration"] = calibration_row(model, config, row["schedule"], row["groups"], base,
                                                     shaped if ok(shaped) else None, unshaped if ok(unshaped) else None,
                                                     bytes_per_s, latency_s, link_share, overhead or 0.0)
        _ratios(entry)
        out.append(entry)
    return out


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


def fit_overhead(entry: dict, model: ModelSetup, config: ParallelConfig) -> Optional[float]:
    """Per-transfer overhead (s) fitted on the unshaped run of the first stock schedule present
    (interleaved preferred)."""
    rows = {r["schedule"]: r for r in entry["schedules"]}
    for name in ("interleaved", "1f1b", "breadth-first"):
        u = (rows.get(name) or {}).get("unshaped")
        if u and u.get("runs") and None not in u["forward_compute_ms"] + u["backward_compute_ms"] + u["forward_backward_ms"]:
            sched = schedule_config(name, config.pp, model.vpp, model.microbatches)
            compute = _measured_compute(u, config)
            entry["overhead_fitted_on"] = name
            return fit_transfer_overhead(model, config, sched, compute, max(u["forward_backward_ms"]))
    return None


def calibration_row(model, config, schedule, groups, base, shaped, unshaped, bytes_per_s, latency_s, link_share,
                    overhead_s: float = 0.0) -> dict:
    try:
        sched = schedule_config(schedule, config.pp, model.vpp, model.microbatches, groups)
    except ValueError as error:
        return {"error": str(error)}
    compute = _measured_compute(base, config)
    row = {}
    for name, measured, bw in (("shaped", shaped, bytes_per_s), ("unshaped", unshaped, None)):
        if measured is None or (name == "shaped" and not bytes_per_s):
            continue
        pred = predict_iteration_ms(model, config, sched, compute, bw, (latency_s if bw else 0.0) + overhead_s, link_share)
        meas = measured["iteration_ms_median"]
        row[name] = {**pred, "measured_iteration_ms": meas,
                     "error": (pred["iteration_ms"] - meas) / meas}
    return row


def _ratios(entry: dict) -> None:
    def tps(row, variant):
        v = row.get(variant)
        return v["tokens_per_s_median"] if v and v.get("runs") else None
    for variant in ("shaped", "unshaped"):
        stock = [(tps(r, variant), r["schedule"]) for r in entry["schedules"] if r["schedule"] in STOCK and tps(r, variant)]
        best = max(stock) if stock else None
        pm = {r["schedule"]: tps(r, variant) for r in entry["schedules"] if r["schedule"].startswith("pipemesh")}
        entry[f"best_stock_{variant}"] = best[1] if best else None
        entry[f"pipemesh_vs_best_stock_{variant}"] = {k: (v / best[0] if v and best else None) for k, v in pm.items()}


def _fmt(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def _ranks(values, spec=".0f") -> str:
    if not values:
        return "-"
    return "/".join(_fmt(v, spec) for v in values)


def format_table(summary: Sequence[dict], shaping_desc: str) -> str:
    lines = []
    for entry in summary:
        lines.append(f"## {entry['config']} (PP={entry['pp']}, DP={entry['dp']}, {entry['world']} ranks); shaped: {shaping_desc}")
        if entry.get("oversubscribed"):
            lines.append(f"   note: {entry['world']} ranks on {entry.get('cores')} cores: oversubscribed "
                         f"(1 thread per rank; ranks compete for cores, compute times are inflated and noisy)")
        header = (f"{'schedule':<16} {'groups f / b':<13} {'tok/s':>7} {'spread':>6} {'iter ms':>8} {'unsh tok/s':>10} "
                  f"{'of unsh':>7} {'comm %':>6}  {'idle ms per rank':<17} {'exp.comm ms/rank':<17} {'peak RSS MiB/rank':<18}")
        lines.append(header)
        lines.append("-" * len(header))
        for row in entry["schedules"]:
            s, u = row["shaped"] or {}, row["unshaped"] or {}
            g = row.get("groups")
            gtext = f"{' '.join(map(str, g[0]))} / {' '.join(map(str, g[1]))}" if g else ""
            main = s if s.get("runs") else u
            lines.append(
                f"{row['schedule']:<16} {gtext:<13} {_fmt(s.get('tokens_per_s_median'), '.0f'):>7} "
                f"{_fmt(100 * s['tokens_per_s_spread'] if s.get('runs') else None, '.1f'):>5}% "
                f"{_fmt(s.get('iteration_ms_median'), '.0f'):>8} {_fmt(u.get('tokens_per_s_median'), '.0f'):>10} "
                f"{_fmt(row.get('fraction_of_unshaped'), '.2f'):>7} "
                f"{_fmt(100 * row['comm_share'] if row.get('comm_share') is not None else None, '.0f'):>6}  "
                f"{_ranks(main.get('idle_ms')):<17} {_ranks(row.get('exposed_comm_ms')):<17} {_ranks(main.get('peak_rss_mb')):<18}")
            for variant in ("shaped", "unshaped"):
                v = row.get(variant) or {}
                if v.get("failed_runs"):
                    lines.append(f"   {variant}: {v['failed_runs']} run(s) failed" + (f": {v['errors'][0]}" if v.get("errors") else ""))
        for variant in ("shaped", "unshaped"):
            ratios = entry.get(f"pipemesh_vs_best_stock_{variant}") or {}
            best = entry.get(f"best_stock_{variant}")
            if best and ratios:
                parts = ", ".join(f"{k} {_fmt(v, '.3f')}" for k, v in ratios.items())
                lines.append(f"PipeMesh / best stock ({best}) throughput, {variant}: {parts}")
        cal = [(row["schedule"], row.get("calibration") or {}) for row in entry["schedules"]]
        if any(c for _, c in cal):
            fitted = entry.get("fitted_transfer_overhead_ms")
            lines.append("simulator calibration (measured costs -> simulate): predicted vs measured iteration ms"
                         + (f"; per-transfer overhead {fitted:.2f} ms fitted on the unshaped {entry.get('overhead_fitted_on')} "
                            "run" if fitted is not None else ""))
            for name, c in cal:
                parts = []
                for variant in ("shaped", "unshaped"):
                    if variant in c:
                        x = c[variant]
                        parts.append(f"{variant} {x['iteration_ms']:.0f} vs {x['measured_iteration_ms']:.0f} "
                                     f"({100 * x['error']:+.1f}%)")
                if c.get("error"):
                    parts.append(c["error"])
                lines.append(f"   {name:<16} " + "; ".join(parts))
        lines.append("")
    lines.append("tok/s: median over repeats (shaped); spread: (max-min)/median over repeats; iter ms: median over "
                 "measured iterations; of unsh: shaped / unshaped throughput of the same schedule; comm %: "
                 "1 - unshaped/shaped iteration time; idle = forward-backward - (forward-compute + backward-compute) "
                 "per rank (Megatron timers); exp.comm = shaped idle - unshaped idle; peak RSS: resident memory of "
                 "the whole rank process (weights, optimizer, Python), not activation memory alone.")
    return "\n".join(lines)


def plot_summary(summary: Sequence[dict], path: str, shaping_desc: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(summary)
    fig, axes = plt.subplots(1, n, figsize=(6.5 * n, 4.5), squeeze=False)
    for ax, entry in zip(axes[0], summary):
        rows = entry["schedules"]
        names = [r["schedule"] for r in rows]
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
