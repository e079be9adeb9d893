"""``--forward-groups auto`` / ``--pipemesh-plan FILE`` inside training: a plan from Megatron's args.

``auto`` runs the planner at argument-validation time (every rank computes the same plan from the
same arguments, so no communication is needed) with analytic costs from the model shape in
Megatron's args and the cluster description in PipeMesh's flags. ``--pipemesh-plan FILE`` loads a
plan saved by ``pipemesh plan --output FILE`` (checked against this run's p, V and m; its levels,
host placement included, are used as they are).

``--pipemesh-activation-placement`` (:class:`~..planning.planner.PlannerOptions`) chooses the memory
levers: with ``auto`` the planner places chunk-micro-batches on the host or recomputes them, with
``--forward-groups auto`` or, for given groups, a memory budget (:func:`place_given_groups`). Its
inputs that differ between ranks are agreed on at the first call (:mod:`.measured`): the free device
memory, the host-link bandwidth measured at start-up on GPU (:mod:`..runtime.host_link`; on CPU the
planning default) and the host memory share per rank (:mod:`.host_memory`: MemAvailable over the launcher's
ranks per node, also the cap of ``--pipemesh-host-memory-gb``; a plan file that needs more than the smallest share
over the ranks is refused by every rank at the first call, or at parse time in a one-rank run).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional, Tuple

from ..config import PipeMeshConfig
from ..planning.clusters import flat_cluster
from ..planning.defaults import DEFAULT_HOST_LINK_GBPS, MEMORY_MARGIN, MFU
from ..planning.costs import GB, ClusterSpec, ModelSpec
from ..planning.devices import Device, DeviceError, DeviceRate, find_device, rate_for
from ..planning.layout import LayerSplit
from ..planning.planner import NoFeasiblePlan, PlannerOptions
from ..planning.planner_options import RECOMPUTE_ONLY
from ..planning.request import (AUTO, GROUPS, PLACED_GROUPS, PLAN_FILE, SHARDING_AUTO, LoweringSettings,
                                PlanRequest)
from ..planning.resolve import Resolution, load_plan_file, resolve
from ..runtime.cpu_rate import measured_cpu_tflops
from ..schedule.config import ScheduleConfig
from ..schedule.plan import RunPlan
from .host_memory import check_plan_fits_host, host_share
from .measured import Replanning
from .vocabulary import vocabulary


def _device_defaults(args) -> Tuple[Optional[Device], Optional[float]]:
    """(the local accelerator's entry in the known table, memory budget GiB), or (None, None) without CUDA."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        return None, None
    if not torch.cuda.is_available():
        return None, None
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    free, _ = torch.cuda.mem_get_info(index)
    try:
        device = find_device(torch.cuda.get_device_name(index))
    except DeviceError:
        device = None  # a name of two models alike: its peak is not known (--pipemesh-device-tflops)
    return device, free / GB * (1 - MEMORY_MARGIN)


def layer_spec_fields(args) -> dict:
    """ModelSpec's layer-spec fields from Megatron's args: Transformer Engine (flash attention), GQA, SwiGLU, RoPE, bf16
    gradient reduction, dropout, linear biases, the norm, the learned position table's rows, FP8 linears, and
    whether the output layer shares the embedding."""
    groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else None
    return {"layer_spec": "te" if getattr(args, "transformer_impl", "local") == "transformer_engine" else "local",
            "num_query_groups": groups, "swiglu": bool(getattr(args, "swiglu", False)),
            "bias_activation_fusion": bool(getattr(args, "bias_swiglu_fusion", False) if getattr(args, "swiglu", False)
                                           else getattr(args, "bias_gelu_fusion", False)),
            "position_embedding": "rope" if getattr(args, "position_embedding_type", "learned_absolute") == "rope"
            else "learned_absolute",
            "grad_bytes": 2 if getattr(args, "grad_reduce_in_bf16", False) else 4,
            "hidden_dropout": float(getattr(args, "hidden_dropout", 0.1)),
            "attention_dropout": float(getattr(args, "attention_dropout", 0.1)),
            "linear_bias": bool(getattr(args, "add_bias_linear", True)),
            "normalization": getattr(args, "normalization", "LayerNorm") or "LayerNorm",
            "max_position_embeddings": getattr(args, "max_position_embeddings", None),
            "fp8": bool(getattr(args, "fp8", None)),
            "tied_embeddings": not getattr(args, "untie_embeddings_and_output_weights", False)}


def layer_split(args) -> LayerSplit:
    """Which stage holds which layers, from Megatron's split flags (``--pipeline-model-parallel-layout``,
    ``--decoder-first/last-pipeline-num-layers``, ``--account-for-embedding/loss-in-pipeline-split``)."""
    layout = getattr(args, "pipeline_model_parallel_layout", None)
    if layout:
        return LayerSplit.of_layout(str(layout))
    return LayerSplit(first=getattr(args, "decoder_first_pipeline_num_layers", None),
                      last=getattr(args, "decoder_last_pipeline_num_layers", None),
                      embedding_counts=bool(getattr(args, "account_for_embedding_in_pipeline_split", False)),
                      loss_counts=bool(getattr(args, "account_for_loss_in_pipeline_split", False)))


def _on_cuda() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return torch.cuda.is_available()


def collectives(args) -> str:
    """The library of the data-parallel collectives (:attr:`ClusterSpec.collectives`): Megatron's
    ``--distributed-backend`` (``gloo`` on CPU, where our CPU layer sets it), else NCCL with CUDA and gloo without."""
    backend = getattr(args, "distributed_backend", None) or ("nccl" if _on_cuda() else "gloo")
    return "gloo" if backend == "gloo" else "nccl"


def _flags(args, settings: Optional[PipeMeshConfig]) -> PipeMeshConfig:
    """PipeMesh's settings of ``args`` (the one reading of its flags), unless the caller has them."""
    return PipeMeshConfig.from_args(args) if settings is None else settings


def placement_mode(args, settings: Optional[PipeMeshConfig] = None) -> str:
    return _flags(args, settings).placement.activation_placement or RECOMPUTE_ONLY


def host_link_gbps(args, settings: Optional[PipeMeshConfig] = None) -> Tuple[float, str, bool]:
    """(Gbit/s, where it came from, whether it is rank-local) of the host link the planner assumes:
    ``--pipemesh-host-link-gbps``; else, when 'auto' placement may offload on a GPU, measured once now
    (:func:`..runtime.host_link.startup_host_link`); else the planning default."""
    settings = _flags(args, settings)
    given = settings.placement.host_link_gbps
    if given:
        return float(given), "given", False
    if placement_mode(args, settings) == "auto" and _on_cuda():
        from ..runtime.host_link import startup_host_link
        link = startup_host_link()
        return link.planning_gbps, (f"measured d2h {link.d2h_gbps:.0f} / h2d {link.h2d_gbps:.0f} Gbit/s with "
                                    f"{link.nbytes >> 20} MiB pinned copies"), True
    return DEFAULT_HOST_LINK_GBPS, "default", False


def machine_host_share_bytes() -> Optional[float]:
    """This rank's share of the host's available memory (:func:`.host_memory.host_share`: MemAvailable capped by the
    job's cgroup, over the launcher's ranks per node, minus the margin)."""
    share = host_share()
    return None if share is None else share.bytes


def host_budget_bytes(args, settings: Optional[PipeMeshConfig] = None) -> Tuple[Optional[float], bool]:
    """(host memory per rank offloaded activations may fill, whether it is rank-local): the machine's
    share, capped by ``--pipemesh-host-memory-gb`` when given."""
    share = machine_host_share_bytes()
    given = _flags(args, settings).placement.host_memory_gb
    if given is None:
        return share, share is not None
    if share is not None and share < given * GB:
        return share, True  # the flag asks for more than this machine has free
    return given * GB, False


def megatron_planner_options(args, settings: Optional[PipeMeshConfig] = None) -> Tuple[PlannerOptions, Optional[float], bool]:
    """(the planner's placement options, the host link Gbit/s for the costs, whether some input is rank-local)."""
    settings = _flags(args, settings)
    mode = placement_mode(args, settings)
    if mode != "auto":
        return PlannerOptions(activation_placement=mode), None, False
    link, _, link_local = host_link_gbps(args, settings)
    host_budget, budget_local = host_budget_bytes(args, settings)
    return PlannerOptions(activation_placement=mode, host_budget_bytes=host_budget), link, link_local or budget_local


def padded_vocab_size(args) -> int:
    """The vocabulary Megatron's output layer has (:mod:`.vocabulary`: the size its tokenizer gives, padded per TP as
    Megatron pads it after argument validation; GPT-2's where nothing names a size)."""
    return vocabulary(args).padded_for(args.tensor_model_parallel_size,
                                       getattr(args, "make_vocab_size_divisible_by", 128) or 1,
                                       bool(getattr(args, "pad_vocab_size", True)))


def model_and_cluster(args, rate: DeviceRate, host_link: Optional[float] = None, settings: Optional[PipeMeshConfig] = None,
                      ranks_per_node: Optional[int] = None) -> Tuple[ModelSpec, ClusterSpec]:
    """The model of Megatron's args and the cluster of PipeMesh's cost flags (``ranks_per_node``: the node scope's
    nodes, found by the flag check; default --pipemesh-ranks-per-node)."""
    settings = _flags(args, settings)
    dtype_bytes = 2 if (getattr(args, "bf16", False) or getattr(args, "fp16", False)) else 4
    model = ModelSpec(num_layers=args.num_layers, hidden_size=args.hidden_size,
                      num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                      micro_batch_size=args.micro_batch_size, vocab_size=padded_vocab_size(args),
                      ffn_hidden_size=getattr(args, "ffn_hidden_size", None), dtype_bytes=dtype_bytes,
                      dropout_mask_bytes=1 if _on_cuda() else None, layer_split=layer_split(args),
                      **layer_spec_fields(args))
    cluster = flat_cluster(tp=args.tensor_model_parallel_size, dp=args.data_parallel_size, device_tflops=rate.tflops,
                           mfu=rate.mfu, dp_gbps=settings.costs.dp_gbps, p2p_gbps=settings.costs.p2p_gbps,
                           sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
                           distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)),
                           host_link_gbps=host_link or settings.placement.host_link_gbps,
                           host_copies_on_compute=not _on_cuda(), collectives=collectives(args),
                           devices_per_node=ranks_per_node or settings.sharding.ranks_per_node,
                           overlap_grad_reduce=bool(getattr(args, "overlap_grad_reduce", False)),
                           overlap_param_gather=bool(getattr(args, "overlap_param_gather", False)),
                           cp=getattr(args, "context_parallel_size", 1) or 1, cp_comm=priced_cp_comm(args),
                           fp8_tflops=rate.fp8_tflops)
    return model, cluster


def priced_cp_comm(args) -> str:
    """The context-parallel exchange the costs price: the command's first --cp-comm-type where they price it."""
    from ..planning.specs import CP_COMM_TYPES

    kind = (getattr(args, "cp_comm_type", None) or ["p2p"])[0]
    return kind if kind in CP_COMM_TYPES else "p2p"


def device_rate(args, what: str, settings: Optional[PipeMeshConfig] = None) -> DeviceRate:
    """``--pipemesh-device-tflops``, else the known peak of this GPU, else (without CUDA) the CPU's measured matmul
    rate; a GPU of unknown peak is a ValueError naming the flag."""
    settings = _flags(args, settings)
    given = settings.costs.device_tflops
    rate = rate_for(given, "--pipemesh-device-tflops", None if given else _device_defaults(args)[0],
                    settings.costs.mfu or MFU, None if _on_cuda() else measured_cpu_tflops)
    if rate is not None:
        return rate if rate.given else dataclasses.replace(rate, rank_local=True)  # each rank measured its own
    raise ValueError(f"{what} needs --pipemesh-device-tflops: the peak 16-bit TFLOP/s of this GPU is not known here. "
                     "Example: --pipemesh-device-tflops 312")


def _budget_and_rate(args, what: str, settings: Optional[PipeMeshConfig] = None) -> Tuple[float, DeviceRate]:
    settings = _flags(args, settings)
    budget = settings.costs.memory_budget_gb or _device_defaults(args)[1]
    if budget is None:
        raise ValueError(f"{what} needs --pipemesh-memory-budget-gb on a machine without CUDA (there is "
                         "no device memory to read). Example: --pipemesh-memory-budget-gb 8")
    return budget, device_rate(args, what, settings)


@dataclass(frozen=True)
class FoundInputs:
    """What this rank found for the planner beyond the request itself: said in the plan line, and agreed on by the
    ranks at the first call where it is rank-local."""

    what: str
    """The flags that asked for the planner (named in its errors)."""
    rate: DeviceRate
    """The device rate the costs assume."""
    budget_gb: float
    """The device memory budget (GiB)."""
    budget_given: bool
    """--pipemesh-memory-budget-gb was given (else read from this rank's free memory)."""
    host_link: Optional[float]
    """The host link of 'auto' placement (Gbit/s), None for other modes."""
    host_local: bool
    """The host link or host memory was found by this rank."""
    profile: Optional[str]
    """--pipemesh-profile (its times are the request's measured times when the file exists)."""


def megatron_request(args, settings: PipeMeshConfig, source: str, pp: int, vpp: int, microbatches: int,
                     lowering: LoweringSettings = LoweringSettings(),
                     ranks_per_node: Optional[int] = None) -> Tuple[PlanRequest, Optional[FoundInputs]]:
    """The Megatron surface's adapter: the run's :class:`PlanRequest` from Megatron's args and PipeMesh's flags, and
    (for the planner's sources) what this rank found for it. Raises ValueError naming the flag to give."""
    groups = (settings.schedule.forward_groups, settings.schedule.backward_groups)
    given = dict(pp=pp, vpp=vpp, microbatches=microbatches, source=source, lowering=lowering,
                 forward_groups=None if "auto" in groups else groups[0],
                 backward_groups=None if "auto" in groups else groups[1],
                 group_size=getattr(args, "microbatch_group_size_per_vp_stage", None), plan_file=settings.schedule.plan)
    if source not in (AUTO, PLACED_GROUPS):
        return PlanRequest(**given), None
    what = "--forward-groups auto" if source == AUTO else "--pipemesh-activation-placement auto with given groups"
    budget, rate = _budget_and_rate(args, what, settings)
    options, link, host_local = megatron_planner_options(args, settings)
    model, cluster = model_and_cluster(args, rate, link, settings, ranks_per_node)
    profile = settings.measurement.profile
    measured, loaded = None, None
    if source == AUTO and profile and os.path.exists(profile):
        from .measured import load_profile
        loaded = load_profile(profile)
        measured = loaded.run_times
        if loaded.compute:  # per-layer measurements (pipemesh profile): only for the model they were measured for
            from ..planning.profile import dtype_name, mismatch
            import torch
            problem = mismatch(loaded, model, dtype_name(args), "cuda" if torch.cuda.is_available() else "cpu",
                               name=f"--pipemesh-profile {profile}")
            if problem:
                raise ValueError(problem)
        else:
            loaded = None
    request = PlanRequest(**given, model=model, cluster=cluster, budget_bytes=budget * GB, planner=options,
                          measured=measured, profile=loaded)
    return request, FoundInputs(what, rate, budget, bool(settings.costs.memory_budget_gb), link, host_local, profile)


def resolve_megatron(args, settings: PipeMeshConfig, source: str, pp: int, vpp: int, microbatches: int,
                     lowering: LoweringSettings = LoweringSettings(),
                     ranks_per_node: Optional[int] = None) -> Tuple[RunPlan, str, Optional[Replanning]]:
    """The run's plan, its plan line ('' for given groups) and its re-planning inputs (None: nothing to agree on or
    measure). Raises ValueError with a user-facing message."""
    request, found = megatron_request(args, settings, source, pp, vpp, microbatches, lowering, ranks_per_node)
    try:
        resolution = resolve(request)
    except NoFeasiblePlan as error:
        if source == AUTO:
            raise ValueError(f"--forward-groups auto: {error}") from error
        raise ValueError(f"{found.what}: {error}. Use --forward-groups auto --backward-groups auto, a larger budget, or "
                         "a smaller --micro-batch-size") from error
    plan = resolution.plan
    if source == PLAN_FILE:  # made elsewhere: its pinned pool must fit the smallest share of host memory
        line = f"PipeMesh plan from {request.plan_file}: {plan.describe()}"
        share = host_share() if plan.host_placement else None
        if share is None or getattr(args, "world_size", 1) <= 1:
            check_plan_fits_host(plan, f"--pipemesh-plan {request.plan_file}", share)
            return plan, line, None
        return plan, line, Replanning(request, host_fit=share)  # ranks read differently: they agree at the first call
    if source == GROUPS:
        return plan, "", None
    return plan, plan_line(request, found, resolution), replanning(request, found, settings)


def plan_line(request: PlanRequest, found: FoundInputs, resolution: Resolution) -> str:
    """The start-up line of a planned run: where its costs came from, the budget, the placement inputs, the plan."""
    note = _placement_note(request.planner, found.host_link)
    chosen = resolution.chosen
    if request.source == PLACED_GROUPS:
        return (f"PipeMesh plan (given groups, {costs_source(found.rate)}, budget {found.budget_gb:.2f} GiB{note}): "
                f"{chosen.summary()}")
    costs = f"measured costs from {found.profile}" if request.measured else costs_source(found.rate)
    line = (f"PipeMesh plan (auto, {costs}, {resolution.candidates} candidates, budget {found.budget_gb:.2f} GiB"
            f"{note}): {chosen.summary()}")
    if request.lowering.sharding == SHARDING_AUTO:
        line += f"; sharding {' '.join(chosen.sharding.spec.levels)}"
    return line


def replanning(request: PlanRequest, found: FoundInputs, settings: PipeMeshConfig) -> Optional[Replanning]:
    """What the ranks re-plan at the first call (None: nothing). A budget read from this rank's free memory, a host
    link or host memory found here, or a measured CPU rate differ between ranks; the schedule's first call (a point
    every rank reaches, with process groups) re-plans for the minimum over all ranks when they differ. With
    ``--pipemesh-measure-iters`` (and no saved profile) the measured costs re-plan once more."""
    if request.lowering.sharding == SHARDING_AUTO:
        return None  # the levels, groups and levers are chosen together at start-up on an explicit budget
    measure_iters = (settings.measurement.measure_iters or 0) if request.source == AUTO and not request.measured else 0
    agree_on_budget = not found.budget_given
    if not (measure_iters or agree_on_budget or found.host_local or found.rate.rank_local):
        return None
    return Replanning(request, measure_iters=measure_iters, profile_path=found.profile if measure_iters else None,
                      agree_on_budget=agree_on_budget, agree_on_host=found.host_local,
                      agree_on_rate=found.rate.rank_local)


def costs_source(rate: DeviceRate) -> str:
    """Where a plan's costs came from, for the plan lines."""
    return f"analytic costs at {rate.source}" if rate.source else "analytic costs"


def _placement_note(options: PlannerOptions, link: Optional[float]) -> str:
    if options.activation_placement != "auto":
        return f", activation placement {options.activation_placement}" if options.activation_placement != RECOMPUTE_ONLY else ""
    host = "unlimited" if options.host_budget_bytes is None else f"{options.host_budget_bytes / GB:.1f} GiB"
    return f", activation placement auto, host link {link:g} Gbit/s, host memory {host} per rank"


def auto_plan(args, pp: int, vpp: int, microbatches: int,
              settings: Optional[PipeMeshConfig] = None) -> Tuple[RunPlan, str, Optional[Replanning]]:
    """``--forward-groups auto``: (the plan, its plan line, its re-planning inputs); raises ValueError with a
    user-facing message."""
    settings = _flags(args, settings)
    lowering = LoweringSettings(sharding=SHARDING_AUTO if settings.sharding.levels in ("auto", ("auto",)) else ())
    return resolve_megatron(args, settings, AUTO, pp, vpp, microbatches, lowering)


def place_given_groups(args, config: ScheduleConfig,
                       settings: Optional[PipeMeshConfig] = None) -> Tuple[RunPlan, str, Optional[Replanning]]:
    """``--pipemesh-activation-placement auto`` with given groups: host placement and recomputation for
    ``config``'s groups under the memory budget (``--pipemesh-memory-budget-gb`` or the device's free memory)."""
    settings = _flags(args, settings)
    schedule = dataclasses.replace(settings.schedule, forward_groups=config.forward_groups,
                                   backward_groups=config.backward_groups)
    return resolve_megatron(args, dataclasses.replace(settings, schedule=schedule), PLACED_GROUPS, config.pp,
                            config.vpp, config.microbatches)


load_plan = load_plan_file
"""A plan saved by ``pipemesh plan --output`` (:func:`..planning.resolve.load_plan_file`)."""
