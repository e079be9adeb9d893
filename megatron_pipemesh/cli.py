"""The ``pipemesh`` command: schedule work that needs no GPU.

    pipemesh show --pp 4 --vpp 2 --microbatches 12 --forward-groups 8 4 --backward-groups 6 6 [--json] [--lowered]
    pipemesh simulate --pp 4 --vpp 2 --microbatches 12 --forward-groups 8 4 --backward-groups 6 6 \
        [model/cluster or cost flags] [--json] [--trace FILE] [--plot FILE.png]

Invalid input exits with code 2 and a one-paragraph message.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional, Sequence, Tuple

from .cli_common import UsageError, check_number, positive_int, require_matplotlib, run_command
from .config import add_cli_arguments
from .planning.layout import (EMBEDDING_FLAG, FIRST_FLAG, LAST_FLAG, LAYOUT_FLAG, LOSS_FLAG, LayerSplit,
                              LayoutError)
from .planning.clusters import PLANNING_CLUSTER, flat_cluster
from .planning.costs import GB, REDUCE_SCATTER_STEPS, ModelSpec, OpCosts, analytic_costs, planning_levels
from .planning.defaults import DEFAULT_HOST_LINK_GBPS, MEMORY_MARGIN
from .planning.planner import PlannerOptions
from .planning.simulator import simulate
from .schedule.config import ScheduleConfig
from .schedule.levers import BASIC_LEVERS, CATEGORIES, FULL, SELECTIVE
from .schedule.lower import lower
from .schedule.validate import validate


def add_schedule_args(parser: argparse.ArgumentParser, groups: bool = True) -> None:
    group = parser.add_argument_group("schedule")
    group.add_argument("--pp", type=positive_int, required=True, help="pipeline-parallel size p")
    group.add_argument("--vpp", type=positive_int, default=None,
                       help="virtual chunks per rank V (default: from --pipeline-model-parallel-layout)")
    group.add_argument("--microbatches", "-m", type=positive_int, required=True, help="micro-batches per iteration m")
    add_split_args(parser)
    if not groups:
        return
    add_cli_arguments(group, ("forward_groups", "backward_groups"))


def add_split_args(parser: argparse.ArgumentParser) -> None:
    """Megatron's flags that place the layers on the stages (:mod:`.planning.layout`)."""
    split = parser.add_argument_group("layer split (Megatron's flags; default: evenly)")
    split.add_argument(LAYOUT_FLAG, dest="pipeline_model_parallel_layout", metavar="LAYOUT",
                       help='layers per stage, e.g. "Et|tt|tt|tL" (sets V: its stages over p)')
    split.add_argument(FIRST_FLAG, dest="decoder_first_pipeline_num_layers", type=positive_int, metavar="N",
                       help="layers on pipeline rank 0 (over its chunks)")
    split.add_argument(LAST_FLAG, dest="decoder_last_pipeline_num_layers", type=positive_int, metavar="N",
                       help="layers on the last pipeline rank (over its chunks)")
    split.add_argument(EMBEDDING_FLAG, dest="account_for_embedding_in_pipeline_split", action="store_true",
                       help="the embedding counts as a layer of stage 0")
    split.add_argument(LOSS_FLAG, dest="account_for_loss_in_pipeline_split", action="store_true",
                       help="the loss counts as a layer of the last stage")


def split_from_args(args: argparse.Namespace) -> LayerSplit:
    """The layer split of the split flags; also sets ``args.vpp`` from a layout when --vpp is not given."""
    try:
        if args.pipeline_model_parallel_layout:
            split = LayerSplit.of_layout(args.pipeline_model_parallel_layout)
        else:
            split = LayerSplit(first=args.decoder_first_pipeline_num_layers, last=args.decoder_last_pipeline_num_layers,
                               embedding_counts=args.account_for_embedding_in_pipeline_split,
                               loss_counts=args.account_for_loss_in_pipeline_split)
        vpp = split.vpp(args.pp)
    except LayoutError as error:
        raise UsageError(str(error)) from error
    if args.vpp is None:
        if vpp is None:
            raise UsageError(f"--vpp is required (virtual chunks per rank V), or a {LAYOUT_FLAG} whose stages give it. "
                             "Example: --vpp 2")
        args.vpp = vpp
    elif vpp is not None and vpp != args.vpp:
        raise UsageError(f"--vpp {args.vpp} and {LAYOUT_FLAG} ({len(split.layout)} stages over --pp {args.pp} = V {vpp}) "
                         f"disagree; drop --vpp (the layout sets V) or use --vpp {vpp}")
    return split


def config_from_args(args: argparse.Namespace) -> ScheduleConfig:
    split_from_args(args)
    return ScheduleConfig(args.pp, args.vpp, args.microbatches,
                          tuple(args.forward_groups or ()), tuple(args.backward_groups or ()))


def add_cost_args(parser: argparse.ArgumentParser) -> None:
    d_model, d_cluster = ModelSpec(), PLANNING_CLUSTER
    model = parser.add_argument_group("model (analytic costs)")
    model.add_argument("--num-layers", type=positive_int, default=d_model.num_layers)
    model.add_argument("--hidden-size", type=positive_int, default=d_model.hidden_size)
    model.add_argument("--num-attention-heads", type=positive_int, default=d_model.num_attention_heads)
    model.add_argument("--seq-length", type=positive_int, default=d_model.seq_length)
    model.add_argument("--micro-batch-size", type=positive_int, default=d_model.micro_batch_size)
    model.add_argument("--vocab-size", type=positive_int, default=d_model.vocab_size)
    model.add_argument("--ffn-hidden-size", type=positive_int, default=None)
    model.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    cluster = parser.add_argument_group("cluster (analytic costs)")
    cluster.add_argument("--tp", type=positive_int, default=d_cluster.tp, help="tensor-parallel size")
    cluster.add_argument("--dp", type=positive_int, default=2, help="data-parallel size")
    add_cli_arguments(cluster, ("device_tflops", "mfu"))
    cluster.add_argument("--device-memory-gb", type=float, default=d_cluster.device_memory_gb)
    add_cli_arguments(cluster, ("dp_gbps", "p2p_gbps", "host_link_gbps"))
    cluster.add_argument("--latency-us", type=float, default=d_cluster.latency_us)
    cluster.add_argument("--sequence-parallel", action="store_true")
    cluster.add_argument("--no-distributed-optimizer", action="store_true",
                         help="all-reduce gradients instead of reduce-scatter + parameter all-gather")
    cluster.add_argument("--collectives", choices=tuple(REDUCE_SCATTER_STEPS), default=d_cluster.collectives,
                         help="library of the data-parallel collectives (default nccl); gloo (CPU ranks) prices a "
                              "reduce-scatter as the all-reduce it runs")
    direct = parser.add_argument_group("direct costs (override the analytic model when --forward-ms is given)")
    direct.add_argument("--forward-ms", type=float, default=None, help="forward of one chunk on one micro-batch")
    direct.add_argument("--backward-ms", type=float, default=None, help="backward of one chunk-micro-batch (default 2x forward)")
    direct.add_argument("--p2p-ms", type=float, default=0.0, help="one pipeline transfer")
    direct.add_argument("--dp-reduce-ms", type=float, default=0.0, help="gradient reduction of one chunk")
    direct.add_argument("--dp-gather-ms", type=float, default=0.0, help="parameter gather of one chunk")
    direct.add_argument("--activation-mb", type=float, default=1.0, help="activations of one chunk-micro-batch (MiB)")


def costs_from_args(args: argparse.Namespace, config: ScheduleConfig) -> OpCosts:
    planning = PLANNING_CLUSTER
    for flag, example, positive in (("forward_ms", "10", True), ("backward_ms", "20", True), ("p2p_ms", "1", False),
                                    ("dp_reduce_ms", "5", False), ("dp_gather_ms", "5", False), ("activation_mb", "64", False),
                                    ("device_tflops", f"{planning.device_tflops:g}", True),
                                    ("dp_gbps", f"{planning.dp_gbps:g}", True), ("p2p_gbps", f"{planning.p2p_gbps:g}", True),
                                    ("latency_us", f"{planning.latency_us:g}", False),
                                    ("device_memory_gb", f"{planning.device_memory_gb:g}", True)):
        check_number("--" + flag.replace("_", "-"), getattr(args, flag), example, positive)
    check_number("--mfu", args.mfu, f"{planning.mfu:g}", positive=True, at_most=1.0)
    if args.forward_ms is not None:
        if not split_from_args(args).even:
            raise UsageError("an uneven layer split needs the analytic model (the costs per layer come from the model "
                             f"shape): drop --forward-ms and the other direct costs, or the split flags ({LAYOUT_FLAG} ...)")
        backward = args.backward_ms if args.backward_ms is not None else 2 * args.forward_ms
        act = args.activation_mb * 1024 ** 2
        return OpCosts(forward_s=args.forward_ms / 1e3, backward_s=backward / 1e3, p2p_s=args.p2p_ms / 1e3,
                       dp_reduce_s=args.dp_reduce_ms / 1e3, dp_gather_s=args.dp_gather_ms / 1e3,
                       activation_bytes=dict.fromkeys(BASIC_LEVERS, act),
                       static_bytes=tuple(0.0 for _ in range(config.pp)), host_link_gbps=_host_link_gbps(args))
    model, cluster = model_cluster_from_args(args)
    try:
        return analytic_costs(model, cluster, config, planning_levels(model))
    except ValueError as error:
        raise UsageError(str(error)) from error


def model_cluster_from_args(args: argparse.Namespace):
    """The analytic model and cluster of the cost flags."""
    model = ModelSpec(args.num_layers, args.hidden_size, args.num_attention_heads, args.seq_length, args.micro_batch_size,
                      args.vocab_size, args.ffn_hidden_size, 4 if args.dtype == "fp32" else 2,
                      layer_split=split_from_args(args))
    cluster = flat_cluster(tp=args.tp, dp=args.dp, device_tflops=args.device_tflops, mfu=args.mfu,
                           device_memory_gb=args.device_memory_gb, dp_gbps=args.dp_gbps, p2p_gbps=args.p2p_gbps,
                           latency_us=args.latency_us, sequence_parallel=args.sequence_parallel,
                           distributed_optimizer=not args.no_distributed_optimizer, host_link_gbps=args.host_link_gbps,
                           collectives=args.collectives)
    return model, cluster


def sharding_from_args(args: argparse.Namespace, allow_auto: bool):
    """(levels or 'auto', model, cluster) of --sharding / --shard-scope, or None without --sharding."""
    from .planning.sharding import ShardingError, parse_levels, shard_size

    if getattr(args, "sharding", None) is None:
        return None
    if args.forward_ms is not None:
        raise UsageError("--sharding needs the analytic model (its bytes per parameter come from the model shape): drop "
                         "--forward-ms and the other direct costs. Example: --sharding optim optim_grads_params --dp 4")
    model, cluster = model_cluster_from_args(args)
    try:
        levels = parse_levels(args.sharding, args.vpp, distributed_optimizer=cluster.distributed_optimizer)
        if levels == "auto" and not allow_auto:
            raise ShardingError("--sharding auto is for `pipemesh plan`; `simulate` takes the levels. "
                                "Example: --sharding optim optim_grads_params")
        shard_size(args.shard_scope, cluster.dp, cluster.tp, cluster.devices_per_node)
    except ShardingError as error:
        raise UsageError(str(error).replace("--pipemesh-sharding", "--sharding")) from error
    return levels, model, cluster


def _print_splits(sharding, config: ScheduleConfig, result) -> None:
    """The level per chunk and each rank's memory split (weights/grads/optimizer/gather buffers/activations)."""
    from .planning.sharding import format_split

    print(f"{sharding.spec.describe()}; memory per rank (GiB):")
    for split, rank in zip(sharding.splits(config), result.ranks):
        split.activations = rank.peak_activation_bytes
        print("  " + format_split(split) + f", peak {rank.peak_memory_bytes / GB:.3f}")


def _host_link_gbps(args: argparse.Namespace) -> float:
    """--host-link-gbps, or the planning default (no device here to measure it on)."""
    return DEFAULT_HOST_LINK_GBPS if args.host_link_gbps is None else args.host_link_gbps


def planner_options_from_args(args: argparse.Namespace) -> PlannerOptions:
    """The planner's memory levers from --activation-placement and --host-memory-gb."""
    host = None if args.host_memory_gb is None else args.host_memory_gb * GB
    return PlannerOptions(activation_placement=args.activation_placement, host_budget_bytes=host)


def placement_lines(plans: Sequence[tuple]) -> List[str]:
    """Per named plan: chunk-micro-batches per rank on the device / on the host / recomputed selectively /
    fully, and the host memory the offloads hold at peak per rank."""
    lines = []
    for name, plan in plans:
        counts = " ".join("/".join(str(c[column]) for column in CATEGORIES) for c in plan.placement_counts())
        host = " ".join(f"{r.peak_host_bytes / GB:.2f}" for r in plan.result.ranks)
        lines.append(f"{name:<14} placement per rank (device/host/selective/full) {counts}; host memory GiB per rank "
                     f"{host}; exposed host copies {plan.result.exposed_host_s * 1e3:.2f} ms")
    return lines


def _shown_layers(args: argparse.Namespace, config: ScheduleConfig) -> Optional[Tuple[int, ...]]:
    """Layers per stage for `show`: of a layout, or of --num-layers with the split flags (None: neither given)."""
    split = split_from_args(args)
    count = sum(split.layout) if split.layout is not None else args.num_layers
    if count is None:
        if not split.even:
            raise UsageError("the split flags need --num-layers (the layers to place). Example: --num-layers 12")
        return None
    try:
        return split.stage_layers(count, config.pp, config.vpp)
    except LayoutError as error:
        raise UsageError(str(error)) from error


def cmd_show(args: argparse.Namespace) -> int:
    from .planning.sharding import ShardingError, parse_levels
    from .schedule.lower import LoweringOptions

    config = config_from_args(args)
    try:
        levels = parse_levels(args.sharding, config.vpp, allow_auto=False) if args.sharding else ()
    except ShardingError as error:
        raise UsageError(str(error).replace("--pipemesh-sharding", "--sharding")) from error
    schedule = lower(config, LoweringOptions(sharding=levels or ()))
    validate(schedule)
    layers = _shown_layers(args, config)
    if args.json:
        ranks = [[str(op) for op in (program if args.lowered else schedule.compute_order(rank))]
                 for rank, program in enumerate(schedule.programs)]
        print(json.dumps({"schedule": config.describe(), "digest": schedule.digest(), "ranks": ranks,
                          **({"stage_layers": list(layers)} if layers is not None else {})}))
        return 0
    print(f"# {config.describe()}  (plan digest {schedule.digest()})")
    if layers is not None:
        print(f"# transformer layers per stage (stage = chunk * p + rank): {' '.join(map(str, layers))}")
    if args.picture:
        from .planning.ascii import render_ascii
        from .schedule.timeline import execute
        timeline = execute(schedule)
        print(f"# timeline with F = 1 and B = 2 time units, free communication: {timeline.makespan:g} units")
        print(render_ascii(timeline))
        return 0
    for rank in range(config.pp):
        ops = schedule.programs[rank] if args.lowered else schedule.compute_order(rank)
        print(f"rank {rank}: " + " ".join(str(op) for op in ops))
    return 0


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
        from .planning.sharding import ShardingModel, ShardingSpec
        levels, model, cluster = given
        sharding = ShardingModel(model, cluster, ShardingSpec(levels, args.shard_scope))
    plans = None
    if args.memory_budget_gb is not None:
        from .planning.planner import fit_with_recompute
        budget, options = _budget_bytes(args), planner_options_from_args(args)
        plans = _comparison(config, lambda cfg: costs_from_args(args, cfg),
                            lambda cfg, costs: fit_with_recompute(cfg, costs, budget, options, sharding))
        rows = [(name, cfg, plan.result) for name, cfg, plan in plans]
    else:
        rows = _comparison(config, lambda cfg: costs_from_args(args, cfg), sharding=sharding)
    if args.trace:
        from .planning.trace import write_trace
        write_trace(rows[0][2], args.trace)
    if args.plot:
        from .planning.plot import plot_timelines
        plot_timelines([r for _, _, r in rows], args.plot, [name for name, _, _ in rows])
    if args.json:
        out = {name: result.to_dict() for name, _, result in rows}
        for name, _, plan in plans or ():
            out[name]["plan"] = plan.to_dict()
        print(json.dumps(out, indent=1))
    else:
        print(_format_table(rows))
        if sharding is not None:
            _print_splits(sharding, config, rows[0][2])
        if plans:
            print(f"\nfitted to {args.memory_budget_gb:g} GiB per device with --activation-placement {args.activation_placement}"
                  f" (host link {_host_link_gbps(args):g} Gbit/s):")
            print("\n".join(placement_lines([(name, plan) for name, _, plan in plans])))
        for path, what in ((args.trace, "trace"), (args.plot, "timeline picture")):
            if path:
                print(f"wrote {what}: {path}")
    return 0


def _budget_bytes(args: argparse.Namespace) -> float:
    if args.memory_budget_gb is not None:
        check_number("--memory-budget-gb", args.memory_budget_gb, "70", positive=True)
        return args.memory_budget_gb * GB
    if args.forward_ms is not None:
        raise UsageError("--memory-budget-gb is required with direct costs (--forward-ms ...): there is no device "
                         "description to derive it from. Example: --memory-budget-gb 20")
    return args.device_memory_gb * GB * (1 - MEMORY_MARGIN)


def cmd_plan(args: argparse.Namespace) -> int:
    from .planning.planner import NoFeasiblePlan, baseline_plans, plan_schedule

    split_from_args(args)  # V from a layout
    ScheduleConfig(args.pp, args.vpp, args.microbatches)  # p, V, m rules first
    budget = _budget_bytes(args)
    options = planner_options_from_args(args)
    costs_for = lambda cfg: costs_from_args(args, cfg)  # noqa: E731
    given = sharding_from_args(args, allow_auto=True)
    try:
        if given is None:
            best, evaluated = plan_schedule(args.pp, args.vpp, args.microbatches, costs_for, budget, options)
        else:
            from .planning.sharding import plan_with_sharding
            levels, model, cluster = given
            best, by_levels = plan_with_sharding(args.pp, args.vpp, args.microbatches, costs_for, budget, model, cluster,
                                                 args.shard_scope, levels, options)
            evaluated = [plan for plan in by_levels.values() if plan is not None]
    except NoFeasiblePlan as error:
        raise UsageError(str(error)) from error
    baselines = baseline_plans(args.pp, args.vpp, args.microbatches, costs_for, budget, options, sharding=best.sharding)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write(best.run_plan().to_json())
    if args.json:
        print(json.dumps({**best.to_dict(), "candidates_evaluated": len(evaluated),
                          "baselines": {name: plan.to_dict() for name, plan in baselines.items()}}, indent=1))
        return 0
    what = "candidate group lists" if given is None else "sharding level mixes (each with its best groups)"
    print(f"memory budget {budget / GB:.2f} GiB per device; {len(evaluated)} {what} simulated")
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
        _print_splits(best.sharding, best.config, best.result)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipemesh", description="PipeMesh elastic pipeline schedules for Megatron-LM (no GPU needed).")
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="print each rank's op order")
    add_schedule_args(show)
    show.add_argument("--json", action="store_true", help='one JSON object: {"ranks": [["F0.0", ...], ...], ...}')
    show.add_argument("--lowered", action="store_true", help="include sends, receives and data-parallel sync ops")
    show.add_argument("--picture", action="store_true", help="draw a text timeline (F = 1, B = 2 time units)")
    show.add_argument("--sharding", nargs="+", metavar="LEVEL", help="ZeRO level per chunk (optim, optim_grads, "
                      "optim_grads_params): --lowered then shows the GATHER / RELEASE / REDUCE ops")
    show.add_argument("--num-layers", type=positive_int, default=None,
                      help="transformer layers: with the split flags, print the layers of every stage")
    show.set_defaults(func=cmd_show)
    sim = sub.add_parser("simulate", help="simulate the schedule next to depth-first and breadth-first")
    add_schedule_args(sim)
    add_cost_args(sim)
    add_cli_arguments(sim.add_argument_group("budget (optional: fit each schedule to it, as `pipemesh plan` does)"),
                      ("memory_budget_gb", "activation_placement", "host_memory_gb"))
    add_cli_arguments(sim.add_argument_group("mixed sharding"), ("sharding", "shard_scope"))
    sim.add_argument("--json", action="store_true", help="print the numbers as JSON")
    sim.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace of the given schedule")
    sim.add_argument("--plot", metavar="FILE.png", help="draw the three timelines")
    sim.set_defaults(func=cmd_simulate)
    plan = sub.add_parser("plan", help="choose groups and recomputation that fit a memory budget")
    add_schedule_args(plan, groups=False)
    add_cost_args(plan)
    add_cli_arguments(plan.add_argument_group("budget"), ("memory_budget_gb", "activation_placement", "host_memory_gb"))
    add_cli_arguments(plan.add_argument_group("mixed sharding"), ("sharding", "shard_scope"))
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--output", metavar="PLAN.json", help="save the plan (groups and recomputation) for --pipemesh-plan")
    plan.add_argument("--megatron-args", metavar='"FLAGS"', help="instead of the flags above: your pretrain_gpt.py "
                      "command's flags and your cluster; prints the best stock flags, PipeMesh and the best layout for "
                      "it (its own flags: pipemesh plan --megatron-args '' --help)")
    plan.set_defaults(func=cmd_plan)
    from .bench.cli import add_bench_parser
    add_bench_parser(sub)
    from .study.study import add_study_parser
    add_study_parser(sub)
    from .study.headroom import add_headroom_parser
    add_headroom_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:
        from .cli_advice import cmd_advice, wants_advice
        if wants_advice(argv[1:]):  # the user's own command: its own parser (none of plan's model flags apply)
            return run_command(argparse.Namespace(command="plan", func=lambda _: cmd_advice(argv[1:])))
    parser = build_parser()
    args = parser.parse_args(argv)
    return run_command(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
