"""The demo's closing summary: PipeMesh next to the stock schedule on the same data, then the advice.

    python -m megatron_pipemesh.bench.demo_summary --pipemesh runs/demo/pipemesh.log \\
        --stock runs/demo/stock.log [--picture runs/demo/schedule.txt] [--trace runs/demo/trace.json] \\
        [--advice runs/demo/advice.json]

Reads both training logs (Megatron's iteration lines through the project's one log parser, and
PipeMesh's own per-interval lines) and prints: whether the losses are equal iteration by iteration,
the mean iteration time after the first logged interval, and the measured peak activation memory
per rank; with ``--advice`` (a ``pipemesh bench --advice --json`` document of the demo's command) what the advice
said and how its row ran against the command. Exit status 1 when the losses differ (the demo then fails loudly).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Dict, List, Optional, Sequence

from ..integration.report import parse_interval_line
from .logparse import parse_log


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as handle:
        return handle.read()


def run_figures(text: str) -> Dict[str, object]:
    """Losses per iteration, mean iteration time (first logged interval excluded), last peak per rank."""
    parsed = parse_log(text)
    losses = {it.iteration: it.loss for it in parsed.iterations if it.loss is not None}
    timed = [it.elapsed_ms for it in parsed.iterations[1:]] or [it.elapsed_ms for it in parsed.iterations]
    peaks: Optional[List[float]] = None
    plan = None
    for line in text.splitlines():
        figures = parse_interval_line(line)
        if figures and figures.get("peak activation"):
            peaks = figures["peak activation"]  # type: ignore[assignment]
        if line.startswith("PipeMesh plan:"):
            plan = line
    return {"losses": losses, "iteration_ms": sum(timed) / len(timed) if timed else math.nan, "peaks": peaks,
            "plan": plan}


def summary(pipemesh: Dict[str, object], stock: Dict[str, object], picture: Optional[str] = None,
            trace: Optional[str] = None) -> List[str]:
    p_losses, s_losses = pipemesh["losses"], stock["losses"]
    common = sorted(set(p_losses) & set(s_losses))  # type: ignore[arg-type]
    differ = [i for i in common if p_losses[i] != s_losses[i]]  # type: ignore[index]
    lines = ["", "PipeMesh demo summary (same model, data and seed; stock = --pipeline-schedule default)"]
    if not common:
        lines.append("  losses: no common logged iterations (did a run fail? see its log)")
    elif differ:
        i = differ[0]
        lines.append(f"  losses: DIFFER at {len(differ)} of {len(common)} logged iterations, first at iteration {i}: "
                     f"PipeMesh {p_losses[i]} vs stock {s_losses[i]}")  # type: ignore[index]
    else:
        last = common[-1]
        lines.append(f"  losses: equal at all {len(common)} logged iterations (iteration {last}: lm loss "
                     f"{p_losses[last]:.6E})")  # type: ignore[index]
    p_ms, s_ms = pipemesh["iteration_ms"], stock["iteration_ms"]
    lines.append(f"  iteration time (ms, mean after the first interval): PipeMesh {p_ms:.1f}, stock {s_ms:.1f} "
                 f"(PipeMesh / stock = {p_ms / s_ms:.2f}; 2 CPU cores, so only a smoke test of speed)")
    for name, run in (("PipeMesh", pipemesh), ("stock", stock)):
        peaks = run["peaks"]
        shown = " ".join(f"{p:.2f}" for p in peaks) if peaks else "not measured"  # type: ignore[union-attr]
        lines.append(f"  peak activation memory per rank (MiB, measured): {name:<8} {shown}")
    if picture:
        lines.append(f"  schedule picture: {picture}")
    if trace:
        lines.append(f"  simulated timeline trace (chrome://tracing or Perfetto): {trace}")
    return lines


def advice_summary(document: dict) -> List[str]:
    """What the advice said for the demo's command on this machine and how it ran (a ``pipemesh bench --advice
    --json`` document): the advised row, its predicted and measured speed over the command, or that it kept the
    command because the best row's gain was inside the advice's error."""
    advice, rows = document["advice"], {row["name"]: row for row in document["rows"]}
    user = rows.get("user", {})
    run = document["advised"]
    lines = ["", "The advice for this command on this machine (pipemesh bench --advice: profiled here, planned, run)"]
    if run is None:
        return lines + ["  no row fits the memory"]
    lines.append(f"  {advice.get('run_reason', '')}")
    if run == "user":
        lines.append(f"  your command: predicted {user['predicted_iteration_s']:.3f} s per iteration, measured "
                     f"{_seconds(user.get('measured_iteration_s'))}")
        return lines
    row = rows[run]
    measured = document.get("advised_measured_ratio_to_user")
    lines += [f"  run {run}: {row['describe']}",
              f"  predicted {row['predicted_iteration_s']:.3f} s against your command's {user['predicted_iteration_s']:.3f}"
              f" s: {document['advised_predicted_ratio_to_user']:.2f}x; measured {_seconds(row['measured_iteration_s'])}"
              f" against {_seconds(user.get('measured_iteration_s'))}: "
              + (f"{measured:.2f}x" if measured else "not measured"),
              f"  its command: {row['command']}"]
    return lines


def _seconds(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f} s"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_pipemesh.bench.demo_summary", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipemesh", required=True, help="log of the PipeMesh run")
    parser.add_argument("--stock", required=True, help="log of the stock-schedule run")
    parser.add_argument("--picture", help="where the schedule picture was written")
    parser.add_argument("--trace", help="where the simulated trace was written")
    parser.add_argument("--advice", help="pipemesh bench --advice --json document of the demo's command")
    args = parser.parse_args(argv)
    pipemesh, stock = run_figures(_read(args.pipemesh)), run_figures(_read(args.stock))
    print("\n".join(summary(pipemesh, stock, args.picture, args.trace)))
    if args.advice:
        with open(args.advice, encoding="utf-8") as handle:
            print("\n".join(advice_summary(json.load(handle))))
    common = set(pipemesh["losses"]) & set(stock["losses"])  # type: ignore[arg-type]
    equal = bool(common) and all(pipemesh["losses"][i] == stock["losses"][i] for i in common)  # type: ignore[index]
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
