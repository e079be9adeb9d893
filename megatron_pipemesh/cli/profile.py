"""``pipemesh profile``: measure what the planner otherwise assumes, on this machine, for your command.

    pipemesh profile --megatron-args "<your pretrain_gpt.py flags>" [--output profile.json] [--repeats 3]
    pipemesh profile --output profile.json -- --num-layers 24 ...
    pipemesh profile --show profile.json
    torchrun --nnodes 2 --nproc-per-node 8 ... -m megatron_pipemesh profile --megatron-args "..."   # + the links

The measuring is :mod:`..integration.profile`; the file format :mod:`..planning.profile`; ``pipemesh plan
--megatron-args ... --profile profile.json`` prices the layouts with it.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import List, Sequence

from ..integration.profile import ProfileSettings
from ..planning.costs import STAGE_KINDS
from ..planning.profile import Profile, ProfileError, load
from .common import UsageError, positive_int, positive_number
from .megatron_args import MEGATRON_ARGS, _megatron_words, split_argv

DEFAULT_OUTPUT = "profile.json"
STEP_HEADER = "step F+B ms " + "/".join(STAGE_KINDS) + " stage"
"""The header of the schedule step's column: its cells follow :data:`STAGE_KINDS`, each stage kind named."""


def build_profile_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipemesh profile", description=(
        "Measure, on this machine with Megatron's own modules of your command, one transformer layer's forward and "
        "backward and each recomputation's extra, the embedding, the output layer with the loss (at micro-batch sizes "
        "1, 2, 4, ... up to yours), the optimizer step and the activation bytes; launched with torchrun on several "
        "ranks, also the links between them (p2p between and within nodes, flows sharing a NIC, collectives). Then "
        "plan with pipemesh plan --megatron-args ... --profile FILE."))
    parser.add_argument(MEGATRON_ARGS, metavar='"FLAGS"', default=None,
                        help="the flags of your pretrain_gpt.py command in one quoted string (or give them after --)")
    parser.add_argument("--output", metavar="FILE", default=DEFAULT_OUTPUT,
                        help=f"where to write the profile (default {DEFAULT_OUTPUT})")
    parser.add_argument("--show", metavar="FILE", default=None, help="print a profile as a table and exit")
    parser.add_argument("--repeats", type=positive_int, default=ProfileSettings.repeats,
                        help=f"the fewest timed calls per measurement (median; default {ProfileSettings.repeats})")
    parser.add_argument("--max-seconds", type=float, default=ProfileSettings.max_seconds,
                        help="time cap of each group of pieces: they are timed again until every median is within "
                             f"{ProfileSettings.stable_within * 100:g}%% (its ~95%% interval) or this many seconds have "
                             f"passed, which the profile then says (default {ProfileSettings.max_seconds:g}; 0: "
                             "exactly --repeats)")
    parser.add_argument("--warmup", type=int, default=ProfileSettings.warmup,
                        help=f"untimed calls before them (default {ProfileSettings.warmup})")
    parser.add_argument("--max-micro-batch-size", type=positive_int, default=None,
                        help="the largest micro-batch size measured (default: your command's); a larger one also "
                             "measures the sizes the advice may change yours to (1, 2, 4, ... and this one)")
    parser.add_argument("--bucket-mib", type=positive_number, default=None,
                        help="launched on several ranks (torchrun): the larger message the links are timed with, MiB "
                             "(default with CUDA: Megatron's gradient bucket of your command, 40,000,000 "
                             "parameters or 1,000,000 x the ranks, fp32 with bf16; without: 4; the smaller is one "
                             "micro-batch's activation)")
    parser.add_argument("--ranks-per-node", type=positive_int, default=ProfileSettings.ranks_per_node,
                        help="CPU: the ranks that will compute at once on this machine; the compute is timed with "
                             "that many cores computing, as they will (default 1: the other cores idle)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return parser


def table(profile: Profile, name: str = "") -> str:
    """The profile as text: where it was measured, the model, one row per (TP, micro-batch size), the rest."""
    shape = profile.shape
    lines = [f"profile {name}".rstrip() + f" (schema {profile.schema_version})"]
    if profile.device_kind:
        lines.append(f"device: {profile.device_kind} ({profile.device_name}); torch {profile.torch_version}, "
                     f"megatron-core {profile.megatron_core_version}")
    if shape is not None:
        lines.append(f"model: {shape.num_layers} layers, hidden {shape.hidden_size}, heads {shape.num_attention_heads}, "
                     f"ffn {shape.ffn_hidden_size}, seq {shape.seq_length}, vocab {shape.vocab_size}, {shape.dtype}, "
                     f"{shape.layer_spec} layer spec")
    if profile.method:
        lines.append("method: " + ", ".join(f"{key} {value}" for key, value in profile.method.items()))
    if profile.compute:
        levels = sorted({level for point in profile.compute for level in point.recompute_extra_s})
        header = (f"{'TP':>3} {'mbs':>4} {'layer F ms':>10} {'layer B ms':>10} {'keeps MiB':>9} "
                  + "".join(f" {'+' + level:>{max(10, len(level) + 1)}}" for level in levels)
                  + f" {'emb F+B ms':>11} {'out F+B ms':>11} {'batch ms':>8} {STEP_HEADER:>{len(STEP_HEADER)}}")
        lines += ["", header, "-" * len(header)]
        for point in profile.compute:
            lines.append(
                f"{point.tp:>3} {point.micro_batch_size:>4} {point.layer_forward_s * 1e3:>10.3f} "
                f"{point.layer_backward_s * 1e3:>10.3f} {point.layer_activation_bytes.get('none', 0.0) / 2**20:>9.3f}"
                + "".join(f" {point.recompute_extra_s.get(level, float('nan')) * 1e3:>{max(10, len(level) + 1)}.3f}"
                          for level in levels)
                + f" {(point.embedding_forward_s + point.embedding_backward_s) * 1e3:>11.3f}"
                + f" {(point.output_forward_s + point.output_backward_s) * 1e3:>11.3f}"
                + (f" {point.batch_s * 1e3:>8.3f}" if point.batch_s is not None else f" {'-':>8}")
                + f" {_step_cell(point):>{len(STEP_HEADER)}}")
        lines.append("(+level: the extra backward ms of that recomputation per layer; keeps: bytes one layer keeps "
                     "for its backward; batch: the data loader per micro-batch, first and last stage; step: Megatron's "
                     "schedule step beyond those, per chunk-micro-batch on the only/first/middle/last stage)")
        lines.append("activation bytes per layer: " + "; ".join(
            f"mbs {point.micro_batch_size}: " + ", ".join(f"{level} {value / 2**20:.3f} MiB"
                                                          for level, value in point.layer_activation_bytes.items())
            for point in profile.compute))
        lines += _spread_lines(profile)
    if profile.load is not None:
        lines.append(f"load while timing: {profile.load.describe()}")
    if profile.pace is not None:
        lines.append(profile.pace.describe())
    if profile.optimizer_s_per_param is not None:
        lines.append(f"optimizer step: {profile.optimizer_s_per_param * 1e9:.3f} ns per parameter")
    lines.append("host link: " + (f"{profile.host_link_gbps:.1f} Gbit/s" if profile.host_link_gbps is not None
                                  else "not measured (CUDA only)"))
    lines += _network_lines(profile)
    if profile.run_times is not None:
        lines.append("a training run's per-op times (s): "
                     + ", ".join(f"{key} {value:.6f}" for key, value in profile.run_times.items()))
    lines += [f"note: {note}" for note in profile.notes]
    return "\n".join(lines)


def _spread_lines(profile: Profile) -> List[str]:
    """Each point's pieces with their samples' spread: the median, its ~95% interval either side, the
    interquartile range, the samples, and 'capped' where the time cap stopped the repeats before the median was
    stable; nothing for a file written before spreads."""
    if not any(point.spread for point in profile.compute):
        return []
    header = f"{'mbs':>4} {'piece':<40} {'median ms':>10} {'± 95%':>7} {'IQR':>7} {'samples':>7}  stopped"
    lines = ["", header, "-" * len(header)]
    for point in profile.compute:
        for name, spread in (point.spread or {}).items():
            lines.append(f"{point.micro_batch_size:>4} {name.replace('_s:', ' ').replace('_s', ''):<40} "
                         f"{spread.median_s * 1e3:>10.3f} {spread.relative_half_width * 100:>6.1f}% "
                         f"{spread.relative_iqr * 100:>6.1f}% {spread.samples:>7}  "
                         + ("stable" if spread.stable else "at the time cap"))
    return lines


def _step_cell(point) -> str:
    """The schedule step's forward + backward ms per :data:`STAGE_KINDS`, '/'-separated; '-' where not measured."""
    if point.step_forward_s is None:
        return "-"
    return "/".join(f"{(point.step_forward_s[kind] + point.step_backward_s[kind]) * 1e3:.2f}" for kind in STAGE_KINDS)


def _network_lines(profile: Profile) -> List[str]:
    """The links a multi-rank profile timed: the rates the plan takes, then one row per pattern and size."""
    network = profile.network
    if network is None:
        return ["network: not measured (one process)"]
    nodes = [network.node_of_rank.count(node) for node in sorted(set(network.node_of_rank))]
    lines = [f"network: {len(network.node_of_rank)} ranks on {network.nodes} node(s) ({'/'.join(map(str, nodes))} "
             f"ranks each), {network.backend}; messages " + ", ".join(
                 f"{name} {nbytes / 2**20:.3f} MiB" for name, nbytes in network.sizes.items()),
             "NIC: " + (f"{network.nic_gbps:.4g} Gbit/s each way ({network.nic_from})" if network.nic_gbps is not None
                        else "not measured (one node)"),
             "intra-node link: " + (f"{network.intra_node_gbps:.4g} Gbit/s" if network.intra_node_gbps is not None
                                    else "not measured (one rank per node)"),
             "message latency: " + (f"{network.latency_us:.4g} us (half a round trip {network.round_trip.scope})"
                                    if network.latency_us is not None else "not measured (a file from before)")]
    header = f"{'pattern':<15} {'scope':<14} {'ranks':<12} {'MiB':>9} {'median ms':>10} {'Gbit/s':>9}"
    lines += ["", header, "-" * len(header)]
    for point in network.points:
        lines.append(f"{point.pattern:<15} {point.scope:<14} {','.join(map(str, point.ranks)):<12} "
                     f"{point.nbytes / 2**20:>9.3f} {point.median_s * 1e3:>10.3f} {point.gbps:>9.4g}")
    lines.append("(Gbit/s: each flow's rate for p2p patterns and round trips, the bus bandwidth for collectives)")
    return lines


def _progress(quiet: bool):
    started = time.perf_counter()

    def say(line: str) -> None:
        if not quiet:
            print(f"pipemesh profile [{time.perf_counter() - started:6.1f} s] {line}", file=sys.stderr, flush=True)

    return say


def cmd_profile(argv: Sequence[str]) -> int:
    """``pipemesh profile ...`` from its words (after ``profile``)."""
    own, tail = split_argv(argv)
    args = build_profile_parser().parse_args(own)
    if args.show is not None:
        if args.megatron_args is not None or tail is not None:
            raise UsageError("--show prints a profile: give it alone (pipemesh profile --show profile.json)")
        try:
            print(table(load(args.show), args.show))
        except ProfileError as error:
            raise UsageError(str(error)) from error
        return 0
    if args.max_seconds < 0:
        raise UsageError(f"--max-seconds {args.max_seconds:g} is invalid: it must be 0 or more. Example: "
                         "--max-seconds 10")
    if args.warmup < 0:
        raise UsageError(f"--warmup {args.warmup} is invalid: it must be 0 or more. Example: --warmup 1")
    words: List[str] = _megatron_words(args, tail)
    from ..integration.profile_links import LaunchError, launched

    try:
        launch = launched()
    except LaunchError as error:
        raise UsageError(str(error)) from error
    say = _progress(args.quiet or (launch is not None and launch.rank != 0))  # rank 0 speaks for the launch
    say("reading the command with Megatron's argument parser and building one layer of it")
    from ..integration.megatron_command import CommandError
    from ..integration.profile import measure_profile

    bucket = None if args.bucket_mib is None else int(args.bucket_mib * 2 ** 20)
    try:
        profile = measure_profile(words, ProfileSettings(warmup=args.warmup, repeats=args.repeats,
                                                         max_seconds=args.max_seconds,
                                                         max_micro_batch=args.max_micro_batch_size,
                                                         bucket_bytes=bucket, ranks_per_node=args.ranks_per_node),
                                  progress=say)
    except CommandError as error:
        raise UsageError(str(error)) from error
    if profile is None:  # a rank other than 0 of a multi-rank launch: rank 0 writes the file
        return 0
    with open(args.output, "w", encoding="utf-8") as handle:
        handle.write(profile.to_json() + "\n")
    say(f"wrote {args.output}")
    print(table(profile, args.output))
    print(f"\nplan with it: pipemesh plan --megatron-args \"...\" --profile {args.output} (your cluster's flags)")
    return 0
