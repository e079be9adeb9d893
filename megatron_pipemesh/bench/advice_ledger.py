"""The advice's accuracy over many commands: ``pipemesh bench --advice`` documents (``--json``) summed into one ledger.

    python -m megatron_pipemesh.bench.advice_ledger runs/ledger/*.json [--json ledger.json] [--write-errors FILE]

Per command: the advised row's measured speed over the user's command, every row's total and part verdicts
(:func:`.advice_parts.judgement`), the rank correlation of predicted and measured row order (Spearman's, the rows
measured once each), and whether the advised row was the fastest measured or within :data:`FASTEST_WITHIN` of it.
Over all commands: the share of rows within 10% in total and in parts, the median rank correlation, the share of
commands whose advice was the fastest, and the worst error per kind of row, of its time and of its speed over the
command measured beside it (:mod:`..planning.advice_error`), which ``--write-errors`` stores as the advice's error
table.

Pure: standard library only.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Dict, List, Optional, Sequence

from .advice_parts import MISS_TOLERANCE
from ..planning.advice_error import error_file, gain_errors, worst_errors
from ..planning.profile_quality import spread_of

FASTEST_WITHIN = 0.03
"""The advised row counts as the fastest measured when within this fraction of the fastest row's time."""


def spearman(xs: Sequence[float], ys: Sequence[float]) -> Optional[float]:
    """Spearman's rank correlation of two equal-length sequences (ties ranked by their mean rank); None below 3
    values or where one side has a single rank."""
    if len(xs) != len(ys) or len(xs) < 3:
        return None

    def ranks(values: Sequence[float]) -> List[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    if sx == 0 or sy == 0:
        return None
    return sum((a - mx) * (b - my) for a, b in zip(rx, ry)) / (sx * sy)


def command_entry(name: str, document: dict) -> dict:
    """One command's line of the ledger from its ``bench --advice`` document."""
    rows = [r for r in document["rows"] if r["same_run_as"] is None and r["measured_iteration_s"] is not None]
    advised = document["advised"]
    measured = {r["name"]: r["measured_iteration_s"] for r in rows}
    fastest = min(measured.values()) if measured else None
    advised_s = next((r["measured_iteration_s"] for r in document["rows"] if r["name"] == advised), None)
    return {
        "name": name, "command": document["command"], "advised": advised,
        "run_reason": document["advice"].get("run_reason"), "kept_command": document["advice"].get("kept_command"),
        "advised_measured_ratio_to_user": document["advised_measured_ratio_to_user"],
        "advised_predicted_ratio_to_user": document["advised_predicted_ratio_to_user"],
        "advised_fastest": (advised_s is not None and fastest is not None
                            and advised_s <= fastest * (1 + FASTEST_WITHIN)),
        "rank_correlation": spearman([r["predicted_iteration_s"] for r in rows], [measured[r["name"]] for r in rows]),
        "rows": [{"name": r["name"], "kind": r.get("kind"), "describe": r["describe"],
                  "predicted_s": r["predicted_iteration_s"], "measured_s": r["measured_iteration_s"],
                  "measured_over_predicted": r["measured_over_predicted"], "judgement": r.get("judgement"),
                  "part_misses": r.get("part_misses"), "measured_spread": measured_spread(r),
                  "machine_drift": r.get("machine_drift")} for r in rows],
        "ranks_share_cores": document["ranks_share_cores"],
    }


def measured_spread(row: dict) -> Optional[float]:
    """The relative half-width of the ~95% interval of a row's measured median iteration time, from its measured
    iterations (every round's; below 6 iterations their whole range): how far the measurement itself may be off."""
    times = row.get("measured_iterations_s") or []
    return spread_of(times, True).relative_half_width if times else None


def _inside_spread(row: dict) -> bool:
    """A row outside 10% in total whose distance beyond 10% is inside its measurement's spread."""
    ratio, spread = row["measured_over_predicted"], row["measured_spread"]
    return (row["judgement"] == "miss" and ratio is not None and spread is not None
            and abs(ratio - 1.0) <= MISS_TOLERANCE + spread)


def ledger(documents: Dict[str, dict]) -> dict:
    """The ledger of ``documents`` (name -> ``bench --advice`` document) with its totals."""
    commands = [command_entry(name, doc) for name, doc in documents.items()]
    rows = [row for c in commands for row in c["rows"]]
    total_ok = [row for row in rows if row["judgement"] in ("within 10%", "within 10% only by cancelling errors")]
    parts_ok = [row for row in rows if row["judgement"] == "within 10%"]
    correlations = [c["rank_correlation"] for c in commands if c["rank_correlation"] is not None]
    ratios = [c["advised_measured_ratio_to_user"] for c in commands if c["advised_measured_ratio_to_user"]]
    return {
        "commands": commands,
        "rows": len(rows),
        "rows_within_10pct_total": len(total_ok) / len(rows) if rows else None,
        "rows_within_10pct_total_and_parts": len(parts_ok) / len(rows) if rows else None,
        "misses": len(rows) - len(total_ok),
        "misses_inside_measurement_spread": sum(map(_inside_spread, rows)),
        "median_measured_spread": statistics.median(spreads) if (spreads := [
            row["measured_spread"] for row in rows if row["measured_spread"] is not None]) else None,
        "advised_fastest_share": (sum(c["advised_fastest"] for c in commands) / len(commands)) if commands else None,
        "median_rank_correlation": statistics.median(correlations) if correlations else None,
        "machine_drifts": [row["machine_drift"] for row in rows if row.get("machine_drift") is not None],
        "least_advised_ratio_to_user": min(ratios) if ratios else None,
        "errors_by_kind": worst_errors([(row["kind"], row["measured_over_predicted"]) for row in rows
                                        if row["kind"] and row["measured_over_predicted"]]),
        "gain_errors_by_kind": gain_errors([(row["kind"], row["measured_over_predicted"], user)
                                            for c in commands if (user := _user_ratio(c)) for row in c["rows"]
                                            if row["kind"] and row["measured_over_predicted"]]),
    }


def machine_line(drifts: Sequence[float]) -> str:
    """How fast the machine itself ran at the rows' runs against at their profiles, as a ledger line."""
    if not drifts:
        return "the machine's own speed was not timed (documents from before)"
    return (f"the machine itself, at the rows' runs against at their profiles (a fixed matmul on every core): "
            f"{100 * min(drifts):+.0f}% to {100 * max(drifts):+.0f}%, median {100 * statistics.median(drifts):+.0f}% "
            "(+: slower; nothing is scaled by it)")


def _user_ratio(command: dict) -> Optional[float]:
    return next((r["measured_over_predicted"] for r in command["rows"] if r["name"] == "user"), None)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(found: dict) -> str:
    """The ledger as a Markdown table and its totals."""
    lines = ["| command | advised (why) | measured x user (predicted) | advised fastest (3%) | rank corr. | rows: "
             "measured / predicted, verdict |", "|---|---|---|---|---|---|"]
    for c in found["commands"]:
        rows = "; ".join(f"{r['name']} {_fmt(r['measured_over_predicted'], '.2f')} {r['judgement']}"
                         for r in c["rows"])
        lines.append(f"| {c['name']} | {c['advised']} ({c['run_reason']}) | "
                     f"{_fmt(c['advised_measured_ratio_to_user'], '.2f')} "
                     f"({_fmt(c['advised_predicted_ratio_to_user'], '.2f')}) | {'yes' if c['advised_fastest'] else 'no'}"
                     f" | {_fmt(c['rank_correlation'], '.2f')} | {rows} |")
    pct = lambda x: "-" if x is None else f"{100 * x:.0f}%"  # noqa: E731
    lines += ["", f"{found['rows']} rows: {pct(found['rows_within_10pct_total'])} within 10% in total, "
              f"{pct(found['rows_within_10pct_total_and_parts'])} in total and parts; advised row the fastest (or "
              f"within 3%) in {pct(found['advised_fastest_share'])} of the commands; median rank correlation "
              f"{_fmt(found['median_rank_correlation'], '.2f')}; the advised row at least "
              f"{_fmt(found['least_advised_ratio_to_user'], '.2f')}x the user's command",
              f"{found['misses']} rows outside 10% in total, {found['misses_inside_measurement_spread']} of them by "
              f"less than their measurement's own spread (median spread of a row's measured median: "
              f"±{_fmt(found['median_measured_spread'] and 100 * found['median_measured_spread'], '.1f')}%)",
              machine_line(found.get("machine_drifts") or []),
              "worst error per kind of row: " + ", ".join(f"{k} ±{100 * v:.0f}%"
                                                          for k, v in found["errors_by_kind"].items()),
              "worst error of a row's speed over the command, per kind: "
              + ", ".join(f"{k} ±{100 * v:.0f}%" for k, v in found["gain_errors_by_kind"].items())]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_pipemesh.bench.advice_ledger", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("documents", nargs="+", metavar="ADVICE.json", help="pipemesh bench --advice --json files")
    parser.add_argument("--json", metavar="FILE", help="write the ledger here")
    parser.add_argument("--write-errors", metavar="FILE", help="write the worst error per kind of row here (the "
                        "advice's error table, megatron_pipemesh/planning/advice_error.json)")
    parser.add_argument("--source", default="", help="where and when the ledger was measured (stored with the errors)")
    args = parser.parse_args(argv)
    documents = {}
    for path in args.documents:
        try:
            with open(path, encoding="utf-8") as handle:
                documents[path.rsplit("/", 1)[-1].removesuffix(".json")] = json.load(handle)
        except (OSError, ValueError) as error:
            parser.error(f"{path}: not a pipemesh bench --advice --json document ({error})")
    found = ledger(documents)
    print(table(found))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(found, handle, indent=1)
    if args.write_errors:
        with open(args.write_errors, "w", encoding="utf-8") as handle:
            handle.write(error_file(found["errors_by_kind"], args.source, found["gain_errors_by_kind"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
