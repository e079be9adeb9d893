"""What ``pipemesh show``, ``simulate`` and ``plan`` share: their schedule, layer-split, model, cluster and budget
flags, and the adapter from those flags to the schedule, the costs (the cluster built by
:func:`..planning.clusters.flat_cluster`) and the planner's options."""
from __future__ import annotations

import argparse
from typing import List, Sequence

from ..config import add_cli_arguments
from ..planning.clusters import PLANNING_CLUSTER, flat_cluster
from ..planning.costs import GB, REDUCE_SCATTER_STEPS, ModelSpec, OpCosts, analytic_costs, planning_levels
from ..planning.defaults import DEFAULT_HOST_LINK_GBPS, MEMORY_MARGIN
from ..planning.layout import (EMBEDDING_FLAG, FIRST_FLAG, LAST_FLAG, LAYOUT_FLAG, LOSS_FLAG, LayerSplit,
                               LayoutError)
from ..planning.planner import PlannerOptions
from ..planning.request import AUTO, LoweringSettings, PlanRequest
from ..schedule.config import ScheduleConfig
from ..schedule.levers import BASIC_LEVERS, CATEGORIES
from .common import UsageError, check_number, positive_int


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
                       static_bytes=tuple(0.0 for _ in range(config.pp)), host_link_gbps=host_link_gbps(args))
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
    from ..planning.sharding import ShardingError, parse_levels, shard_size

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


def print_splits(sharding, config: ScheduleConfig, result) -> None:
    """The level per chunk and each rank's memory split (weights/grads/optimizer/gather buffers/activations)."""
    from ..planning.sharding import format_split

    print(f"{sharding.spec.describe()}; memory per rank (GiB):")
    for split, rank in zip(sharding.splits(config), result.ranks):
        split.activations = rank.peak_activation_bytes
        print("  " + format_split(split) + f", peak {rank.peak_memory_bytes / GB:.3f}")


def host_link_gbps(args: argparse.Namespace) -> float:
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


def budget_bytes(args: argparse.Namespace) -> float:
    if args.memory_budget_gb is not None:
        check_number("--memory-budget-gb", args.memory_budget_gb, "70", positive=True)
        return args.memory_budget_gb * GB
    if args.forward_ms is not None:
        raise UsageError("--memory-budget-gb is required with direct costs (--forward-ms ...): there is no device "
                         "description to derive it from. Example: --memory-budget-gb 20")
    return args.device_memory_gb * GB * (1 - MEMORY_MARGIN)


def plan_request(args: argparse.Namespace) -> PlanRequest:
    """The ``pipemesh plan`` surface's adapter: its flags as the planner's :class:`PlanRequest` (checked in the
    order a user fixes them: the sizes, the budget, the sharding, then the costs)."""
    split_from_args(args)  # V from a layout
    config = ScheduleConfig(args.pp, args.vpp, args.microbatches)  # p, V, m rules first
    budget = budget_bytes(args)
    options = planner_options_from_args(args)
    given = sharding_from_args(args, allow_auto=True)
    costs = costs_from_args(args, config)  # the cost flags' rules, and the direct costs when given
    direct = args.forward_ms is not None
    model, cluster = (None, None) if direct else model_cluster_from_args(args)
    lowering = LoweringSettings() if given is None else LoweringSettings(sharding=given[0], shard_scope=args.shard_scope)
    return PlanRequest(args.pp, args.vpp, args.microbatches, AUTO, model=model, cluster=cluster, budget_bytes=budget,
                       planner=options, lowering=lowering, price_sharding=True, direct_costs=costs if direct else None)
