"""``pipemesh plan --megatron-args "<your pretrain_gpt.py flags>"``: what to run on your cluster.

    pipemesh plan --megatron-args "--num-layers 24 ... --pipeline-model-parallel-size 4" \
        --nodes 2 --gpus-per-node 8 --nic-gbps 25 --gpu A10G [--host-memory-gb 48] [--json]
    pipemesh plan --nodes 2 --gpus-per-node 8 --nic-gbps 25 --gpu A10G -- --num-layers 24 ...

The command is read by Megatron's own parser (:mod:`..integration.megatron_command`) for the cluster's GPU count; the
search is :func:`..planning.advice.advise`; each row's flags are the user's with only the changed ones replaced
(:mod:`..integration.command_flags`). This module is the argument plumbing and the report.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import signal
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..planning.clusters import PLANNING_CLUSTER
from ..planning.costs import GB
from ..planning.defaults import ANSWER_MARGIN_S, DEFAULT_HOST_LINK_GBPS, MFU, SEARCH_SECONDS
from ..planning.devices import Device, DeviceRate, rate_for
from ..planning.profile_network import LinkRate, MessageLatency, chosen_latency
from .common import UsageError, nonnegative_number, old_spelling, positive_int, positive_number

MEGATRON_ARGS = "--megatron-args"
INTERRUPTED_STATUS = {"SIGINT": 128 + signal.SIGINT, "SIGTERM": 128 + signal.SIGTERM}
"""Exit status of ``pipemesh plan --megatron-args`` stopped by a signal (after printing the rows found so far): 128 +
the signal's number, as a shell reports a process the signal ended."""
DEFAULT_INTRA_NODE_GBPS = 100.0
"""--intra-node-gbps without a flag or a measurement: PCIe."""


def add_advice_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``pipemesh plan --megatron-args`` (the user's command and the cluster)."""
    parser.add_argument(MEGATRON_ARGS, metavar='"FLAGS"', default=None,
                        help="the flags of your pretrain_gpt.py command, in one quoted string (a launcher and script "
                             "before them are allowed: 'torchrun --nproc-per-node 8 pretrain_gpt.py --num-layers ...'); "
                             "or give them after --")
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--nodes", "--nnodes", dest="nodes", type=positive_int, required=True,
                         help="nodes (torchrun's --nnodes is the same flag)")
    cluster.add_argument("--gpus-per-node", "--nproc-per-node", dest="gpus_per_node", type=positive_int, required=True,
                         help="GPUs per node, behind one NIC (torchrun's --nproc-per-node is the same flag)")
    cluster.add_argument("--nic-gbps", type=positive_number, default=None,
                         help="one node's network interface, Gbit/s per direction (shared by all its GPUs); required "
                              "unless --profile measured it (pipemesh profile on two or more nodes); given, it wins")
    cluster.add_argument("--intra-node-gbps", type=positive_number, default=None,
                         help=f"per-GPU bandwidth between the GPUs of a node, Gbit/s (default: --profile's measurement, "
                              f"else --gpu's link (NVLink 4: 3600, PCIe Gen4: 256), else {DEFAULT_INTRA_NODE_GBPS:g})")
    cluster.add_argument("--gpu", metavar="MODEL", default=None,
                         help="GPU model and form factor (peak TFLOP/s, FP8, memory and the link between a server's "
                              "GPUs from the known table, e.g. A10G, L4, L40S, 'A100 SXM 40GB', 'H100 SXM', "
                              "'H100 PCIe'; a family name alone is its SXM board, said in the output)")
    cluster.add_argument("--device-memory-gib", "--device-memory-gb", dest="device_memory_gb", type=positive_number,
                         default=None, action=old_spelling("--device-memory-gib"),
                         help="memory of one GPU, GiB (default: --gpu's); one of the two is required "
                              "(--device-memory-gb: the old spelling)")
    cluster.add_argument("--device-tflops", type=positive_number, default=None,
                         help="dense 16-bit peak TFLOP/s of one GPU (default: --gpu's; without either, this machine's "
                              "measured matmul rate, said in the output)")
    cluster.add_argument("--device-fp8-tflops", type=positive_number, default=None,
                         help="dense FP8 peak TFLOP/s of one GPU, for a command with --fp8-format (default: --gpu's; "
                              "a GPU without FP8 refuses such a command)")
    cluster.add_argument("--mfu", type=positive_number, default=None,
                         help=f"fraction of the peak the layers reach (default {MFU:g}; 1 for a measured rate)")
    cluster.add_argument("--host-memory-gb", type=positive_number, default=None,
                         help="host memory per GPU for offloaded activations, GiB (default: no offloading on either side)")
    cluster.add_argument("--host-link-gbps", type=positive_number, default=None,
                         help="device-host copy bandwidth per GPU and direction, Gbit/s (default: --profile's "
                              f"measurement, else {DEFAULT_HOST_LINK_GBPS:g})")
    cluster.add_argument("--latency-us", type=nonnegative_number, default=None,
                         help="the fixed time of one message (a pipeline transfer, a collective's step), microseconds "
                              f"(default: --profile's measurement on several ranks, else {PLANNING_CLUSTER.latency_us:g})")
    cluster.add_argument("--gpudirect-rdma", action="store_true",
                         help="the NIC reads GPU memory directly (default: network traffic is staged through host "
                              "memory, as on commodity clouds)")
    search = parser.add_argument_group("search")
    search.add_argument("--search-seconds", type=nonnegative_number, default=SEARCH_SECONDS,
                        help=f"answer within this many seconds of the command's start (default {SEARCH_SECONDS:g}; 0: "
                             f"search to the end): the layout search stops {ANSWER_MARGIN_S:g} s before, to end its "
                             "workers and print, and reports the best rows found, with "
                             "how much faster a layout left unsearched could be at most (the rows of your own layout are "
                             "always priced). Ctrl-C (SIGINT) or SIGTERM stops it the same way: the rows found so far, "
                             f"then exit status 128 + the signal ({INTERRUPTED_STATUS['SIGINT']} / "
                             f"{INTERRUPTED_STATUS['SIGTERM']})")
    search.add_argument("--jobs", type=positive_int, default=None,
                        help="worker processes for the layout search (default: the cores this process may use); the "
                             "rows are the same for every number, only the time changes")
    search.add_argument("--quiet", action="store_true",
                        help="no progress lines on stderr (each row found, and every few seconds where the search is)")
    parser.add_argument("--profile", metavar="FILE", default=None,
                        help="a profile of this command measured by pipemesh profile: its layer, embedding, output, "
                             "optimizer and activation costs, and the link rates it measured (NIC, intra-node, host "
                             "link) and the fixed time of a message where their flags are not given, replace the assumed "
                             "ones (the output says which)")
    parser.add_argument("--json", action="store_true", help="one JSON object: the rows, the notes, the search")


def build_advice_parser() -> argparse.ArgumentParser:
    """The parser of ``pipemesh plan --megatron-args`` (its own: none of plan's model flags apply here)."""
    parser = argparse.ArgumentParser(prog="pipemesh plan", description=(
        "From your pretrain_gpt.py command and your cluster: the best stock flags and PipeMesh for your layout, and "
        "the best parallel layout for the same GPUs, with the predicted iteration time and peak memory per rank. "
        "The other mode, one pipeline's groups from model and cost flags: pipemesh plan --pp P --microbatches M "
        "(its flags: pipemesh plan --help)."))
    add_advice_arguments(parser)
    return parser


def split_argv(argv: Sequence[str]) -> Tuple[List[str], Optional[List[str]]]:
    """(plan's own words, the Megatron flags after ``--`` or None when there is no ``--``)."""
    argv = list(argv)
    if "--" not in argv:
        return argv, None
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def wants_advice(argv: Sequence[str]) -> bool:
    """``plan`` with the user's command (``--megatron-args`` or flags after ``--``)."""
    own, tail = split_argv(argv)
    return tail is not None or any(w == MEGATRON_ARGS or w.startswith(MEGATRON_ARGS + "=") for w in own)


def _device(args) -> Tuple[float, DeviceRate, Optional[Device]]:
    """(device memory GiB, compute rate, the --gpu model) from --gpu / --device-memory-gb / --device-tflops /
    --device-fp8-tflops / --mfu, checked."""
    from ..planning.devices import DeviceError, find_device, known_names

    device = None
    if args.gpu is not None:
        try:
            device = find_device(args.gpu)
        except DeviceError as error:
            raise UsageError(str(error)) from error
        if device is None:
            raise UsageError(f"--gpu {args.gpu}: not a known GPU model ({known_names()}). Give --device-memory-gib and "
                             "--device-tflops instead, e.g. --device-memory-gib 24 --device-tflops 125")
    memory = args.device_memory_gb or (device.memory_gb if device else None)
    if memory is None:
        raise UsageError("--device-memory-gib (the memory of one GPU, GiB) or --gpu MODEL is required. "
                         "Example: --device-memory-gib 24, or --gpu A10G")
    if args.mfu is not None and args.mfu > 1:
        raise UsageError(f"--mfu {args.mfu:g} is invalid: it is a fraction of the peak, at most 1. Example: --mfu {MFU:g}")
    from ..runtime.cpu_rate import measured_cpu_tflops

    rate = rate_for(args.device_tflops, "--device-tflops", device, MFU if args.mfu is None else args.mfu,
                    measured_cpu_tflops, 1.0 if args.mfu is None else args.mfu, device_flag="--gpu",
                    fp8_tflops=args.device_fp8_tflops)
    if not rate.given:
        rate = dataclasses.replace(rate, source=f"{rate.source} on this machine (no --device-tflops or --gpu given)")
    return memory, rate, device


def _megatron_words(args, tail: Optional[List[str]]) -> List[str]:
    if tail is not None and args.megatron_args is not None:
        raise UsageError(f"the command is given twice ({MEGATRON_ARGS} and after --): give it once")
    if tail is not None:
        return tail
    if not args.megatron_args or not args.megatron_args.strip():
        raise UsageError(f'{MEGATRON_ARGS} needs the flags of your pretrain_gpt.py command. Example: {MEGATRON_ARGS} '
                         '"--num-layers 24 --hidden-size 2048 ... --pipeline-model-parallel-size 4"')
    try:
        return shlex.split(args.megatron_args)
    except ValueError as error:
        raise UsageError(f"{MEGATRON_ARGS}: the quoted flags do not split as a shell would ({error})") from error


NO_P2P_OVERLAP_FLAG = "--no-overlap-p2p-communication"
"""Megatron's flag that forbids interleaving at PP = 2 (its validate_args asserts PP > 2 for V > 1 without overlap)."""


def link_rates(args, profile) -> Dict[str, LinkRate]:
    """The link rates the advice uses ({'nic', 'intra_node', 'host_link'}): each flag given wins, else what
    ``profile`` measured, else the flag's default; without either, --nic-gbps is required (exit 2)."""
    from ..planning.profile_network import chosen_rate

    from ..planning.devices import DeviceError, find_device

    network = profile.network if profile is not None else None
    try:
        device = find_device(args.gpu) if args.gpu else None
    except DeviceError:
        device = None  # _device refuses the name
    intra, origin = DEFAULT_INTRA_NODE_GBPS, ""  # the flag's own default (PCIe)
    if device is not None:
        intra, origin = device.intra_node_gbps, f"the device table: {device.name}'s {device.interconnect}"
    rates = {
        "nic": chosen_rate("NIC", "--nic-gbps", args.nic_gbps, network.nic_gbps if network else None, None),
        "intra_node": chosen_rate("intra-node link", "--intra-node-gbps", args.intra_node_gbps,
                                  network.intra_node_gbps if network else None, intra, origin),
        "host_link": chosen_rate("host link", "--host-link-gbps", args.host_link_gbps,
                                 profile.host_link_gbps if profile is not None else None, DEFAULT_HOST_LINK_GBPS)}
    if rates["nic"].gbps is None:
        why = (f"the profile {args.profile} did not measure the NIC (it ran on one node: launch pipemesh profile on "
               "two or more nodes to measure it)" if profile is not None else "no --profile measured it")
        raise UsageError(f"--nic-gbps (one node's network interface, Gbit/s per direction) is required: {why}. "
                         "Example: --nic-gbps 25")
    return rates


def message_latency(args, profile) -> MessageLatency:
    """The fixed time of a message the advice uses: --latency-us, else the profile's measurement, else the default."""
    return chosen_latency(args.latency_us, profile.network if profile is not None else None,
                          PLANNING_CLUSTER.latency_us)


def problem_and_cluster(args, words: Sequence[str]):
    """(the user's command read by Megatron, the advice problem, the advice cluster, the rate) for ``args``; the
    problem carries ``--profile`` once it is matched to the command (:func:`matched_profile`), the cluster the link
    rates :func:`link_rates` chooses. A command the advice cannot price right in kind (:mod:`..planning.flag_inventory`),
    or whose launcher asks for another cluster, is refused in one line."""
    from ..integration.command_flags import flag_name
    from ..integration.megatron_command import CommandError, read_command
    from ..planning.advice import AdviceCluster, AdviceProblem, ParallelLayout
    from ..planning.flag_inventory import refusal
    from ..runtime.unsupported import unsupported_message
    from ..schedule.config import ScheduleConfig

    if args.profile is None:
        link_rates(args, None)  # without a profile, --nic-gbps is required: say so before anything else
    memory, rate, device = _device(args)
    gpus = args.nodes * args.gpus_per_node
    try:
        user = read_command(list(words), world_size=gpus)
    except CommandError as error:
        raise UsageError(str(error)) from error
    refused = refusal(user.changed) or user.launch.disagreement(args.nodes, args.gpus_per_node)
    if refused:
        raise UsageError(f"{MEGATRON_ARGS}: {refused}")
    _check_fp8(user, rate, device)
    if user.pp == 1 and user.pipemesh:
        raise UsageError(f"{MEGATRON_ARGS}: --pipeline-schedule pipemesh with --pipeline-model-parallel-size 1: "
                         "PipeMesh schedules a pipeline; give --pipeline-model-parallel-size 2 or more, or drop "
                         "--pipeline-schedule pipemesh to price the command without a pipeline")
    if user.tp > args.gpus_per_node or args.gpus_per_node % user.tp:
        raise UsageError(f"{MEGATRON_ARGS}: --tensor-model-parallel-size {user.tp} does not fit inside a node of "
                         f"--gpus-per-node {args.gpus_per_node}: the advice keeps TP inside a node")
    a = user.args
    profile = None if args.profile is None else matched_profile(args, user, rate)
    links = link_rates(args, profile)
    pipemesh = None
    if user.pipemesh and list(a.forward_groups or []) != ["auto"]:
        pipemesh = ScheduleConfig(user.pp, user.vpp, user.microbatches, tuple(a.forward_groups or ()),
                                  tuple(a.backward_groups or ()))
    vocab = user.vocabulary
    problem = AdviceProblem(
        model=user.model, layout=ParallelLayout(user.tp, user.pp, user.dp, user.cp, user.ep,
                                                None if user.etp == user.tp else user.etp), vpp=user.vpp,
        global_batch=user.global_batch_size, stock=None if user.pipemesh else user.stock, pipemesh=pipemesh,
        sequence_parallel=user.sequence_parallel, distributed_optimizer=user.distributed_optimizer,
        overlap_grad_reduce=bool(getattr(a, "overlap_grad_reduce", False)),
        overlap_param_gather=bool(getattr(a, "overlap_param_gather", False)),
        grad_reduce_in_bf16=user.grad_reduce_in_bf16,
        # Megatron requires --overlap-p2p-communication (its default) for V > 1 at PP = 2; its validate_args turns the
        # option off for a V = 1 command, so the user's own flag says whether rows may interleave.
        interleaving_at_two=NO_P2P_OVERLAP_FLAG not in (flag_name(word) for word in user.flags),
        pipemesh_refused=unsupported_message(a),
        vocab_multiple=(getattr(a, "make_vocab_size_divisible_by", 128) or 1) if getattr(a, "pad_vocab_size", True) else 1,
        vocab_size=None if vocab.padded is not None else vocab.size,
        # Costs measured on this CPU mean the rows run here, where megatron-core cannot run TP > 1.
        max_tp=None if rate.given else 1,
        profile=profile, cp_comm=user.cp_comm,
        # Context parallelism runs in Transformer Engine's attention only, which needs a GPU.
        context_parallel=user.model.layer_spec == "te" and rate.given)
    cluster = AdviceCluster(nodes=args.nodes, gpus_per_node=args.gpus_per_node, nic_gbps=links["nic"].gbps,
                            latency_us=message_latency(args, profile).us,
                            intra_node_gbps=links["intra_node"].gbps, device_memory_gb=memory,
                            device_tflops=rate.tflops, mfu=rate.mfu, host_memory_gb=args.host_memory_gb,
                            host_link_gbps=links["host_link"].gbps,
                            nic_via_host=not args.gpudirect_rdma, host_copies_on_compute=not rate.given,
                            collectives="gloo" if not rate.given or getattr(a, "distributed_backend", None) == "gloo"
                            else "nccl", fp8_tflops=rate.fp8_tflops,
                            alltoall_intra_gbps=profile.network.alltoall_intra_gbps
                            if profile is not None and profile.network is not None else None)
    return user, problem, cluster, rate


def _check_fp8(user, rate: DeviceRate, device) -> None:
    """An FP8 command is refused where the GPU has no FP8 (as Transformer Engine refuses it) or its recipe needs
    another GPU, and where no FP8 rate is known to price it with."""
    if not user.model.fp8:
        return
    recipe = getattr(user.args, "fp8_recipe", "delayed")
    if device is not None and device.fp8_tflops is None:
        raise UsageError(f"{MEGATRON_ARGS}: --fp8-format {user.args.fp8}: the {device.name} has no FP8 tensor cores "
                         "(Transformer Engine refuses FP8 there); drop --fp8-format, or plan for a GPU with FP8 "
                         "(H100, H200, L40S, L40, L4, RTX 4090)")
    if device is not None and recipe not in device.fp8_recipes:
        raise UsageError(f"{MEGATRON_ARGS}: --fp8-recipe {recipe} needs Blackwell's tensor cores, which the "
                         f"{device.name} does not have; use --fp8-recipe delayed or tensorwise")
    if rate.fp8_tflops is None:
        raise UsageError(f"{MEGATRON_ARGS}: --fp8-format {user.args.fp8}: no FP8 rate to price it with; give --gpu "
                         "(a GPU with FP8) or --device-fp8-tflops")


def row_flags(user, row, problem, cluster, rate) -> List[str]:
    """The complete flags of ``row``: the user's with the row's replacing what it changes."""
    from ..integration.command_flags import (MICRO_BATCH_FLAG, REPLACED, expand_aliases, pipemesh_flags, replace_flags,
                                             set_value, stock_flags)
    from ..integration.megatron_command import option_aliases

    if row.name == "user":
        return list(user.flags)
    if row.plan is not None:
        off_device = row.plan.recompute_share > 0 or any(r.host_placed for r in row.plan.result.ranks)
        new = pipemesh_flags(row.plan.config, row.layout.tp, row.split, problem.grad_reduce_in_bf16,
                             cluster.budget_bytes / GB if off_device else None, cluster.host_memory_gb,
                             rate.tflops if rate.given else None, cp=row.layout.cp, ep=row.layout.ep,
                             etp=row.layout.etp)
    else:
        new = stock_flags(row.stock, row.layout.tp, row.split, cp=row.layout.cp, ep=row.layout.ep, etp=row.layout.etp)
    flags = replace_flags(user.flags, expand_aliases(REPLACED, option_aliases(REPLACED)), new + list(row.added_flags))
    if row.micro_batch_size is not None:  # its value replaced where the command has it, the rest in place
        names = expand_aliases((MICRO_BATCH_FLAG,), option_aliases((MICRO_BATCH_FLAG,)))
        flags = set_value(flags, names, str(row.micro_batch_size))
    return flags


def assumptions(args, user, problem, cluster, rate) -> List[Dict[str, str]]:
    """What the advice assumed and where each came from ({'what', 'value', 'source'}): the compute rate, the GPU the
    name chose, the link rates, the fixed time of a message, the vocabulary and the memory budget."""
    from ..planning.devices import DeviceError, chosen_form, find_device

    out = [{"what": "compute", "value": rate.source.split(" (")[0] + (f" at MFU {rate.mfu:g}" if rate.given else ""),
            "source": "--device-tflops" if args.device_tflops else "the device table" if rate.given else
            rate.source}]
    if user.model.fp8 and rate.fp8_tflops:
        out.append({"what": "FP8 linears", "value": f"{rate.fp8_tflops:g} TFLOP/s peak at MFU {rate.mfu:g}",
                    "source": "--device-fp8-tflops" if args.device_fp8_tflops else "the device table"})
    try:
        device = find_device(args.gpu) if args.gpu else None
    except DeviceError:
        device = None
    if device is not None:
        out.append({"what": "GPU", "value": device.name, "source": chosen_form(args.gpu, device) or f"--gpu {args.gpu}"})
    for rate_of in link_rates(args, problem.profile).values():
        out.append({"what": rate_of.name, "value": f"{rate_of.gbps:.4g} Gbit/s", "source": rate_of.origin_text()})
    latency = message_latency(args, problem.profile)
    out.append({"what": "message latency", "value": f"{latency.us:.4g} us per pipeline transfer and collective step",
                "source": latency.source})
    vocab = user.vocabulary
    padded = problem.model_for(problem.layout.tp, problem.model.layer_split).vocab_size
    out.append({"what": "vocabulary", "value": f"{padded} rows at TP {problem.layout.tp} ({vocab.size} tokens, padded "
                "as Megatron pads)",
                "source": vocab.source})
    memory = "--device-memory-gib" if args.device_memory_gb else f"the device table ({device.name})" if device else "?"
    out.append({"what": "device memory", "value": f"{cluster.device_memory_gb:g} GiB per GPU, plans within "
                f"{cluster.budget_bytes / GB:.2f} GiB (10% kept free)", "source": memory})
    return out


def report(user, problem, cluster, rate, advice, assumed: Sequence[Dict[str, str]] = ()) -> Dict:
    """The JSON object of the advice (the rows of :data:`.planning.advice.ROWS`, each with its flags and interval), the
    row to run and why (:func:`.planning.advice_error.choose`, with the profile's compute spread), the flags of the
    command the costs leave out (``unpriced``) and what they assumed (``assumed``, :func:`assumptions`)."""
    from ..planning.advice import ROWS, dispatch, tokens_per_s
    from ..planning.advice_error import choose, load_errors
    from ..planning.profile_quality import compute_spread
    from ..planning.flag_inventory import unpriced

    user_row = advice.rows["user"]
    rows: Dict[str, Optional[dict]] = {}
    for name in ROWS:
        row = advice.rows.get(name)
        if row is None:
            rows[name] = None
            continue
        flags = row_flags(user, row, problem, cluster, rate)
        # A PipeMesh row runs through PipeMesh's entry point: a stock pretrain_gpt.py would ignore its schedule.
        program = user.launch.pipemesh_words() if row.plan is not None else user.launch.words
        rows[name] = {
            "flags": flags, "command": shlex.join(list(program) + flags),
            "schedule": row.schedule, "describe": row.describe(),
            "tp": row.layout.tp, "cp": row.layout.cp, "pp": row.layout.pp, "dp": row.layout.dp, "vpp": row.vpp,
            "ep": row.layout.ep, "etp": row.layout.etp or row.layout.tp, "expert_dispatch": dispatch(problem, cluster, row),
            "stage_layers": list(row.stage_layers), "microbatches": row.microbatches,
            "micro_batch_size": row.micro_batch_size or problem.model.micro_batch_size,
            "micro_batch_size_changed": row.micro_batch_size is not None,
            "predicted_iteration_s": row.iteration_s, "tokens_per_s": tokens_per_s(problem, row),
            "peak_memory_gb": [p / GB for p in row.peak_memory_bytes], "fits": row.fits,
            "ratio_to_user": user_row.iteration_s / row.iteration_s,
            "compute_s_per_rank": list(row.compute_s), "keeps_user_layout": row.keeps(user_row)}
    errors = load_errors()
    spread = compute_spread(problem.profile.compute) if problem.profile is not None else 0.0
    choice = choose([row for name in ROWS if (row := advice.rows.get(name)) is not None], errors, spread)
    for name, found in choice.intervals.items():
        rows[name].update(found.to_dict())
    return {"rows": rows, "run": choice.run, "run_reason": choice.reason, "kept_command": choice.kept,
            "error_source": errors.source, "profile_spread": spread,
            "unpriced": [item.to_dict() for item in unpriced(user.changed, user.not_priced_here)],
            "assumed": list(assumed),
            "budget_gb_per_gpu": cluster.budget_bytes / GB, "gpus": cluster.gpus, "rate": rate.source,
            "notes": list(advice.notes), "candidates": advice.candidates, "simulated": dict(advice.search.simulated),
            "search_complete": advice.search.stopped_by is None, "search_stopped_by": advice.search.stopped_by,
            "unsearched_bound_s": advice.search.unsearched_bound_s,
            "search_s": advice.seconds, "search_cpu_s": advice.cpu_seconds}


def text(out: Dict) -> str:
    """The ranked table, the notes and the one command to run."""
    from ..planning.advice import ROWS

    present = [(name, out["rows"][name]) for name in ROWS if out["rows"][name] is not None]
    ranked = sorted(present, key=lambda item: (not item[1]["fits"], item[1]["predicted_iteration_s"]))
    measured = " where the profile has no measurement" if out.get("profile") else ""
    lines = [f"{out['gpus']} GPUs, memory budget {out['budget_gb_per_gpu']:.2f} GiB per GPU; costs at {out['rate']}"
             f"{measured}",
             f"{out['candidates']} layouts x micro-batch sizes x V x splits bounded, simulated "
             f"{out['simulated']['pipemesh']} (PipeMesh) "
             f"and {out['simulated']['stock']} (stock) in {out['search_s']:.1f} s ({out['search_cpu_s']:.1f} CPU-s)", ""]
    header = f"{'row':<18} {'iter s':>9} {'± %':>4} {'tokens/s':>10} {'peak GiB':>9} {'fits':>4} {'x user':>7}  what"
    lines += [header, "-" * len(header)]
    for name, row in ranked:
        experts = row.get("expert_dispatch")
        where = ""
        if experts and experts["ep"] > 1:
            where = (f"; EP{experts['ep']} {'across NICs' if experts['crosses_nic'] else 'inside a node'}: dispatch "
                     f"{experts['forward_ms']:.2f} + {experts['backward_ms']:.2f} ms per MoE layer")
        lines.append(f"{name:<18} {row['predicted_iteration_s']:>9.3f} {100 * row['error']:>4.0f} "
                     f"{row['tokens_per_s']:>10.0f} "
                     f"{max(row['peak_memory_gb']):>9.2f} {'yes' if row['fits'] else 'NO':>4} "
                     f"{row['ratio_to_user']:>7.2f}  {row['describe']}{where}")
    user = out["rows"]["user"]
    if not user["fits"]:
        fitting = ", ".join(name for name, row in ranked if row["fits"]) or "none"
        lines.append(f"\nyour command does not fit: peak {max(user['peak_memory_gb']):.2f} GiB per GPU > budget "
                     f"{out['budget_gb_per_gpu']:.2f} GiB; rows that fit: {fitting}")
    profile = out.get("profile")
    if profile is not None:
        for tp in profile["measured"]:
            lines.append(f"profile {profile['file']} ({profile['device']}), rows at TP {tp}: measured "
                         f"{', '.join(profile['measured'][tp]) or 'nothing'}; assumed {', '.join(profile['assumed'][tp])}")
    for item in out.get("assumed", ()):
        lines.append(f"assumed: {item['what']} {item['value']} ({item['source']})")
    for item in out.get("unpriced", ()):
        lines.append(f"not priced: {(item['flag'] + ' ' + item['value']).strip()}: {item['effect']}; the rows are "
                     "priced without it")
    for note in out["notes"]:
        lines.append(f"note: {note}")
    if out["run"] is None:
        lines.append("\nno row fits the memory: use more GPUs, a smaller --micro-batch-size, or --host-memory-gb")
    else:
        lines.append(f"\nrun ({out['run']}: {out['run_reason']}):\n{out['rows'][out['run']]['command']}")
    return "\n".join(lines)


def matched_profile(args, user, rate):
    """The profile of ``--profile``, refused (one line, exit 2) unless it was measured for this command's model, dtype
    and device kind."""
    from ..planning.profile import ProfileError, dtype_name, load, mismatch

    try:
        profile = load(args.profile)
    except ProfileError as error:
        raise UsageError(f"--profile: {error}") from error
    # A named GPU plans for CUDA; no rate given plans for this CPU; a rate given (--device-tflops) may be either.
    device = "cuda" if args.gpu else None if rate.given else "cpu"
    problem = mismatch(profile, user.model, dtype_name(user.args), device, name=args.profile)
    if problem:
        raise UsageError(problem)
    return profile


def profile_report(path: str, problem, out: Dict, links: Optional[Dict] = None) -> Dict:
    """Which costs the rows took from the profile and which they assumed (per TP the rows use), the link rates
    (:func:`link_rates`) among them; and the rates themselves."""
    from ..planning.profile import coverage

    rates = list((links or {}).values())
    own = problem.model.micro_batch_size
    pairs = sorted({(row["tp"], row.get("micro_batch_size", own)) for row in out["rows"].values() if row is not None})
    # keyed by TP, and by the micro-batch size where a row changes it
    by_tp = {(str(tp) if b == own else f"{tp} mbs {b}"): coverage(problem.profile, tp, b, rates) for tp, b in pairs}
    return {"file": path, "device": f"{problem.profile.device_kind} ({problem.profile.device_name})",
            "measured": {key: found[0] for key, found in by_tp.items()},
            "assumed": {key: found[1] for key, found in by_tp.items()},
            "links": {key: {"gbps": rate.gbps, "source": rate.source, "measured_gbps": rate.measured_gbps}
                      for key, rate in (links or {}).items()}}


def _progress_to_stderr() -> Callable[[str], None]:
    """Progress lines on stderr, each with the seconds since the command started (a search can take minutes)."""
    started = time.perf_counter()

    def say(line: str) -> None:
        print(f"pipemesh plan [{time.perf_counter() - started:6.1f} s] {line}", file=sys.stderr, flush=True)

    return say


def cmd_advice(argv: Sequence[str]) -> int:
    """``pipemesh plan --megatron-args ...`` from its words (after ``plan``)."""
    from ..planning.advice import StopRequest

    stop = StopRequest()
    with _stopped_by_signals(stop, sys.stderr):
        code = _advice(argv, stop)
    return INTERRUPTED_STATUS[stop.reason] if stop else code


def _advice(argv: Sequence[str], stop) -> int:
    started = time.monotonic()
    from ..planning.advice import advise
    from ..planning.planner import NoFeasiblePlan
    from ..planning.pool import jobs_here

    own, tail = split_argv(argv)
    args = build_advice_parser().parse_args(own)
    words = _megatron_words(args, tail)
    progress = None if args.quiet else _progress_to_stderr()
    if progress is not None:
        progress("reading the command with Megatron's argument parser")
    user, problem, cluster, rate = problem_and_cluster(args, words)
    try:
        advice = advise(problem, cluster, search_seconds=args.search_seconds or None, progress=progress,
                        jobs=jobs_here(args.jobs), stop=stop, counted_from=started - ANSWER_MARGIN_S)
    except NoFeasiblePlan as error:
        raise UsageError(str(error)) from error
    if problem.max_tp == 1:
        advice.notes.append("layouts with TP = 1 only: the costs are this machine's CPU, and megatron-core cannot run "
                            "TP > 1 without CUDA (its validate_args reads the GPU's architecture); give --gpu or "
                            "--device-tflops to plan for GPUs")
    intra = link_rates(args, problem.profile)["intra_node"]
    if (intra.source == "default" and (not intra.origin or "PCIe" in intra.origin)
            and any(row is not None and row.layout.tp > 1 for row in advice.rows.values())):
        advice.notes.append(f"rows with TP > 1 price its collectives over PCIe ({intra.gbps:g} Gbit/s per GPU); give "
                            "--intra-node-gbps, or --gpu with its form factor, where NVLink joins the GPUs")
    out = report(user, problem, cluster, rate, advice, assumptions(args, user, problem, cluster, rate))
    if problem.profile is not None:
        out["profile"] = profile_report(args.profile, problem, out, link_rates(args, problem.profile))
    print(json.dumps(out, indent=1) if args.json else text(out), flush=True)
    return 0


class _stopped_by_signals:
    """While the advice runs, SIGINT and SIGTERM ask ``stop`` to end the search (the rows found so far are printed);
    a second one ends the process at once (its search workers end with it). The handlers before are restored."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, stop, err):
        self.stop, self.err, self.before = stop, err, {}

    def __enter__(self):
        for number in self.SIGNALS:
            self.before[number] = signal.signal(number, self.handle)
        return self

    def handle(self, number, frame) -> None:
        name = signal.Signals(number).name
        if self.stop:
            os._exit(INTERRUPTED_STATUS.get(name, 128 + number))
        self.stop.request(name)
        print(f"pipemesh plan: {name}: stopping the search; the rows found so far follow ({name} again quits at "
              "once, without them)", file=self.err, flush=True)

    def __exit__(self, *exc) -> None:
        for number, handler in self.before.items():
            signal.signal(number, handler)
