"""The ``pipemesh bench`` subcommand: stock Megatron schedules vs PipeMesh, measured side by side.

Hook (in ``megatron_pipemesh/command.py``'s ``build_parser``)::

    from .bench.cli import add_bench_parser
    add_bench_parser(sub)

Stand-alone: ``python -m megatron_pipemesh.bench [flags]`` or ``scripts/bench_schedules.py [flags]``.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

from ..cli.common import UsageError, check_number, parse_number, positive_int, require_matplotlib, run_command
from ..planning.defaults import MFU
from .advice_run import add_advice_args
from .nic_queue import NIC_QUEUES
from .runner import SCHEDULE_ALIASES, SCHEDULES, AutoPlanSettings, ModelSetup, ParallelConfig, bench_gpt
from .session import compact_row, log, print_results, run_all, summary_document  # noqa: F401 (compact_row: the JSON's rows)

QUICK = dict(configs=["pp2xdp2"], repeats=1, warmup=1, iters=2, rate="250mbit", link_share=1.0,
             activation_budget_mb="auto:0.2", pin_cores=True, no_limit=True,
             hidden_size=384, num_attention_heads=8, seq_length=64, micro_batch_size=1, microbatches=4, vpp=4,
             layers_per_chunk=1)
"""``--quick``: PP=2 x DP=2 (gradient reduction over the shaped network), V = 4, m = 4, a 250 Mbit/s NIC per rank
(``--network per-rank``: depth-first at V = 4 then loses 35-36% of its throughput to communication, 1 - shaped /
unshaped tokens/s, inside the 25-40% where the schedules differ; measured: docs/benchmarks.md), an activation
budget 20% of the way from the depth-first to the breadth-first peak, ranks pinned per pipeline stage, one repeat
of 1 warm-up + 2 measured iterations, no unshaped runs. Every value can be overridden by its flag."""
QUICK_SHARDING = dict(hidden_size=256, num_attention_heads=4, seq_length=128, memory_budget_mb="auto:0.2")
"""``--quick --sharding``: the --quick configuration with a model whose state is a real share of memory: about
38 MiB of weights + gradients + ZeRO-1 optimizer state per rank (fp32, DP = 2) next to 16-34 MiB of activations
(depth-first to breadth-first), inside a memory budget 20% of the way from the depth-first to the breadth-first
total. Every value can be overridden by its flag."""
MODEL_DEFAULTS = dict(hidden_size=256, num_attention_heads=4, seq_length=128, micro_batch_size=2, microbatches=8, vpp=2,
                      layers_per_chunk=1, link_share=1.0)
DEFAULT_RATE = "200mbit"
NETWORKS = ("per-rank", "shared")


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``bench`` on the ``pipemesh`` command's subparsers; returns the subparser."""
    p = subparsers.add_parser(
        "bench", help="measure stock Megatron schedules against PipeMesh on an emulated slow network",
        description="Run the same tiny GPT pretraining (CPU, gloo) under stock 1F1B, stock interleaved "
                    "(depth-first), stock interleaved with group size m (breadth-first), PipeMesh with given groups "
                    "and PipeMesh auto, round-robin over repeats, on an emulated network shaped by tc (by default "
                    "every rank in its own network namespace behind its own NIC; --network), and the same runs "
                    "unshaped (the limit). Needs root for the namespaces unless --unshaped.")
    add_bench_args(p)
    p.set_defaults(func=cmd_bench)
    return p


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """Every flag of ``pipemesh bench``, by group."""
    _add_mode_args(p)
    _add_run_args(p.add_argument_group("what to run"))
    _add_network_args(p.add_argument_group("emulated network"))
    _add_model_args(p.add_argument_group("model and batch"))
    _add_pipemesh_args(p.add_argument_group("PipeMesh"))
    _add_output_args(p.add_argument_group("output"))


def _add_mode_args(p) -> None:
    """--quick and --network-check: what the whole command does."""
    p.add_argument("--quick", action="store_true",
                   help="PP=2 x DP=2, V=4, m=4, 250 Mbit/s per rank, 1 repeat of 1 warm-up + 2 measured iterations "
                        "(about 4.5 minutes on an idle machine; with --sharding hidden 256, sequence 128 and a memory "
                        "budget)")
    p.add_argument("--network-check", action="store_true",
                   help="instead of training runs, measure real gloo flows on the per-rank network (one flow alone, one "
                        "rank sending to two peers, a data-parallel ring all-reduce with a pipeline send each way; "
                        "100 and 400 Mbit/s, 8 and 32 MiB) against the simulator's fair-share network model, and print "
                        "both (about 2 minutes; exit 1 when a prediction is more than 10%% off). Takes --nic-queue, "
                        "--burst, --queue-ms, --json, --out-dir")
    p.add_argument("--advice", action="store_true",
                   help="instead of the schedule comparison, check the advice of 'pipemesh plan --megatron-args' for "
                        "--nproc single-GPU nodes at --rate on this machine: run your command and every advice row on "
                        "the per-rank network, and print predicted against measured iteration time per row, the "
                        "advised row's measured speed-up, and the cost that differs where a prediction misses by "
                        "more than 10%%. Takes --megatron-args, --nproc, --rate or --unshaped, --profile, --no-profile or "
                        "--profile-max-seconds, --warmup "
                        "(default 1), --iters (default 3), --repeats (rounds of every row in turn, default 1), --device-tflops, "
                        "--mfu, --pin-cores, --json, --out-dir")
    add_advice_args(p.add_argument_group("--advice"))


def _add_run_args(run) -> None:
    """The layouts, schedules, memory budget and repeats that are run."""
    run.add_argument("--configs", nargs="+", default=None, metavar="ppNxdpM",
                     help="parallel layouts, e.g. pp2 pp4 pp2xdp2 (default: pp2 pp4 pp2xdp2; --quick: pp2)")
    run.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES + SCHEDULE_ALIASES,
                     metavar="NAME", help=f"schedules to compare (default all: {' '.join(SCHEDULES)}; 'interleaved' "
                                          f"runs every group size Megatron accepts; 'depth-first' / 'breadth-first' "
                                          f"only g = p / g = m)")
    run.add_argument("--group-sizes", type=int, nargs="+", default=None, metavar="G",
                     help="stock interleaved group sizes to run (default: every size Megatron accepts, p..m)")
    run.add_argument("--stock-vpp", type=int, nargs="+", default=None, metavar="V",
                     help="stock interleaved V to run (default: every V dividing the layers per rank)")
    run.add_argument("--activation-budget-mb", default=None, metavar="MB|auto",
                     help="activation memory per rank that every schedule must fit (MiB), or 'auto': halfway between "
                          "the depth-first and the breadth-first peak of the configuration. Stock rows get the cheapest "
                          "stock recomputation predicted to fit, PipeMesh rows are planned for it; a row whose measured "
                          "peak exceeds it is marked and never counts as best (default: no budget)")
    run.add_argument("--sharding", action="store_true",
                     help="every row runs Megatron's distributed optimizer (--use-distributed-optimizer "
                          "--overlap-grad-reduce --overlap-param-gather) and the budget is per-rank memory "
                          "(--memory-budget-mb): stock rows ZeRO-1 (optim; Megatron's ZeRO-2/3, Megatron-FSDP, is "
                          "CUDA-only), PipeMesh rows a level per chunk planned with the groups, recomputation and "
                          "placement (--pipemesh-sharding). Needs data parallelism (ppNxdpM, M >= 2)")
    run.add_argument("--memory-budget-mb", default=None, metavar="MB|auto",
                     help="with --sharding: weights + gradients + optimizer state + activations per rank that every "
                          "row must fit (MiB), or 'auto[:F]': F of the way (default 0.5) from what depth-first to what "
                          "breadth-first needs with ZeRO-1 (--quick --sharding: auto:0.2)")
    run.add_argument("--pin-cores", action="store_true",
                     help="pin the ranks of pipeline stage s to core s %% cores (with more ranks than cores: a waiting "
                          "stage's core is not lent to another stage)")
    run.add_argument("--repeats", type=int, default=None, help="runs per schedule and variant, round-robin (default 3); with --advice: "
                     "rounds of every row in turn, their iterations pooled (default 1)")
    run.add_argument("--warmup", type=int, default=None, help="iterations excluded from the statistics (default 2)")
    run.add_argument("--iters", type=int, default=None, help="measured iterations per run (default 6)")
    run.add_argument("--timeout", type=float, default=600.0, help="seconds before one run is killed (default 600)")
    run.add_argument("--no-limit", action="store_true", help="skip the unshaped runs (no fraction of the limit)")


def _add_network_args(net) -> None:
    """The emulated network the shaped runs see."""
    net.add_argument("--network", choices=NETWORKS, default=None,
                     help="'per-rank' (default): every rank in its own namespace behind its own NIC, shaped at --rate "
                          "each way, like one VM per rank on a switched network; 'shared': all ranks on one loopback "
                          "shaped as one token bucket of --rate for every link and direction")
    net.add_argument("--nic-queue", choices=NIC_QUEUES, default=None,
                     help="how concurrent flows share a rank's NIC (--network per-rank): 'fair' (default) gives every "
                          "peer of the rank its own htb class, an equal guaranteed share with the whole rate as "
                          "ceiling, so flows to different peers share the NIC equally and a lone flow gets all of it; "
                          "'fifo' is one tbf queue for every flow (the bench before fair classes)")
    net.add_argument("--rate", default=None, help=f"bandwidth of each rank's NIC each way (--network per-rank) or of the "
                                                  f"one shared loopback (--network shared), e.g. 200mbit, 1gbit "
                                                  f"(default {DEFAULT_RATE}; --quick: {QUICK['rate']})")
    net.add_argument("--delay-ms", type=float, default=0.0, help="one-way netem delay per packet (default 0)")
    net.add_argument("--burst", type=int, default=None, help="tbf burst in bytes (default and minimum 4 x 65536)")
    net.add_argument("--queue-ms", type=float, default=200.0, help="tbf latency (queue limit) in ms (default 200)")
    net.add_argument("--unshaped", action="store_true",
                     help="no namespace and no shaping (no root needed): only the plain-loopback runs")


def _add_model_args(model) -> None:
    """The tiny GPT and its batch."""
    model.add_argument("--hidden-size", type=int, default=None, help="default 256 (--quick: 384; --quick --sharding: 256)")
    model.add_argument("--num-attention-heads", type=int, default=None, help="default 4 (--quick: 8; --quick --sharding: 4)")
    model.add_argument("--seq-length", type=int, default=None, help="default 128 (--quick: 64; --quick --sharding: 128)")
    model.add_argument("--micro-batch-size", type=int, default=None, help="default 2 (--quick: 1)")
    model.add_argument("--microbatches", "-m", type=int, default=None,
                       help="micro-batches per iteration per replica (default 8; --quick: 4)")
    model.add_argument("--vpp", type=int, default=None,
                       help="virtual chunks per rank of PipeMesh (default 2; --quick: 4); stock gets every V")
    model.add_argument("--layers-per-chunk", type=int, default=None, help="default 1")


def _add_pipemesh_args(pm) -> None:
    """PipeMesh's groups and what its planner and the predictions assume."""
    pm.add_argument("--forward-groups", type=int, nargs="+", default=None, metavar="G",
                    help="groups of the 'pipemesh' run (default: m-p then p, e.g. 6 2 for p=2, m=8)")
    pm.add_argument("--backward-groups", type=int, nargs="+", default=None, metavar="G",
                    help="backward groups of the 'pipemesh' run (default: two groups, the last one large)")
    pm.add_argument("--device-tflops", type=float, default=0.05,
                    help="planner and predictions: peak TFLOP/s of one rank (default 0.05: a CPU core)")
    pm.add_argument("--mfu", type=float, default=MFU, help=f"planner and predictions: fraction of peak (default {MFU:g})")
    pm.add_argument("--activation-placement", choices=("auto", "recompute-only"), default="auto",
                    help="PipeMesh rows' memory levers: 'auto' (default) places chunk-micro-batches in host memory or "
                         "recomputes them, as the planner chooses; 'recompute-only' only recomputes (stock rows only "
                         "recompute here: Megatron's --fine-grained-activation-offloading needs CUDA and Transformer "
                         "Engine, and --cpu-offloading refuses pipeline parallelism)")
    pm.add_argument("--link-share", type=float, default=None,
                    help="fraction of the shaped rate one link gets, for the predictions, the plans and the "
                         "calibration (default 1; e.g. 0.5 with --network shared, where the two data-parallel rings "
                         "of PP=2 x DP=2 share one token bucket)")


def _add_output_args(out) -> None:
    """Where the results go."""
    out.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                     help="write the results as JSON to FILE (and print the table), or without FILE print JSON "
                          "instead of the table")
    out.add_argument("--plot", metavar="FILE.png", help="draw tokens/s per schedule, shaped and unshaped")
    out.add_argument("--out-dir", default=None, help="where logs, data and summary.json go (default: a new temp dir)")
    out.add_argument("--keep-going", action="store_true", default=True, help=argparse.SUPPRESS)


def _fill_defaults(args: argparse.Namespace) -> None:
    """Flags the user left out take their --quick (--quick --sharding) value or their default."""
    quick = {**QUICK, **(QUICK_SHARDING if args.sharding else {})}
    for name, value in MODEL_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, quick[name] if args.quick else value)
    if args.quick:
        if args.sharding and args.memory_budget_mb is None:
            args.memory_budget_mb = quick["memory_budget_mb"]
        if not args.sharding and args.activation_budget_mb is None:
            args.activation_budget_mb = QUICK["activation_budget_mb"]
        args.pin_cores = args.pin_cores or QUICK["pin_cores"]
        args.no_limit = args.no_limit or QUICK["no_limit"]


def parse_budget(text: Optional[str], flag: str = "--activation-budget-mb"):
    """``--activation-budget-mb`` / ``--memory-budget-mb``: None, a number of MiB, or ('auto', fraction) for
    'auto' / 'auto:F'."""
    if text is None:
        return None
    if text == "auto" or text.startswith("auto:"):
        fraction = 0.5 if text == "auto" else parse_number(text[5:])
        if not (fraction is not None and 0.0 <= fraction <= 1.0):
            raise UsageError(f"{flag} {text} is invalid: auto:F needs a fraction F in [0, 1] of the way "
                         f"from the depth-first to the breadth-first peak. Example: {flag} auto:0.2")
        return ("auto", fraction)
    value = parse_number(text)
    check_number(flag, value, "64 (or auto)", positive=True, required=True)
    return value


def network_shaping(args: argparse.Namespace, rate_mbit: float):
    """The :class:`~.netns.Shaping` of ``--network`` / ``--nic-queue`` / ``--burst`` / ``--delay-ms`` /
    ``--queue-ms`` at the rate; UsageError for a burst under 4 x the loopback MTU or ``--nic-queue fair`` on the
    shared loopback."""
    from .netns import MIN_BURST_BYTES, Shaping

    burst = args.burst if args.burst is not None else MIN_BURST_BYTES
    if burst < MIN_BURST_BYTES:
        raise UsageError(f"--burst {burst} is invalid: it must be at least 4 x the loopback MTU (65536), else tbf "
                         f"drops full-size packets. Example: --burst {MIN_BURST_BYTES}")
    per_rank = (args.network or "per-rank") == "per-rank"
    if args.nic_queue == "fair" and not per_rank:
        raise UsageError("--nic-queue fair is invalid with --network shared: every rank talks over one loopback "
                         "address there, so there is no peer to give a class. Example: --network per-rank "
                         "--nic-queue fair (or --network shared alone, one FIFO)")
    return Shaping(rate_mbit, args.delay_ms, burst, args.queue_ms, per_rank=per_rank, nic_queue=args.nic_queue)


NETWORK_CHECK_CONFLICTS = (("quick", "--quick"), ("unshaped", "--unshaped"), ("sharding", "--sharding"),
                           ("rate", "--rate"), ("delay_ms", "--delay-ms"), ("plot", "--plot"))
"""Flags ``--network-check`` refuses: it runs no training and measures at its own rates, without netem."""


def network_check_shaping(args: argparse.Namespace):
    """The network ``--network-check`` measures on (its rates replace this one's): the per-rank network with
    ``--nic-queue``, ``--burst`` and ``--queue-ms``; UsageError for a flag it cannot honour."""
    given = [flag for name, flag in NETWORK_CHECK_CONFLICTS if getattr(args, name)]
    if given or args.network == "shared":
        flags = " ".join(given + (["--network shared"] if args.network == "shared" else []))
        raise UsageError(f"--network-check with {flags} is invalid: the check runs no training and measures the "
                         "per-rank network at its own rates (100 and 400 Mbit/s) without delay. Drop them. Example: "
                         "pipemesh bench --network-check --json net.json")
    check_number("--queue-ms", args.queue_ms, "200", positive=True, required=True)
    return network_shaping(args, 1.0)


def check_sharding(args: argparse.Namespace, configs: Sequence[ParallelConfig]) -> None:
    """``--sharding`` / ``--memory-budget-mb`` / ``--activation-budget-mb``: which budget goes with which mode,
    and data parallelism for every configuration (UsageError naming the flag, the rule and an example)."""
    if not args.sharding:
        if args.memory_budget_mb is not None:
            raise UsageError(f"--memory-budget-mb {args.memory_budget_mb} needs --sharding: without it the model state "
                             f"is the same for every row and the budget is for activations alone. Example: --sharding "
                             f"--memory-budget-mb {args.memory_budget_mb} (or --activation-budget-mb auto)")
        return
    if args.activation_budget_mb is not None:
        raise UsageError(f"--activation-budget-mb {args.activation_budget_mb} with --sharding is invalid: sharding "
                         f"changes the model state, so the budget must cover weights + gradients + optimizer state + "
                         f"activations. Example: --sharding --memory-budget-mb auto:0.2")
    flat = [c.name for c in configs if c.dp < 2]
    if flat:
        raise UsageError(f"--sharding with --configs {' '.join(flat)} is invalid: every level shards over the "
                         f"data-parallel ranks, so without data parallelism (DP = 1) all levels hold the same bytes. "
                         f"Example: --sharding --configs pp2xdp2")


def resolve(args: argparse.Namespace) -> dict:
    """Validate the flags (UsageError on bad input) and fill in the --quick / default values."""
    _fill_defaults(args)
    configs = _parse_configs(args)
    repeats, warmup, iters = _run_counts(args)
    _check_values(args, repeats, warmup, iters)
    shaping = _resolve_shaping(args, configs)
    model = ModelSetup(bench_gpt(args.hidden_size, args.num_attention_heads, args.seq_length, args.micro_batch_size,
                                 args.layers_per_chunk), args.microbatches, args.vpp, int(warmup), int(iters))
    budget_mb = (parse_budget(args.memory_budget_mb, "--memory-budget-mb") if args.sharding
                 else parse_budget(args.activation_budget_mb))
    families, sizes, groups = _resolve_schedules(args, configs)
    return {"configs": configs, "repeats": int(repeats), "model": model, "shaping": shaping, "groups": groups,
            "auto": AutoPlanSettings(device_tflops=args.device_tflops, mfu=args.mfu,
                                     activation_placement=args.activation_placement,
                                     per_rank_network=shaping is None or shaping.per_rank), "families": families,
            "group_sizes": sizes, "stock_vpps": args.stock_vpp, "budget_mb": budget_mb,
            "link_share": args.link_share, "sharding": bool(args.sharding)}


def _parse_configs(args: argparse.Namespace) -> List[ParallelConfig]:
    """The parallel layouts of --configs (or --quick's / the default), checked against --sharding."""
    configs_text = args.configs or (QUICK["configs"] if args.quick else ["pp2", "pp4", "pp2xdp2"])
    try:
        configs = [ParallelConfig.parse(c) for c in configs_text]
    except ValueError as error:
        raise UsageError(str(error)) from error
    check_sharding(args, configs)
    return configs


def _run_counts(args: argparse.Namespace) -> Tuple[float, float, float]:
    """(repeats, warm-up iterations, measured iterations): the flags, or --quick's, or the defaults."""
    quick = args.quick
    repeats = args.repeats if args.repeats is not None else (QUICK["repeats"] if quick else 3)
    warmup = args.warmup if args.warmup is not None else (QUICK["warmup"] if quick else 2)
    iters = args.iters if args.iters is not None else (QUICK["iters"] if quick else 6)
    return repeats, warmup, iters


def _check_values(args: argparse.Namespace, repeats, warmup, iters) -> None:
    """Every number in range, the counts whole, the fractions at most 1, V >= 2 and the heads dividing the hidden
    size; UsageError naming the flag otherwise."""
    for name, value, example, zero in (("--repeats", repeats, "3", False), ("--warmup", warmup, "2", True),
                                       ("--iters", iters, "6", False), ("--timeout", args.timeout, "600", False),
                                       ("--hidden-size", args.hidden_size, "256", False),
                                       ("--num-attention-heads", args.num_attention_heads, "4", False),
                                       ("--seq-length", args.seq_length, "128", False),
                                       ("--micro-batch-size", args.micro_batch_size, "2", False),
                                       ("--microbatches", args.microbatches, "8", False), ("--vpp", args.vpp, "2", False),
                                       ("--layers-per-chunk", args.layers_per_chunk, "1", False),
                                       ("--delay-ms", args.delay_ms, "1", True), ("--queue-ms", args.queue_ms, "200", False),
                                       ("--device-tflops", args.device_tflops, "0.05", False),
                                       ("--mfu", args.mfu, f"{MFU:g}", False), ("--link-share", args.link_share, "0.5", False)):
        check_number(name, value, example, positive=not zero, required=True)
    for name, value in (("--repeats", repeats), ("--warmup", warmup), ("--iters", iters)):
        if int(value) != value:
            raise UsageError(f"{name} {value} is invalid: it must be a whole number. Example: {name} 3")
    if args.mfu > 1 or args.link_share > 1:
        raise UsageError(f"--mfu {args.mfu} / --link-share {args.link_share} is invalid: both are fractions in (0, 1]. "
                     f"Example: --mfu {MFU:g} --link-share 1")
    if args.vpp < 2:
        raise UsageError(f"--vpp {args.vpp} is invalid: the interleaved and PipeMesh schedules need at least 2 chunks per "
                     "rank. Example: --vpp 2")
    if args.hidden_size % args.num_attention_heads:
        raise UsageError(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
                     f"{args.num_attention_heads}. Example: --hidden-size 256 --num-attention-heads 4")


def _resolve_shaping(args: argparse.Namespace, configs: Sequence[ParallelConfig]):
    """The network shaping of the shaped runs (None with --unshaped), checked against the layouts."""
    rate_text = args.rate or (QUICK["rate"] if args.quick else DEFAULT_RATE)
    shaping = None
    if args.unshaped:
        if args.rate or args.delay_ms or args.network or args.nic_queue:
            raise UsageError(f"--unshaped with --rate/--delay-ms/--network/--nic-queue is contradictory: --unshaped runs "
                             f"over the plain loopback. Drop one of them. Example: --rate {rate_text}")
    else:
        from .netns import MAX_RANKS, parse_rate_mbit

        try:
            rate = parse_rate_mbit(rate_text)
        except ValueError as error:
            raise UsageError(f"--rate {rate_text}: {error}") from error
        shaping = network_shaping(args, rate)
        too_big = [c.name for c in configs if c.world > MAX_RANKS]
        if shaping.per_rank and too_big:
            raise UsageError(f"--configs {' '.join(too_big)} is invalid with --network per-rank: its /24 network holds "
                             f"{MAX_RANKS} ranks. Example: --network shared")
    return shaping


def _resolve_schedules(args: argparse.Namespace, configs: Sequence[ParallelConfig]):
    """(schedule families, stock group sizes per layout, PipeMesh groups per layout): the aliases depth-first /
    breadth-first as interleaved group sizes, every size checked against what Megatron accepts, the PipeMesh groups
    (given or default) validated."""
    families = [f for f in SCHEDULES if f in args.schedules]
    group_sizes = list(args.group_sizes) if args.group_sizes else None
    aliases = [a for a in SCHEDULE_ALIASES if a in args.schedules]
    if aliases and "interleaved" not in families:
        families.insert(1 if "1f1b" in families else 0, "interleaved")
    groups: Dict[Tuple[str, str], tuple] = {}
    from ..schedule.config import ScheduleConfig, ScheduleConfigError
    from .runner import default_groups

    from ..planning.stock import group_sizes as accepted_group_sizes

    sizes: Dict[str, Optional[List[int]]] = {}
    for config in configs:
        accepted = accepted_group_sizes(config.pp, args.microbatches)
        chosen = group_sizes
        if aliases and "interleaved" not in args.schedules:
            chosen = sorted(set((group_sizes or []) + [{"depth-first": config.pp, "breadth-first": args.microbatches}[a]
                                                        for a in aliases]))
        bad = [g for g in (chosen or []) if g not in accepted]
        if bad:
            raise UsageError(f"--group-sizes {' '.join(map(str, bad))} is invalid for {config.name} with m = "
                         f"{args.microbatches}: Megatron accepts p <= g <= m with m % g == 0 or m % g >= p, i.e. "
                         f"{' '.join(map(str, accepted))}. Example: --group-sizes {accepted[0]} {accepted[-1]}")
        sizes[config.name] = chosen
        if args.microbatches < config.pp:
            raise UsageError(f"--microbatches {args.microbatches} is invalid for {config.name}: it must be at least the "
                         f"pipeline size {config.pp}. Example: --microbatches {2 * config.pp}")
        if "pipemesh" in args.schedules:
            forward = tuple(args.forward_groups) if args.forward_groups else None
            backward = tuple(args.backward_groups) if args.backward_groups else None
            dflt = default_groups(config.pp, args.microbatches)
            forward = forward or dflt[0]
            backward = backward or (forward if args.forward_groups else dflt[1])
            try:
                ScheduleConfig(config.pp, args.vpp, args.microbatches, forward, backward)
            except ScheduleConfigError as error:
                raise UsageError(f"{config.name}: {error}") from error
            groups[(config.name, "pipemesh")] = (forward, backward)
    return families, sizes, groups


def build_specs(setup: dict, config: ParallelConfig, gbps: float, plan_dir: str, cores: int):
    """(activation budget -- with ``--sharding`` memory budget -- in bytes or None, the rows of one
    configuration). Predictions see each link at ``gbps`` x the link share and each rank at
    ``--device-tflops`` x cores / ranks when the ranks outnumber the cores."""
    from dataclasses import replace

    from .memory_fair import MB, auto_budget_bytes, pipemesh_spec, stock_specs

    model, families = setup["model"], setup["families"]
    auto = replace(setup["auto"], device_tflops=setup["auto"].device_tflops * min(1.0, cores / config.world))
    gbps = gbps * setup["link_share"]
    budget_mb, sharding = setup["budget_mb"], setup.get("sharding", False)
    if isinstance(budget_mb, tuple):
        budget = auto_budget_bytes(model, config, auto, gbps, budget_mb[1], sharding)
    else:
        budget = budget_mb * MB if budget_mb is not None else None
    specs = stock_specs(model, config, budget, auto, gbps, families, setup["group_sizes"].get(config.name),
                        setup["stock_vpps"], sharding)
    for family in ("pipemesh", "pipemesh-auto"):
        if family in families:
            try:
                specs.append(pipemesh_spec(model, config, family, budget, auto, gbps, plan_dir,
                                           setup["groups"].get((config.name, "pipemesh")), sharding))
            except ValueError as error:  # NoFeasiblePlan: nothing fits even with every activation recomputed
                raise UsageError(f"{config.name} {family}: {error}") from error
    return budget, specs


def machine_description() -> dict:
    cores = os.cpu_count() or 1
    mem_gb = None
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_gb = int(line.split()[1]) / 2 ** 20
    except OSError:
        pass
    import torch

    return {"cores": cores, "memory_gb": round(mem_gb, 1) if mem_gb else None, "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "backend": "gloo (CPU)"}


def cmd_bench(args: argparse.Namespace) -> int:
    if args.advice:
        from .advice_run import cmd_advice

        _terminate_as_interrupt()
        return cmd_advice(args, machine_description(), lambda rate: network_shaping(args, rate), DEFAULT_RATE)
    given = [flag for flag, value in (("--megatron-args", args.megatron_args), ("--nproc", args.nproc),
                                      ("--profile", args.profile),
                                      ("--no-profile", args.no_profile or None),
                                      ("--only-advised", args.only_advised or None)) if value is not None]
    if given:
        raise UsageError(f"{' '.join(given)} needs --advice: they say which command and cluster --advice checks. "
                         f"Example: pipemesh bench --advice {' '.join(given)} ...")
    if args.network_check:
        return _network_check(args)
    setup = resolve(args)
    if args.plot:
        require_matplotlib("--plot")  # before the runs, not after them
    configs, shaping, repeats = setup["configs"], setup["shaping"], setup["repeats"]
    machine = machine_description()
    out_dir = args.out_dir or tempfile.mkdtemp(prefix="pipemesh-bench-")
    os.makedirs(out_dir, exist_ok=True)
    variants = ([True] if shaping else []) + ([] if (shaping and args.no_limit) else [False])
    specs, budgets = _plan_rows(setup, machine, out_dir)
    plan = [(r, c, s, v) for r in range(repeats) for c in configs for s in specs[c.name] for v in variants]
    _log_run_plan(args, setup, specs, plan, variants, machine, out_dir)
    data_flags = _prepare_data(out_dir)
    started = time.monotonic()
    _terminate_as_interrupt()
    results = run_all(args, setup, plan, data_flags, machine, out_dir)
    if results is None:
        return 130
    document, summary = summary_document(args, setup, results, specs, budgets, machine, out_dir,
                                         time.monotonic() - started)
    print_results(args, setup, document, summary, machine, out_dir)
    failed = sum(1 for r in results if r.returncode != 0)
    return 1 if failed == len(results) else 0


def _prepare_data(out_dir: str):
    """The training data's flags: the shipped corpus tokenized under ``out_dir``/data."""
    from .runner import prepare_data

    try:
        return prepare_data(os.path.join(out_dir, "data"))
    except RuntimeError as error:
        raise UsageError(str(error)) from error


def _network_check(args: argparse.Namespace) -> int:
    """``--network-check``: real gloo flows against the network model instead of training runs."""
    from .network_check import cmd_network_check

    shaping = network_check_shaping(args)
    _terminate_as_interrupt()
    try:
        return cmd_network_check(args, shaping)
    except KeyboardInterrupt:
        print("pipemesh bench --network-check: interrupted; the namespaces are removed", file=sys.stderr)
        return 130


def _plan_rows(setup: dict, machine: dict, out_dir: str):
    """(rows per layout, budget per layout): each layout's rows planned and predicted before anything runs, as the
    log says."""
    shaping = setup["shaping"]
    bandwidth_gbps = shaping.payload_bytes_per_s * 8 / 1e9 if shaping else 25.0
    specs, budgets = {}, {}
    for config in setup["configs"]:
        budgets[config.name], specs[config.name] = build_specs(setup, config, bandwidth_gbps, os.path.join(out_dir, "plans"),
                                                               machine["cores"])
        budget = budgets[config.name]
        log(f"{config.name}: {'memory (model state + activations)' if setup['sharding'] else 'activation'} budget per rank "
            + (f"{budget / 2 ** 20:.2f} MiB" if budget is not None else "none") + "; rows: "
            + "; ".join(f"{spec.name} [{spec.describe()}]" for spec in specs[config.name]))
    return specs, budgets


def _log_run_plan(args, setup: dict, specs: dict, plan: list, variants: list, machine: dict, out_dir: str) -> None:
    """How many runs, over which network, and which layouts oversubscribe the cores."""
    from .runner import threads_per_rank

    configs, shaping, repeats = setup["configs"], setup["shaping"], setup["repeats"]
    log(f"pipemesh bench: {len(plan)} runs ({repeats} repeat(s) x {len(configs)} config(s) x "
        f"{' / '.join(str(len(specs[c.name])) for c in configs)} row(s) x {len(variants)} variant(s)); network: "
        f"{shaping.describe() if shaping else 'unshaped'}; logs in {out_dir}")
    for config in configs:
        threads, over = threads_per_rank(config.world, machine["cores"])
        if over:
            log(f"note: {config.name} runs {config.world} ranks on {machine['cores']} cores: oversubscribed "
                f"(1 thread per rank{', pinned per pipeline stage' if args.pin_cores else ''})")


def _terminate_as_interrupt() -> None:
    """SIGTERM stops the bench like Ctrl-C (the running job's process group is killed and the namespace removed);
    a job started in the background has SIGINT ignored, so SIGTERM is how it is stopped."""
    import signal
    import threading

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, interrupt)


def build_parser() -> argparse.ArgumentParser:
    """A stand-alone ``pipemesh``-like parser holding only ``bench`` (for ``python -m megatron_pipemesh.bench``)."""
    parser = argparse.ArgumentParser(prog="pipemesh")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "bench":
        argv = ["bench"] + argv
    args = build_parser().parse_args(argv)
    return run_command(args)
