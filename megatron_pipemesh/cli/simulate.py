"""``pipemesh simulate``: the given schedule next to depth-first and breadth-first on the costs of the flags, optionally
fitted to a memory budget, with a trace or a picture."""
from __future__ import annotations

import argparse
import json
from typing import List, Sequence

from ..planning.costs import GB
from ..planning.simulator import simulate
from ..schedule.config import ScheduleConfig
from ..schedule.lower import lower
from ..schedule.validate import validate
from .arguments import (budget_bytes, config_from_args, costs_from_args, host_link_gbps, placement_lines,
                        planner_options_from_args, print_splits, sharding_from_args)
from .common import require_matplotlib


def _comparison(config: ScheduleConfig, costs_for, fit=None, sharding=None) -> List[tuple]:
    """(name, config, simulation) of the given schedule, depth-first and breadth-first; with ``fit``
    (config, costs -> Plan) each is first fitted to the memory budget and the simulation is its plan's."""
    rows = [("given", config)]
    rows.append(("depth-first", ScheduleConfig.depth_first(config.pp, config.vpp, config.microbatches)))
    rows.append(("breadth-first", ScheduleConfig.breadth_first(config.pp, config.vpp, config.microbatches)))
    if fit is None:
        return [(name, cfg, simulate(cfg, costs_for(cfg), sharding=sharding)) for name, cfg in rows]
    return [(name, cfg, fit(cfg, costs_for(cfg))) for name, cfg in rows]


def _format_table(rows: Sequence[tuple]) -> str:
    header = f"{'schedule':<14} {'groups (fwd / bwd)':<24} {'iter ms':>9} {'idle %':>7} {'exp.comm ms':>11} {'bubble ms':>9}  peak memory GiB per rank"
    lines = [header, "-" * len(header)]
    for name, cfg, result in rows:
        groups = f"{' '.join(map(str, cfg.forward_groups))} / {' '.join(map(str, cfg.backward_groups))}"
        bubble = sum(r.bubble_s for r in result.ranks) / len(result.ranks)
        peaks = " ".join(f"{r.peak_memory_bytes / GB:.2f}" for r in result.ranks)
        lines.append(f"{name:<14} {groups:<24} {result.iteration_s * 1e3:>9.2f} {100 * result.idle_fraction:>7.1f} "
                     f"{result.exposed_comm_s * 1e3:>11.2f} {bubble * 1e3:>9.2f}  {peaks}")
    return "\n".join(lines)


def cmd_simulate(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    validate(lower(config))
    if args.plot:
        require_matplotlib("--plot")
    sharding = None
    given = sharding_from_args(args, allow_auto=False)
    if given is not None:
        from ..planning.sharding import ShardingModel, ShardingSpec
        levels, model, cluster = given
        sharding = ShardingModel(model, cluster, ShardingSpec(levels, args.shard_scope))
    plans = None
    if args.memory_budget_gb is not None:
        from ..planning.planner import fit_with_recompute
        budget, options = budget_bytes(args), planner_options_from_args(args)
        plans = _comparison(config, lambda cfg: costs_from_args(args, cfg),
                            lambda cfg, costs: fit_with_recompute(cfg, costs, budget, options, sharding))
        rows = [(name, cfg, plan.result) for name, cfg, plan in plans]
    else:
        rows = _comparison(config, lambda cfg: costs_from_args(args, cfg), sharding=sharding)
    if args.trace:
        from ..planning.trace import write_trace
        write_trace(rows[0][2], args.trace)
    if args.plot:
        from ..planning.plot import plot_timelines
        plot_timelines([r for _, _, r in rows], args.plot, [name for name, _, _ in rows])
    if args.json:
        out = {name: result.to_dict() for name, _, result in rows}
        for name, _, plan in plans or ():
            out[name]["plan"] = plan.to_dict()
        print(json.dumps(out, indent=1))
    else:
        print(_format_table(rows))
        if sharding is not None:
            print_splits(sharding, config, rows[0][2])
        if plans:
            print(f"\nfitted to {args.memory_budget_gb:g} GiB per device with --activation-placement {args.activation_placement}"
                  f" (host link {host_link_gbps(args):g} Gbit/s):")
            print("\n".join(placement_lines([(name, plan) for name, _, plan in plans])))
        for path, what in ((args.trace, "trace"), (args.plot, "timeline picture")):
            if path:
                print(f"wrote {what}: {path}")
    return 0
