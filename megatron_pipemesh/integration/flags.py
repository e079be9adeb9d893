"""PipeMesh's Megatron command-line flags and their validation.

Added to Megatron's parser by :func:`megatron_pipemesh.install`; checked right after Megatron's
own ``validate_args`` (so the data-parallel size and virtual pipeline size are known), on every
rank, before any process group exists. A broken rule exits with status 2 and one paragraph naming
the flag, the values, the rule and a valid example.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Tuple, Union

from ..config import PipeMeshConfig, add_megatron_arguments
from ..planning.request import AUTO, GROUPS, PLACED_GROUPS, PLAN_FILE, LoweringSettings
from ..runtime.unsupported import unsupported_message
from ..schedule.config import BACKWARD_FLAG, FORWARD_FLAG, ScheduleConfigError
from ..schedule.plan import RunPlan

if TYPE_CHECKING:
    from .measured import Replanning

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
    plan: Optional[RunPlan]
    """What the runtime runs (None when PipeMesh is off)."""
    timeout_s: float
    """Timeout of every wait on a pipeline transfer (--distributed-timeout-minutes)."""
    flags: PipeMeshConfig = PipeMeshConfig()
    """The flags as given (the source of the runtime's options and of the start-up report)."""
    summary: str = ""
    """One line describing where the plan came from (printed by rank 0)."""
    replan: Optional[Replanning] = None
    """Inputs of the measured re-planning (``--pipemesh-measure-iters``, rank-local planning inputs), None when off."""
    ranks_per_node: Optional[int] = None
    """Ranks per node of the node scope (``--pipemesh-shard-scope node``), checked at start-up; None: other scope."""
    optimizer_instances: Optional[int] = None
    """``--num-distributed-optimizer-instances`` the node scope sets (:func:`apply_megatron_options`); None: Megatron's."""


class PipeMeshArgumentError(ValueError):
    """Invalid PipeMesh flags (message: flag, values, rule, example)."""


def _show(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, tuple) else str(value)


def microbatches_per_iteration(args) -> int:
    return args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)


def check_pipemesh_args(args) -> PipeMeshArgs:
    """Validate PipeMesh's flags against Megatron's validated ``args`` and resolve the run's plan; raise
    PipeMeshArgumentError. Writes nothing into ``args`` (:func:`apply_megatron_options` does, once)."""
    try:
        settings = PipeMeshConfig.from_args(args)
    except ValueError as error:
        raise PipeMeshArgumentError(str(error)) from error
    levels, node = check_sharding(args, settings)
    timeout_s = 60.0 * getattr(args, "distributed_timeout_minutes", 30)
    if not settings.enabled:
        given = [flag for flag, value in ((FORWARD_FLAG, settings.schedule.forward_groups), (BACKWARD_FLAG, settings.schedule.backward_groups))
                 if value is not None]
        if given:
            raise PipeMeshArgumentError(
                f"{' and '.join(given)} given with {SCHEDULE_FLAG} default: the groups only take effect with the PipeMesh "
                f"schedule. Example: {SCHEDULE_FLAG} pipemesh {FORWARD_FLAG} 8 4 {BACKWARD_FLAG} 6 6")
        return PipeMeshArgs(False, None, timeout_s, settings, ranks_per_node=node.ranks_per_node if node else None,
                            optimizer_instances=node.instances if node else None)
    check_memory_meter_args(args, settings)
    plan, summary, replan = _plan(args, settings, levels, node)
    unsupported = unsupported_message(args, plan)  # features that conflict with the levers the plan chose
    if unsupported:
        raise PipeMeshArgumentError(unsupported)
    if plan.sharding and plan.sharding != tuple(levels or ()):  # the plan file's or the planner's levels, same rules
        _, node = check_sharding(args, dataclasses.replace(
            settings, sharding=dataclasses.replace(settings.sharding, levels=plan.sharding)))
    per_node = node.ranks_per_node if plan.sharding and node else None
    return PipeMeshArgs(True, plan, timeout_s, settings, summary, replan, per_node,
                        optimizer_instances=node.instances if node else None)


def apply_megatron_options(args, settings: PipeMeshArgs) -> None:
    """The one Megatron option PipeMesh sets, after the plan is resolved: node-scope sharding runs as Megatron's
    hierarchical distributed optimizer, with one instance per node a data-parallel group spans."""
    if settings.optimizer_instances is not None:
        args.num_distributed_optimizer_instances = settings.optimizer_instances


def check_memory_meter_args(args, settings: PipeMeshConfig) -> None:
    """--pipemesh-measure-memory without CUDA counts saved tensors with default saved-tensor hooks, under which
    autograd hands each backward a new tensor for every saved one: Megatron's fused weight-gradient backward then
    loses the weight's ``grad_added_to_main_grad`` and returns no gradient, and DDP's --overlap-grad-reduce hook
    asserts on the missing ``param.grad``. (On CUDA the allocator meter installs no hooks.)"""
    import torch

    if not (settings.measurement.measure_memory and not torch.cuda.is_available()
            and getattr(args, "gradient_accumulation_fusion", False) and getattr(args, "overlap_grad_reduce", False)):
        return
    raise PipeMeshArgumentError(
        "--pipemesh-measure-memory without CUDA (the saved-tensor meter) with --overlap-grad-reduce and Megatron's "
        "gradient-accumulation fusion is not supported: the meter's saved-tensor hooks give Megatron's fused-wgrad "
        "backward a copy of each weight, so DDP's overlap hook finds no param.grad. Drop --pipemesh-measure-memory, "
        "or add --no-gradient-accumulation-fusion (or drop --overlap-grad-reduce) for the measuring run")


def check_pipeline_args(args, settings: PipeMeshConfig) -> None:
    """The PipeMesh schedule's rules on Megatron's pipeline and batch flags, and on which plan flags combine."""
    forward, backward = settings.schedule.forward_groups, settings.schedule.backward_groups
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
    unsupported = unsupported_message(args)
    if unsupported:
        raise PipeMeshArgumentError(unsupported)
    plan_file = settings.schedule.plan
    auto = "auto" in (forward, backward)
    measure_iters = settings.measurement.measure_iters or 0
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


def plan_source(settings: PipeMeshConfig) -> str:
    """Where the run's plan comes from (:data:`~..planning.request.PLAN_SOURCES`)."""
    if settings.schedule.plan:
        return PLAN_FILE
    if "auto" in (settings.schedule.forward_groups, settings.schedule.backward_groups):
        return AUTO
    return PLACED_GROUPS if settings.placement.activation_placement == "auto" else GROUPS


def _plan(args, settings: PipeMeshConfig, levels, node: Optional[NodeScope]) -> Tuple[RunPlan, str, Optional[Replanning]]:
    """The run's plan, its plan line and its re-planning inputs, resolved from the Megatron surface's request."""
    from .auto_plan import resolve_megatron

    try:
        lowering = LoweringSettings(settings.schedule.recv_lookahead, levels or (), settings.sharding.scope)
    except ValueError as error:
        raise PipeMeshArgumentError(str(error)) from error
    check_pipeline_args(args, settings)
    source = plan_source(settings)
    pp, vpp, m = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size, microbatches_per_iteration(args)
    try:
        return resolve_megatron(args, settings, source, pp, vpp, m, lowering, node.ranks_per_node if node else None)
    except ScheduleConfigError as error:
        if source in (PLAN_FILE, AUTO):
            raise PipeMeshArgumentError(str(error)) from error
        raise PipeMeshArgumentError(
            f"{error} (micro-batches per iteration m = --global-batch-size {args.global_batch_size} / "
            f"(--micro-batch-size {args.micro_batch_size} x data-parallel size {args.data_parallel_size}) = {m}; "
            f"p = {pp}, V = {vpp})") from error
    except ValueError as error:
        raise PipeMeshArgumentError(str(error)) from error


def check_sharding_args(args, settings: PipeMeshConfig) -> Optional[Tuple[str, ...]]:
    """The levels of --pipemesh-sharding, validated against Megatron's ``args`` (:func:`check_sharding`)."""
    return check_sharding(args, settings)[0]


def check_sharding(args, settings: PipeMeshConfig) -> Tuple[Union[None, str, Tuple[str, ...]], Optional[NodeScope]]:
    """Validate --pipemesh-sharding / --pipemesh-shard-scope against Megatron's ``args``: one level per
    virtual chunk (or one for all), the distributed optimizer, no Megatron-FSDP, and what the runtime executes.
    Returns the levels (None without the flag, 'auto' for the planner's) and the node scope's nodes."""
    from ..planning.sharding import FLAG, ShardingError, parse_levels
    from ..schedule.spans import ZERO_STAGE

    if settings.sharding.levels is None:
        if settings.sharding.scope != "data-parallel":
            raise PipeMeshArgumentError(f"--pipemesh-shard-scope {settings.sharding.scope} without {FLAG}: the scope applies "
                                        f"to ZeRO-2/3 chunks. Example: {FLAG} optim optim_grads_params "
                                        f"--pipemesh-shard-scope {settings.sharding.scope}")
        return None, None
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    try:
        levels = parse_levels(settings.sharding.levels, vpp,
                              distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)))
    except ShardingError as error:
        raise PipeMeshArgumentError(str(error)) from error
    if getattr(args, "use_megatron_fsdp", False) or getattr(args, "use_torch_fsdp2", False):
        raise PipeMeshArgumentError(
            f"{FLAG} with {'--use-megatron-fsdp' if getattr(args, 'use_megatron_fsdp', False) else '--use-torch-fsdp2'} is "
            f"invalid: FSDP applies one --data-parallel-sharding-strategy to every chunk, and the optimizer follows the first "
            f"chunk's wrapper (megatron/core/optimizer/__init__.py:1082); per-chunk levels run on the distributed optimizer. "
            f"Example: --use-distributed-optimizer {FLAG} optim optim_grads_params")
    instances = getattr(args, "num_distributed_optimizer_instances", 1) or 1
    node = None
    if settings.sharding.scope == "node":
        node = node_scope(args, settings)
    elif instances > 1:
        raise PipeMeshArgumentError(
            f"{FLAG} with --num-distributed-optimizer-instances {instances} is invalid under --pipemesh-shard-scope "
            f"data-parallel (one instance: shards over all data-parallel ranks). For shards within a node use "
            f"--pipemesh-shard-scope node, which sets the instances to the nodes a data-parallel group spans. "
            f"Example: {FLAG} {_show(settings.sharding.levels)} "
            f"--pipemesh-shard-scope node")
    if levels == "auto":
        auto_groups = settings.schedule.forward_groups == "auto" and settings.schedule.backward_groups in ("auto", None)
        if not (settings.enabled and auto_groups and settings.costs.memory_budget_gb and not settings.measurement.measure_iters):
            raise PipeMeshArgumentError(
                f"{FLAG} auto chooses the levels jointly with the groups and recomputation at start-up: it needs "
                f"{SCHEDULE_FLAG} pipemesh {FORWARD_FLAG} auto {BACKWARD_FLAG} auto and an explicit "
                f"--pipemesh-memory-budget-gb (the same plan on every rank), without --pipemesh-measure-iters; or take "
                f"the levels `pipemesh plan --sharding auto` prints. Example: {SCHEDULE_FLAG} pipemesh {FORWARD_FLAG} "
                f"auto {BACKWARD_FLAG} auto --pipemesh-memory-budget-gb 40 {FLAG} auto")
        return "auto", node  # resolved by the planner (check_pipemesh_args), then checked like given levels
    if any(ZERO_STAGE[level] > 1 for level in levels):
        example = f"--pipeline-schedule pipemesh --use-distributed-optimizer --overlap-param-gather {FLAG} {' '.join(levels)}"
        if not settings.enabled:
            raise PipeMeshArgumentError(f"{FLAG} {' '.join(levels)} needs {SCHEDULE_FLAG} pipemesh: the schedule places the "
                                        f"gathers and reductions of ZeRO-2/3 chunks around its groups. Example: {example}")
        if getattr(args, "ddp_param_name_patterns_for_fp32_local_accumulation", None):
            raise PipeMeshArgumentError(
                f"{FLAG} {' '.join(levels)} with --ddp-param-name-patterns-for-fp32-local-accumulation is not supported: "
                f"those parameters accumulate in separate fp32 main gradients outside the gradient buffer that ZeRO-2/3 "
                f"chunks free and reduce per group. Drop the flag or use {FLAG} optim")
        if "optim_grads_params" in levels:
            if not getattr(args, "overlap_param_gather", False):
                raise PipeMeshArgumentError(
                    f"{FLAG} {' '.join(levels)} needs --overlap-param-gather: without it Megatron's optimizer step "
                    f"all-gathers every chunk's parameters at once, which a ZeRO-3 chunk gathers per group. Example: {example}")
            for flag, given in (("--save", getattr(args, "save", None)),
                                ("--log-params-norm", getattr(args, "log_params_norm", False)),
                                ("--check-weight-hash-across-dp-replicas-interval",
                                 getattr(args, "check_weight_hash_across_dp_replicas_interval", None))):
                if given:
                    raise PipeMeshArgumentError(
                        f"{FLAG} optim_grads_params with {flag} is not supported: between iterations a ZeRO-3 chunk holds "
                        f"only its parameter shard (the rest of its parameters is gathered per group), which {flag} would "
                        f"read. Drop {flag} or use {FLAG} optim_grads")
    return levels, node


RANKS_PER_NODE_FLAG = "--pipemesh-ranks-per-node"


def detect_ranks_per_node(given: Optional[int], environ) -> Tuple[int, str]:
    """Ranks per node and where the number came from: ``--pipemesh-ranks-per-node``, else what the launcher says
    (:func:`.host_memory.launcher_ranks_per_node`: torchrun's ``LOCAL_WORLD_SIZE``, Slurm's task counts)."""
    if given is not None:
        if given < 1:
            raise PipeMeshArgumentError(f"{RANKS_PER_NODE_FLAG} {given} is invalid: it must be >= 1. "
                                        f"Example: {RANKS_PER_NODE_FLAG} 8")
        return given, RANKS_PER_NODE_FLAG
    from .host_memory import launcher_ranks_per_node

    try:
        found = launcher_ranks_per_node(environ)
    except ValueError as error:
        raise PipeMeshArgumentError(f"--pipemesh-shard-scope node: {error}. Give it: {RANKS_PER_NODE_FLAG} 8") from error
    if found is None:
        raise PipeMeshArgumentError(
            f"--pipemesh-shard-scope node needs the number of ranks per node: the launcher sets none of LOCAL_WORLD_SIZE "
            f"(torchrun), SLURM_NTASKS_PER_NODE / SLURM_TASKS_PER_NODE (Slurm) or OMPI_COMM_WORLD_LOCAL_SIZE / "
            f"MPI_LOCALNRANKS (mpirun). Give it: {RANKS_PER_NODE_FLAG} 8")
    if len(set(found.nodes)) > 1:  # Slurm's "8(x2),4": nodes with different task counts
        raise PipeMeshArgumentError(
            f"--pipemesh-shard-scope node with {found.source}={environ[found.source]} is invalid: the nodes run "
            f"different numbers of ranks, so the data-parallel groups cannot split evenly into nodes. Launch the same "
            f"number of tasks on every node (e.g. --ntasks-per-node 8)")
    return found.count, found.source


@dataclass(frozen=True)
class NodeScope:
    """``--pipemesh-shard-scope node`` as Megatron's hierarchical distributed optimizer."""

    ranks_per_node: int
    """Ranks per node (the runtime re-checks the real groups at start-up)."""
    instances: int
    """Distributed-optimizer instances: the nodes a data-parallel group spans."""


def node_scope(args, settings: PipeMeshConfig, environ=None) -> NodeScope:
    """``--pipemesh-shard-scope node``: the ranks per node and the number of distributed-optimizer instances (nodes
    a data-parallel group spans), after checking that every data-parallel group splits evenly into nodes."""
    from ..planning.sharding import ShardingError, shard_size

    environ = os.environ if environ is None else environ
    per_node, source = detect_ranks_per_node(settings.sharding.ranks_per_node, environ)
    rank = int(environ.get("RANK", getattr(args, "rank", 0) or 0))
    where = f"rank {rank}: {source}={per_node}"
    tp, cp = args.tensor_model_parallel_size, getattr(args, "context_parallel_size", 1) or 1
    dp = args.data_parallel_size * cp
    world = getattr(args, "world_size", None) or per_node
    if getattr(args, "use_tp_pp_dp_mapping", False):
        raise PipeMeshArgumentError(f"--pipemesh-shard-scope node with --use-tp-pp-dp-mapping is invalid ({where}): that "
                                    f"rank order puts pipeline stages between data-parallel ranks, so a node does not hold "
                                    f"whole data-parallel blocks. Drop --use-tp-pp-dp-mapping")
    if world % per_node or per_node % tp:
        raise PipeMeshArgumentError(
            f"--pipemesh-shard-scope node is invalid ({where}): the world size ({world}) must split into nodes of "
            f"{per_node} ranks and each node must hold whole tensor-parallel groups (size {tp}). Fix the launcher's ranks "
            f"per node or {RANKS_PER_NODE_FLAG}, e.g. {RANKS_PER_NODE_FLAG} {max(tp, 1)}")
    if per_node > tp * dp and per_node % (tp * dp):
        raise PipeMeshArgumentError(
            f"--pipemesh-shard-scope node is invalid ({where}): a node of {per_node} ranks cuts through the data-parallel "
            f"groups ({tp * dp} consecutive ranks each, tensor x data parallel); it must hold whole groups or split one "
            f"evenly. Fix the ranks per node (e.g. {RANKS_PER_NODE_FLAG} {tp * dp}) or use --pipemesh-shard-scope "
            f"data-parallel")
    try:
        shard = shard_size("node", dp, tp, per_node)
    except ShardingError as error:
        raise PipeMeshArgumentError(f"{error} ({where})") from error
    instances = dp // shard
    given = getattr(args, "num_distributed_optimizer_instances", 1) or 1
    if given not in (1, instances):
        raise PipeMeshArgumentError(
            f"--num-distributed-optimizer-instances {given} with --pipemesh-shard-scope node is invalid ({where}): the "
            f"node scope sets it to the nodes a data-parallel group of {dp} spans ({instances}, {shard} per node). "
            f"Drop --num-distributed-optimizer-instances")
    if instances > 1 and importlib.util.find_spec("einops") is None:
        raise PipeMeshArgumentError(
            f"--pipemesh-shard-scope node ({instances} distributed-optimizer instances) needs the einops package: "
            f"Megatron builds the groups of its hierarchical distributed optimizer with it "
            f"(megatron/core/parallel_state.py:401). Install it: pip install 'einops~=0.8'")
    return NodeScope(per_node, instances)


def fail(error: Exception) -> "NoReturn":  # noqa: F821
    """Print one paragraph and exit with status 2, like argparse (on every rank)."""
    print(f"megatron_pipemesh: error: {error}", file=sys.stderr, flush=True)
    raise SystemExit(2)
