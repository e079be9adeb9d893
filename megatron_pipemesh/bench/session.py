"""One ``pipemesh bench`` session after its rows are planned: every run in turn (inside the shaped namespace), the
runs summarized against their predictions into ``summary.json``, and the table, JSON or chart the flags ask for.
:mod:`.cli` reads the flags and plans the rows."""
from __future__ import annotations

import json
import os
import sys
from typing import List

from ..cli.common import UsageError, emit_json


def log(text: str) -> None:
    """A progress line on stderr (stdout keeps the table or the JSON)."""
    print(text, file=sys.stderr, flush=True)


def run_all(args, setup: dict, plan: list, data_flags, machine: dict, out_dir: str):
    """Every run of ``plan`` in order, inside the shaped namespace (removed at the end, also on Ctrl-C); None when
    interrupted."""
    from .netns import ShapedNamespace
    from .runner import RunResult

    configs, shaping = setup["configs"], setup["shaping"]
    results: List[RunResult] = []
    namespace = ShapedNamespace(shaping, ranks=max(c.world for c in configs)) if shaping else None
    try:
        enter_namespace(namespace)
        for index, (repeat, config, spec, shaped) in enumerate(plan, 1):
            results.append(_run_row(args, setup["model"], index, len(plan), repeat, config, spec,
                                    namespace if shaped else None, shaped, data_flags, machine, out_dir))
    except KeyboardInterrupt:
        log("pipemesh bench: interrupted; the namespace is being removed")
        return None
    finally:
        if namespace:
            namespace.close()
    return results


def enter_namespace(namespace) -> None:
    """Set up ``namespace`` (a :class:`.netns.ShapedNamespace`, or None: nothing to do); UsageError naming what the
    kernel refused. The caller closes it in ``finally``, also after a failed set-up."""
    from .netns import NamespaceError

    if namespace:
        try:
            namespace.__enter__()
        except NamespaceError as error:
            raise UsageError(str(error)) from error


def _run_row(args, model, index: int, total: int, repeat: int, config, spec, namespace, shaped: bool,
             data_flags, machine: dict, out_dir: str):
    """One training run of one row (in ``namespace`` when shaped), its log parsed and its meters read."""
    from .activation_meter import memory_per_rank, peak_per_rank
    from .affinity import stage_cores
    from .logparse import parse_log
    from .runner import RunResult, error_excerpt, launch_command, run_env, threads_per_rank, training_args

    threads, _ = threads_per_rank(config.world, machine["cores"])
    run_dir = os.path.join(out_dir, "runs")
    train = training_args(model, config, spec, data_flags, run_dir)
    prefix = namespace.prefix() if namespace else []
    cmd = launch_command(config.world, train, prefix,
                         rank_namespaces=namespace.rank_namespaces if namespace else None,
                         master_port=29500 + index % 1000)  # a fresh port per run: no wait on TIME_WAIT
    name = f"{config.name}-{spec.name}-{'shaped' if shaped else 'unshaped'}-r{repeat}"
    cores = stage_cores(config.pp, config.dp, machine["cores"]) if args.pin_cores else None
    code, wall, rss, text = _run_one(cmd, run_env(threads, cores=cores),
                                     os.path.join(out_dir, "logs", name + ".log"), args.timeout)
    parsed = parse_log(text)
    error = "" if code == 0 else f"exit {code}: {error_excerpt(text, 4)}"
    result = RunResult(config=config.name, schedule=spec.name, shaped=shaped, repeat=repeat, returncode=code,
                       wall_s=wall, log_path=os.path.join(out_dir, "logs", name + ".log"), parsed=parsed,
                       peak_rss_mb=rss, error=error, activation_peak_bytes=peak_per_rank(text, config.world),
                       **dict(zip(("model_state_bytes", "peak_memory_bytes"), memory_per_rank(text, config.world))))
    measured = parsed.measured(model.warmup_iters)
    ms = sorted(it.elapsed_ms for it in measured)
    med = ms[len(ms) // 2] if ms else float("nan")
    log(f"[{index}/{total}] {name}: " + (f"{med:.0f} ms/iteration, {wall:.0f} s" if code == 0
                                        else f"FAILED ({error.splitlines()[0] if error else code})"))
    return result


def summary_document(args, setup: dict, results: list, specs: dict, budgets: dict, machine: dict, out_dir: str,
                      wall_s: float):
    """(the summary.json document, the summary per layout): the runs summarized against their predictions, written
    to ``out_dir``/summary.json."""
    from .memory_fair import DISTRIBUTED_OPTIMIZER_FLAGS, STOCK_SHARDING_NOTE
    from .report import summarize
    from .runner import threads_per_rank

    configs, model, shaping, repeats = setup["configs"], setup["model"], setup["shaping"], setup["repeats"]
    summary = summarize(results, model, configs, specs, budgets,
                        shaping.payload_bytes_per_s if shaping else None, (shaping.delay_ms / 1e3) if shaping else 0.0,
                        args.link_share, setup["sharding"], setup["auto"].per_rank_network)
    for entry in summary:
        threads, over = threads_per_rank(entry["world"], machine["cores"])
        entry.update({"threads_per_rank": threads, "oversubscribed": over, "cores": machine["cores"],
                      "pinned": bool(args.pin_cores)})
    document = {
        "machine": machine, "network": {"shaped": bool(shaping), "rate_mbit": shaping.rate_mbit if shaping else None,
                                        "delay_ms": shaping.delay_ms if shaping else 0.0,
                                        "topology": (("per-rank" if shaping.per_rank else "shared") if shaping
                                                     else None),
                                        "nic_queue": shaping.nic_queue if shaping else None,
                                        "burst_bytes": shaping.burst_bytes if shaping else None},
        "model": {**model.to_dict(), "tokens_per_iteration": {c.name: model.tokens_per_iteration(c.dp) for c in configs}},
        "sharding": ({"stock": STOCK_SHARDING_NOTE, "flags": list(DISTRIBUTED_OPTIMIZER_FLAGS)}
                     if setup["sharding"] else None),
        "repeats": repeats, "wall_s": wall_s, "out_dir": out_dir, "configs": summary,
        "rows": [compact_row(entry, row) for entry in summary for row in entry["schedules"]],
    }
    with open(os.path.join(out_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(document, f, indent=1)
    return document, summary


def print_results(args, setup: dict, document: dict, summary: list, machine: dict, out_dir: str) -> None:
    """The chart, the JSON and the table, as the flags ask."""
    from .report import format_table, plot_summary

    model, shaping, repeats = setup["model"], setup["shaping"], setup["repeats"]
    shaping_desc = shaping.describe() if shaping else "none (--unshaped)"
    if args.plot:
        plot_summary(summary, args.plot, shaping_desc)
    if not emit_json(document, args.json):
        print(f"machine: {machine['cores']} cores, {machine['memory_gb']} GiB, {machine['backend']}, torch {machine['torch']}; "
              f"model: hidden {model.chunk.hidden_size}, seq {model.chunk.seq_length}, micro-batch "
              f"{model.chunk.micro_batch_size}, m {model.microbatches}, V {model.vpp}, {model.chunk.num_layers} layer(s) "
              "per chunk; "
              f"{model.warmup_iters} warm-up + {model.measured_iters} measured iterations, {repeats} repeat(s); "
              f"wall {document['wall_s']:.0f} s")
        print(format_table(summary, shaping_desc))
        if args.plot:
            print(f"wrote chart: {args.plot}")
        print(f"logs and summary.json: {out_dir}")


COMPACT_KEYS = ("name", "default", "fits", "peak_activation_bytes", "predicted_peak_activation_bytes", "tokens_per_s",
                "tokens_per_s_spread", "tokens_per_s_runs", "stock_flags", "setting", "groups",
                "recomputed_chunk_microbatches")
SHARDING_KEYS = ("sharding", "model_state_bytes", "peak_memory_bytes", "predicted_model_state_bytes",
                 "predicted_peak_memory_bytes")
"""Row keys added with ``--sharding``: levels per chunk, measured model state and peak of state + activations
per rank, and their predictions."""


def compact_row(entry: dict, row: dict) -> dict:
    """One schedule row of the JSON's flat ``rows`` list: the keys above (``default``: a row of Megatron's default
    command), its configuration and budget, and for PipeMesh rows ``ratio_to_best_stock`` and
    ``ratio_to_best_default`` (to the configuration's fastest stock row, and fastest default row, that fits); with
    ``--sharding`` also :data:`SHARDING_KEYS` and the memory budget."""
    out = {"config": entry["config"], "activation_budget_bytes": entry.get("activation_budget_bytes"),
           **{k: row.get(k) for k in COMPACT_KEYS}}
    if entry.get("sharding"):
        out.update({"memory_budget_bytes": entry.get("memory_budget_bytes"), **{k: row.get(k) for k in SHARDING_KEYS}})
    if not row["stock"]:
        for key in ("best_stock", "best_default"):
            out[f"ratio_to_{key}"] = row.get(f"ratio_to_{key}")
            out[key] = entry.get(key)
    return out


def _run_one(cmd, env, log_path, timeout):
    from .runner import run_once

    return run_once(cmd, env, log_path, timeout)
