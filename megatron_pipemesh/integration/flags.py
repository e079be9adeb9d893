"""PipeMesh's Megatron command-line flags and their validation.

Added to Megatron's parser by :func:`megatron_pipemesh.install`; checked right after Megatron's
own ``validate_args`` (so the data-parallel size and virtual pipeline size are known), on every
rank, before any process group exists. A broken rule exits with status 2 and one paragraph naming
the flag, the values, the rule and a valid example.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Optional, Tuple

from ..config import PipeMeshConfig, add_megatron_arguments
from ..schedule.config import BACKWARD_FLAG, FORWARD_FLAG, ScheduleConfig, ScheduleConfigError

SCHEDULE_FLAG = "--pipeline-schedule"


def add_pipemesh_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add PipeMesh's flags (declared once, in :class:`~megatron_pipemesh.config.PipeMeshConfig`) to a
    Megatron parser (idempotent)."""
    return add_megatron_arguments(parser)


@dataclass(frozen=True)
class PipeMeshArgs:
    """The validated PipeMesh settings of a run."""

    enabled: bool
    """True with --pipeline-schedule pipemesh."""
    forward_groups: Optional[Tuple[int, ...]]
    """Validated forward groups; None: Megatron's group size decides at run time."""
    backward_groups: Optional[Tuple[int, ...]]
    """Validated backward groups; None: the forward groups."""
    recv_lookahead: int
    """Compute ops between posting a receive and its consumer."""
    timeout_s: float
    """Timeout of every wait on a pipeline transfer (--distributed-timeout-minutes)."""
    config: Optional[ScheduleConfig]
    """The schedule of a training iteration (None when PipeMesh is off)."""
    recompute: Optional[dict] = None
    """(pipeline rank, chunk, micro-batch) -> 'selective' | 'full' from a plan; None keeps all activations."""
    summary: str = ""
    """One line describing where the plan came from (printed by rank 0)."""
    replan: Optional[dict] = None
    """Inputs of the measured re-planning (``--pipemesh-measure-iters``), None when off."""
    flags: PipeMeshConfig = PipeMeshConfig()
    """The flags as given (the source of the runtime's options and of the start-up report)."""


class PipeMeshArgumentError(ValueError):
    """Invalid PipeMesh flags (message: flag, values, rule, example)."""


def _show(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, tuple) else str(value)


def microbatches_per_iteration(args) -> int:
    return args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)


def check_pipemesh_args(args) -> PipeMeshArgs:
    """Validate PipeMesh's flags against Megatron's validated ``args``; raise PipeMeshArgumentError."""
    try:
        settings = PipeMeshConfig.from_args(args)
    except ValueError as error:
        raise PipeMeshArgumentError(str(error)) from error
    forward, backward = settings.forward_groups, settings.backward_groups
    enabled = settings.enabled
    timeout_s = 60.0 * getattr(args, "distributed_timeout_minutes", 30)
    lookahead = settings.recv_lookahead
    if not enabled:
        given = [flag for flag, value in ((FORWARD_FLAG, forward), (BACKWARD_FLAG, backward)) if value is not None]
        if given:
            raise PipeMeshArgumentError(
                f"{' and '.join(given)} given with {SCHEDULE_FLAG} default: the groups only take effect with the PipeMesh "
                f"schedule. Example: {SCHEDULE_FLAG} pipemesh {FORWARD_FLAG} 8 4 {BACKWARD_FLAG} 6 6")
        return PipeMeshArgs(False, None, None, lookahead, timeout_s, None, flags=settings)
    if lookahead < 0:
        raise PipeMeshArgumentError(f"--pipemesh-recv-lookahead {lookahead} is invalid: it must be >= 0. Example: --pipemesh-recv-lookahead 1")
    pp = args.pipeline_model_parallel_size
    vpp = args.virtual_pipeline_model_parallel_size
    if pp < 2:
        raise PipeMeshArgumentError(
            f"{SCHEDULE_FLAG} pipemesh with --pipeline-model-parallel-size {pp} is invalid: the PipeMesh schedule needs "
            f"pipeline parallelism. Example: --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2")
    if vpp is None or vpp < 2:
        raise PipeMeshArgumentError(
            f"{SCHEDULE_FLAG} pipemesh without virtual pipeline stages (virtual pipeline size {vpp}) is invalid: PipeMesh "
            f"overlaps a chunk's data-parallel communication with other chunks' compute, so each rank needs at least 2 "
            f"model chunks. Example: --num-virtual-stages-per-pipeline-rank 2 (or --num-layers-per-virtual-pipeline-stage)")
    from .unsupported import check_unsupported_args
    check_unsupported_args(args)
    plan_file = settings.plan
    auto = "auto" in (forward, backward)
    measure_iters = settings.measure_iters or 0
    if measure_iters < 0 or (measure_iters and not auto):
        raise PipeMeshArgumentError(
            f"--pipemesh-measure-iters {measure_iters} is invalid: it must be >= 0 and needs {FORWARD_FLAG} auto "
            f"{BACKWARD_FLAG} auto (the measurements re-plan the groups). Example: {FORWARD_FLAG} auto {BACKWARD_FLAG} auto "
            "--pipemesh-measure-iters 3")
    if auto and {forward, backward} - {"auto", None}:
        raise PipeMeshArgumentError(f"{FORWARD_FLAG} {_show(forward)} {BACKWARD_FLAG} {_show(backward)} mixes 'auto' and a "
                                    f"list; the planner chooses both. Example: {FORWARD_FLAG} auto {BACKWARD_FLAG} auto")
    if plan_file and (forward or backward):
        raise PipeMeshArgumentError(f"--pipemesh-plan {plan_file} and {FORWARD_FLAG}/{BACKWARD_FLAG} both given; the plan "
                                    f"file holds the groups. Drop one of them")
    if getattr(args, "rampup_batch_size", None) and (forward or backward or plan_file):
        raise PipeMeshArgumentError(
            f"{FORWARD_FLAG}/{BACKWARD_FLAG} (lists or auto) or --pipemesh-plan with --rampup-batch-size is invalid: groups "
            f"and plans are made for one number of micro-batches per iteration, which batch-size ramp-up changes. Drop "
            f"--rampup-batch-size or the group flags")
    m = microbatches_per_iteration(args)
    if auto or plan_file:
        from .auto_plan import auto_plan, load_plan
        try:
            resolved = load_plan(plan_file, pp, vpp, m) if plan_file else auto_plan(args, pp, vpp, m)
        except (ValueError, ScheduleConfigError) as error:
            raise PipeMeshArgumentError(str(error)) from error
        return PipeMeshArgs(True, resolved.config.forward_groups, resolved.config.backward_groups, lookahead, timeout_s,
                            resolved.config, resolved.recompute, resolved.summary, resolved.replan, flags=settings)
    group_size = getattr(args, "microbatch_group_size_per_vp_stage", None) or pp
    try:
        if forward is None and backward is None:
            config = ScheduleConfig.uniform(pp, vpp, m, group_size)
        else:
            config = ScheduleConfig(pp, vpp, m, forward or (), backward or ())
    except ScheduleConfigError as error:
        raise PipeMeshArgumentError(
            f"{error} (micro-batches per iteration m = --global-batch-size {args.global_batch_size} / "
            f"(--micro-batch-size {args.micro_batch_size} x data-parallel size {args.data_parallel_size}) = {m}; "
            f"p = {pp}, V = {vpp})") from error
    forward_groups, backward_groups = config.forward_groups if forward else None, config.backward_groups if backward else None
    if settings.activation_placement == "auto":  # given groups: place / recompute under the budget
        from .auto_plan import place_given_groups
        try:
            resolved = place_given_groups(args, config)
        except (ValueError, ScheduleConfigError) as error:
            raise PipeMeshArgumentError(str(error)) from error
        return PipeMeshArgs(True, config.forward_groups, config.backward_groups, lookahead, timeout_s, config,
                            resolved.recompute, resolved.summary, resolved.replan, flags=settings)
    return PipeMeshArgs(True, forward_groups, backward_groups, lookahead, timeout_s, config, flags=settings)


def fail(error: Exception) -> "NoReturn":  # noqa: F821
    """Print one paragraph and exit with status 2, like argparse (on every rank)."""
    print(f"megatron_pipemesh: error: {error}", file=sys.stderr, flush=True)
    raise SystemExit(2)
