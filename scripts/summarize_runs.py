#!/usr/bin/env python3
"""Compare Megatron training runs from their logs: one table of iteration time and throughput.

Used by ``scripts/slurm/bench_schedules.sbatch``; standard library only (with this checkout's
``megatron_pipemesh/bench/logparse.py``, the project's one Megatron log parser), so any Python 3.8+ runs it::

    python scripts/summarize_runs.py --warmup 5 1f1b=runs/bench/1f1b depth-first=runs/bench/depth-first \\
        breadth-first=runs/bench/breadth-first pipemesh=runs/bench/pipemesh

Each ``NAME=PATH`` is a log file or a directory searched recursively (torchrun ``--log-dir`` trees,
srun output files).  From Megatron's iteration lines (printed by the last pipeline stage)::

    iteration  12/  30 | ... | elapsed time per iteration (ms): 1234.5 | ... | global batch size:  512 | lm loss: 2.1E+00 | ...

it takes the median of "elapsed time per iteration (ms)" over iterations after ``--warmup`` and
``tokens/s = global batch size * seq length / iteration time``.  The global batch size comes from the
iteration line, the sequence length from Megatron's argument dump (``seq_length ..... 2048``, printed by
rank 0, often to another file of the same run) unless given with ``--seq-length``.  When several files of
a run hold iteration lines (the console copy and torchrun's per-rank file), the one with the most is used.

A run is compared with the best (highest tokens/s) *stock* run: every run whose name does not start with
``pipemesh`` unless ``--stock`` names them.  Runs without iteration lines after the warm-up are listed as
failed.  Exit status: 0 when every run has measurements, 1 when some failed, 2 on bad usage.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

# The log parser is this checkout's (standard library only too): the same code as `pipemesh bench`, and
# no installed package is needed (nor used, if an older one happens to be installed).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_pipemesh.bench import logparse  # noqa: E402

__all__ = ["Iteration", "RunLog", "RunSummary", "parse_lines", "read_run", "summarize", "format_table",
           "main"]

ARGUMENTS = ("seq_length", "global_batch_size")
"""The values taken from Megatron's argument dump."""


@dataclass
class Iteration:
    """One Megatron iteration line."""

    iteration: int
    ms: float
    loss: Optional[float] = None
    global_batch_size: Optional[int] = None


@dataclass
class RunLog:
    """What one run's logs hold."""

    name: str
    path: str
    iterations: List[Iteration] = field(default_factory=list)
    seq_length: Optional[int] = None
    global_batch_size: Optional[int] = None
    source: Optional[str] = None  # the file the iterations came from


@dataclass
class RunSummary:
    """One row of the comparison table."""

    name: str
    status: str  # "ok" or "failed: <why>"
    measured: int = 0
    median_ms: Optional[float] = None
    tokens_per_s: Optional[float] = None
    ratio_to_best_stock: Optional[float] = None
    final_loss: Optional[float] = None
    global_batch_size: Optional[int] = None
    seq_length: Optional[int] = None
    stock: bool = False
    source: Optional[str] = None


def parse_lines(lines: Iterable[str]) -> Tuple[List[Iteration], Dict[str, int]]:
    """Iteration records (last one wins for a repeated iteration number) and the :data:`ARGUMENTS` seen."""
    records: Dict[int, Iteration] = {}
    args: Dict[str, int] = {}
    for line in lines:
        found = logparse.parse_iteration_line(line)
        if found is not None:
            records[found.iteration] = Iteration(found.iteration, found.elapsed_ms, found.loss,
                                                 found.global_batch_size)
            continue
        argument = logparse.parse_argument_line(line)
        if argument and argument[0] in ARGUMENTS and argument[0] not in args:
            args[argument[0]] = argument[1]
    return [records[k] for k in sorted(records)], args


def _files(path: str) -> List[str]:
    if os.path.isfile(path):
        return [path]
    out = []
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            out.append(os.path.join(root, name))
    return out


def read_run(name: str, path: str) -> RunLog:
    """Parse every file under ``path``; iterations from the file with the most iteration lines."""
    run = RunLog(name, path)
    if not os.path.exists(path):
        return run
    best: List[Iteration] = []
    for file in _files(path):
        try:
            with open(file, "r", encoding="utf-8", errors="replace") as fh:
                iterations, args = parse_lines(fh)
        except OSError:
            continue
        if len(iterations) > len(best):
            best, run.source = iterations, file
        if run.seq_length is None and "seq_length" in args:
            run.seq_length = args["seq_length"]
        if run.global_batch_size is None and "global_batch_size" in args:
            run.global_batch_size = args["global_batch_size"]
    run.iterations = best
    return run


def summarize(runs: Sequence[RunLog], warmup: int = 2, stock: Optional[Sequence[str]] = None,
              seq_length: Optional[int] = None, global_batch_size: Optional[int] = None) -> List[RunSummary]:
    """One summary per run; ratios against the best stock run that has measurements."""
    stock_names = set(stock) if stock is not None else {r.name for r in runs if not r.name.startswith("pipemesh")}
    out: List[RunSummary] = []
    for run in runs:
        s = RunSummary(run.name, "ok", stock=run.name in stock_names, source=run.source)
        if run.iterations:
            s.final_loss = run.iterations[-1].loss
        measured = [it for it in run.iterations if it.iteration > warmup and math.isfinite(it.ms)]
        if not os.path.exists(run.path):
            s.status = f"failed: {run.path} does not exist"
        elif not run.iterations:
            s.status = "failed: no iteration lines in its logs"
        elif not measured:
            s.status = (f"failed: only iterations <= {run.iterations[-1].iteration} logged, all within the "
                        f"warm-up (--warmup {warmup})")
        if not measured:
            out.append(s)
            continue
        s.measured = len(measured)
        s.median_ms = statistics.median(it.ms for it in measured)
        s.global_batch_size = (global_batch_size or measured[-1].global_batch_size or run.global_batch_size)
        s.seq_length = seq_length or run.seq_length
        if s.global_batch_size and s.seq_length and s.median_ms > 0:
            s.tokens_per_s = s.global_batch_size * s.seq_length / (s.median_ms / 1000.0)
        out.append(s)
    best = max((s.tokens_per_s for s in out if s.stock and s.tokens_per_s), default=None)
    best_ms = min((s.median_ms for s in out if s.stock and s.median_ms), default=None)
    for s in out:
        if best and s.tokens_per_s:
            s.ratio_to_best_stock = s.tokens_per_s / best
        elif best_ms and s.median_ms and not any(x.tokens_per_s for x in out):
            # no throughput anywhere (sequence length unknown): compare iteration times
            s.ratio_to_best_stock = best_ms / s.median_ms
    return out


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def format_table(summaries: Sequence[RunSummary], warmup: int) -> str:
    """A Markdown table with a short header."""
    lines = [
        f"Median over iterations > {warmup}; tokens/s = global batch x seq length / iteration time; "
        "'vs best stock' = tokens/s over the best stock schedule's.",
        "",
        "| run | iterations measured | median ms/iter | tokens/s | vs best stock | final lm loss | status |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        name = s.name + (" (stock)" if s.stock else "")
        ratio = "-" if s.ratio_to_best_stock is None else f"{s.ratio_to_best_stock:.3f}x"
        lines.append(f"| {name} | {s.measured} | {_fmt(s.median_ms, '.1f')} | {_fmt(s.tokens_per_s, ',.0f')} | "
                     f"{ratio} | {_fmt(s.final_loss, '.4f')} | {s.status} |")
    return "\n".join(lines) + "\n"


def _run_arg(text: str) -> Tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (e.g. pipemesh=runs/bench/pipemesh), got {text!r}")
    return name, path


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="summarize_runs.py",
        description="Compare Megatron runs from their iteration logs (median iteration time, tokens/s, ratio "
                    "to the best stock schedule).")
    parser.add_argument("runs", nargs="+", type=_run_arg, metavar="NAME=PATH",
                        help="a run: its name and a log file or directory (searched recursively)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="ignore iterations 1..N (start-up, allocator warm-up); default 2")
    parser.add_argument("--stock", nargs="+", metavar="NAME", default=None,
                        help="the baseline runs; default: every run whose name does not start with 'pipemesh'")
    parser.add_argument("--seq-length", type=int, default=None,
                        help="sequence length (default: from Megatron's argument dump in the logs)")
    parser.add_argument("--global-batch-size", type=int, default=None,
                        help="global batch size (default: from the iteration lines)")
    parser.add_argument("--output", metavar="FILE", help="also write the table (Markdown) to FILE")
    parser.add_argument("--json", metavar="FILE", help="also write the numbers as JSON to FILE")
    args = parser.parse_args(argv)
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    names = [n for n, _ in args.runs]
    if len(set(names)) != len(names):
        parser.error(f"run names must be unique, got {names}")
    if args.stock is not None and not set(args.stock) <= set(names):
        parser.error(f"--stock {' '.join(args.stock)}: not among the runs {names}")
    runs = [read_run(n, p) for n, p in args.runs]
    summaries = summarize(runs, args.warmup, args.stock, args.seq_length, args.global_batch_size)
    table = format_table(summaries, args.warmup)
    sys.stdout.write(table)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(table)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"warmup": args.warmup, "runs": [asdict(s) for s in summaries]}, fh, indent=1)
            fh.write("\n")
    return 0 if all(s.status == "ok" for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
