"""``pipemesh plan`` (without ``--megatron-args``): the fastest groups, recomputation and host placement that fit the
memory budget, next to depth-first and breadth-first; ``--output`` saves the plan for ``--pipemesh-plan``."""
from __future__ import annotations

import argparse
import json

from ..planning.costs import GB
from ..schedule.levers import FULL, SELECTIVE
from ..planning.resolve import resolve
from .arguments import placement_lines, plan_request, print_splits
from .common import UsageError


def cmd_plan(args: argparse.Namespace) -> int:
    from ..planning.planner import NoFeasiblePlan, baseline_plans

    request = plan_request(args)
    try:
        resolution = resolve(request)
    except NoFeasiblePlan as error:
        raise UsageError(str(error)) from error
    best, evaluated, budget, options = resolution.chosen, resolution.candidates, request.budget_bytes, request.planner
    baselines = baseline_plans(args.pp, args.vpp, args.microbatches, request.costs_for, budget, options,
                               sharding=best.sharding)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write(resolution.plan.to_json())
    if args.json:
        print(json.dumps({**best.to_dict(), "candidates_evaluated": evaluated,
                          "baselines": {name: plan.to_dict() for name, plan in baselines.items()}}, indent=1))
        return 0
    what = "sharding level mixes (each with its best groups)" if request.prices_sharding else "candidate group lists"
    print(f"memory budget {budget / GB:.2f} GiB per device; {evaluated} {what} simulated")
    header = (f"{'schedule':<14} {'groups (fwd / bwd)':<22} {'iter ms':>9} {'idle %':>7} {'exp.comm ms':>11} "
              f"{'recompute':>18} {'fits':>5}  peak memory GiB per rank")
    print(header)
    print("-" * len(header))
    for name, plan in [("pipemesh", best)] + list(baselines.items()):
        d = plan.to_dict()
        groups = f"{' '.join(map(str, d['forward_groups']))} / {' '.join(map(str, d['backward_groups']))}"
        counts = d["recompute_counts"]
        recompute = f"{counts[SELECTIVE]} sel, {counts[FULL]} full"
        exposed = sum(d["exposed_comm_s"]) / len(d["exposed_comm_s"])
        print(f"{name:<14} {groups:<22} {d['predicted_iteration_time_s'] * 1e3:>9.2f} {100 * d['idle_fraction']:>7.1f} "
              f"{exposed * 1e3:>11.2f} "
              f"{recompute:>18} {'yes' if d['fits'] else 'NO':>5}  {' '.join(f'{x:.2f}' for x in d['peak_memory_gb'])}")
    print()
    print("\n".join(placement_lines([("pipemesh", best)] + list(baselines.items()))))
    print(f"\nuse: --pipeline-schedule pipemesh {best.config.group_flags()}"
          + (f" --pipemesh-plan {args.output}" if args.output else ""))
    print(f"recompute: {100 * best.recompute_share:.2f}% of the iteration")
    if best.sharding is not None:
        print(f"sharding: --pipemesh-sharding {' '.join(best.sharding.spec.levels)} --pipemesh-shard-scope {args.shard_scope}")
        print_splits(best.sharding, best.config, best.result)
    return 0
