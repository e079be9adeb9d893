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
ranks per node, also the cap of ``--pipemesh-host-memory-gb``; a plan file that needs more is refused).
"""
from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Optional, Tuple

from ..planning.memory import MEMORY_MARGIN
from ..planning.costs import DEFAULT_HOST_LINK_GBPS, GB, ClusterSpec, ModelSpec, analytic_costs, planning_levels
from ..planning.devices import find_device
from ..planning.layout import LayerSplit
from ..planning.planner import NoFeasiblePlan, PlannerOptions, fit_with_recompute, plan_schedule
from ..schedule.config import ScheduleConfig
from ..schedule.plan import RunPlan, RunPlanError
from .host_memory import check_plan_fits_host, host_share
from .measured import Replanning


def _device_defaults(args) -> Tuple[Optional[float], Optional[float]]:
    """(peak TFLOP/s, memory budget GiB) of the local accelerator, or (None, None) without CUDA."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        return None, None
    if not torch.cuda.is_available():
        return None, None
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    device = find_device(torch.cuda.get_device_name(index))
    tflops = device.peak_tflops if device is not None else None
    free, _ = torch.cuda.mem_get_info(index)
    return tflops, free / GB * (1 - MEMORY_MARGIN)


def layer_spec_fields(args) -> dict:
    """ModelSpec's layer-spec fields from Megatron's args (issue 12 point 5): Transformer Engine
    (flash attention), GQA, SwiGLU, RoPE, bf16 gradient reduction, dropout, linear biases."""
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
            "linear_bias": bool(getattr(args, "add_bias_linear", True))}


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


def placement_mode(args) -> str:
    return getattr(args, "pipemesh_activation_placement", None) or "recompute-only"


def host_link_gbps(args) -> Tuple[float, str, bool]:
    """(Gbit/s, where it came from, whether it is rank-local) of the host link the planner assumes:
    ``--pipemesh-host-link-gbps``; else, when 'auto' placement may offload on a GPU, measured once now
    (:func:`..runtime.host_link.startup_host_link`); else the planning default."""
    given = getattr(args, "pipemesh_host_link_gbps", None)
    if given:
        return float(given), "given", False
    if placement_mode(args) == "auto" and _on_cuda():
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


def host_budget_bytes(args) -> Tuple[Optional[float], bool]:
    """(host memory per rank offloaded activations may fill, whether it is rank-local): the machine's
    share, capped by ``--pipemesh-host-memory-gb`` when given."""
    share = machine_host_share_bytes()
    given = getattr(args, "pipemesh_host_memory_gb", None)
    if given is None:
        return share, share is not None
    if share is not None and share < given * GB:
        return share, True  # the flag asks for more than this machine has free
    return given * GB, False


def planner_options(args) -> Tuple[PlannerOptions, Optional[float], bool]:
    """(the planner's placement options, the host link Gbit/s for the costs, whether some input is rank-local)."""
    mode = placement_mode(args)
    if mode != "auto":
        return PlannerOptions(activation_placement=mode), None, False
    link, _, link_local = host_link_gbps(args)
    host_budget, budget_local = host_budget_bytes(args)
    return PlannerOptions(activation_placement=mode, host_budget_bytes=host_budget), link, link_local or budget_local


def padded_vocab_size(args) -> int:
    """The vocabulary Megatron's output layer has: padded only when Megatron builds the tokenizer, after argument
    validation (megatron/training/tokenizer: _vocab_size_with_padding), so padded here the same way; GPT-2's 50304
    when the command names no size (a BPE tokenizer's file)."""
    vocab = getattr(args, "padded_vocab_size", None)
    if vocab is None and getattr(args, "vocab_size", None):
        multiple = (getattr(args, "make_vocab_size_divisible_by", 128) or 1) * args.tensor_model_parallel_size
        vocab = -(-args.vocab_size // multiple) * multiple
    return vocab or 50304


def model_and_cluster(args, rate: DeviceRate, host_link: Optional[float] = None) -> Tuple[ModelSpec, ClusterSpec]:
    dtype_bytes = 2 if (getattr(args, "bf16", False) or getattr(args, "fp16", False)) else 4
    model = ModelSpec(num_layers=args.num_layers, hidden_size=args.hidden_size,
                      num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                      micro_batch_size=args.micro_batch_size, vocab_size=padded_vocab_size(args),
                      ffn_hidden_size=getattr(args, "ffn_hidden_size", None), dtype_bytes=dtype_bytes,
                      dropout_mask_bytes=1 if _on_cuda() else None, layer_split=layer_split(args),
                      **layer_spec_fields(args))
    cluster = ClusterSpec(tp=args.tensor_model_parallel_size, dp=args.data_parallel_size, device_tflops=rate.tflops,
                          mfu=rate.mfu, dp_gbps=args.pipemesh_dp_gbps, p2p_gbps=args.pipemesh_p2p_gbps,
                          sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
                          distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)),
                          host_link_gbps=host_link or getattr(args, "pipemesh_host_link_gbps", None) or DEFAULT_HOST_LINK_GBPS,
                          host_copies_on_compute=not _on_cuda(), collectives=collectives(args))
    if getattr(args, "pipemesh_ranks_per_node", None):  # the node scope's nodes (resolved by check_sharding_args)
        cluster = dataclasses.replace(cluster, devices_per_node=args.pipemesh_ranks_per_node)
    return model, cluster


@dataclass(frozen=True)
class DeviceRate:
    """The compute rate the analytic costs assume, and where it came from."""

    tflops: float
    """TFLOP/s of one device."""
    mfu: float
    """Fraction of it the layers reach (1 for a measured rate, which is already an achieved one)."""
    source: str = ""
    """Said in the plan line when the rate was measured here ('' for a given or known peak)."""
    rank_local: bool = False
    """Measured by this rank: the ranks agree on the slowest at the first call."""


@functools.lru_cache(maxsize=1)
def measured_cpu_tflops(size: int = 512, repeats: int = 8) -> float:
    """Achieved fp32 matmul rate of this process's CPU threads (TFLOP/s), measured once per process."""
    import time

    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    start = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    return 2 * size ** 3 * repeats / (time.perf_counter() - start) / 1e12


def device_rate(args, what: str) -> DeviceRate:
    """``--pipemesh-device-tflops``, else the known peak of this GPU, else (without CUDA) the CPU's measured matmul
    rate; a GPU of unknown peak is a ValueError naming the flag."""
    given = getattr(args, "pipemesh_device_tflops", None)
    mfu = getattr(args, "pipemesh_mfu", None) or ClusterSpec.mfu
    if given:
        return DeviceRate(given, mfu)
    peak = _device_defaults(args)[0]
    if peak is not None:
        return DeviceRate(peak, mfu)
    if not _on_cuda():
        rate = measured_cpu_tflops()
        return DeviceRate(rate, 1.0, f"a measured CPU matmul rate of {rate * 1e3:.1f} GFLOP/s", rank_local=True)
    raise ValueError(f"{what} needs --pipemesh-device-tflops: the peak 16-bit TFLOP/s of this GPU is not known here. "
                     "Example: --pipemesh-device-tflops 312")


def _budget_and_rate(args, what: str) -> Tuple[float, DeviceRate]:
    budget = args.pipemesh_memory_budget_gb or _device_defaults(args)[1]
    if budget is None:
        raise ValueError(f"{what} needs --pipemesh-memory-budget-gb on a machine without CUDA (there is "
                         "no device memory to read). Example: --pipemesh-memory-budget-gb 8")
    return budget, device_rate(args, what)


def auto_plan(args, pp: int, vpp: int, microbatches: int) -> Tuple[RunPlan, str, Optional[Replanning]]:
    """Run the planner for this run: (the plan, its summary line, its re-planning inputs); raises ValueError
    with a user-facing message."""
    budget, rate = _budget_and_rate(args, "--forward-groups auto")
    options, link, host_local = planner_options(args)
    model, cluster = model_and_cluster(args, rate, link)
    analytic = lambda cfg: analytic_costs(model, cluster, cfg, planning_levels(model))  # noqa: E731
    profile = getattr(args, "pipemesh_profile", None)
    source, costs_for, measured = costs_source(rate), analytic, None
    if profile and os.path.exists(profile):
        from .measured import load_profile, with_measured_times
        measured = load_profile(profile)
        source, costs_for = f"measured costs from {profile}", lambda cfg: with_measured_times(analytic(cfg), measured)
    sharding_auto = list(getattr(args, "pipemesh_sharding", None) or []) == ["auto"]
    try:
        if sharding_auto:  # levels per chunk chosen jointly with the groups and recomputation
            from ..planning.sharding import plan_with_sharding
            best, by_levels = plan_with_sharding(pp, vpp, microbatches, costs_for, budget * GB, model, cluster,
                                                 getattr(args, "pipemesh_shard_scope", "data-parallel"), options=options)
            evaluated = [plan for plan in by_levels.values() if plan is not None]
        else:
            best, evaluated = plan_schedule(pp, vpp, microbatches, costs_for, budget * GB, options)
    except NoFeasiblePlan as error:
        raise ValueError(f"--forward-groups auto: {error}") from error
    summary = (f"PipeMesh plan (auto, {source}, {len(evaluated)} candidates, budget {budget:.2f} GiB"
               f"{_placement_note(options, link)}): {best.summary()}")
    if sharding_auto:
        return best.run_plan(), f"{summary}; sharding {' '.join(best.sharding.spec.levels)}", None
    measure_iters = (getattr(args, "pipemesh_measure_iters", 0) or 0) if measured is None else 0
    # A budget read from this rank's free memory differs between ranks; the schedule's first call (a point
    # every rank reaches, with process groups) re-plans for the minimum over all ranks when they differ.
    agree_on_budget = not args.pipemesh_memory_budget_gb
    replan = None
    if measure_iters or agree_on_budget or host_local or rate.rank_local:
        replan = Replanning(model, cluster, budget * GB, pp, vpp, microbatches, measured=measured,
                            measure_iters=measure_iters, profile_path=profile, agree_on_budget=agree_on_budget,
                            planner_options=options, agree_on_host=host_local, agree_on_rate=rate.rank_local)
    return best.run_plan(), summary, replan


def costs_source(rate: DeviceRate) -> str:
    """Where a plan's costs came from, for the plan lines."""
    return f"analytic costs at {rate.source}" if rate.source else "analytic costs"


def _placement_note(options: PlannerOptions, link: Optional[float]) -> str:
    if options.activation_placement != "auto":
        return f", activation placement {options.activation_placement}" if options.activation_placement != "recompute-only" else ""
    host = "unlimited" if options.host_budget_bytes is None else f"{options.host_budget_bytes / GB:.1f} GiB"
    return f", activation placement auto, host link {link:g} Gbit/s, host memory {host} per rank"


def place_given_groups(args, config: ScheduleConfig) -> Tuple[RunPlan, str, Optional[Replanning]]:
    """``--pipemesh-activation-placement auto`` with given groups: host placement and recomputation for
    ``config`` under the memory budget (``--pipemesh-memory-budget-gb`` or the device's free memory)."""
    what = "--pipemesh-activation-placement auto with given groups"
    budget, rate = _budget_and_rate(args, what)
    options, link, host_local = planner_options(args)
    model, cluster = model_and_cluster(args, rate, link)
    analytic = lambda cfg: analytic_costs(model, cluster, cfg, planning_levels(model))  # noqa: E731
    plan = fit_with_recompute(config, analytic(config), budget * GB, options)
    if not plan.fits:
        peak = max(r.peak_memory_bytes for r in plan.result.ranks)
        raise ValueError(f"{what}: {config.describe()} does not fit the memory budget of {budget:.2f} GiB per device "
                         f"even with host placement and recomputation (peak {peak / GB:.2f} GiB). Use --forward-groups "
                         "auto --backward-groups auto, a larger budget, or a smaller --micro-batch-size")
    agree_on_budget = not args.pipemesh_memory_budget_gb
    replan = None
    if agree_on_budget or host_local or rate.rank_local:
        replan = Replanning(model, cluster, budget * GB, config.pp, config.vpp, config.microbatches,
                            agree_on_budget=agree_on_budget, planner_options=options, agree_on_host=host_local,
                            agree_on_rate=rate.rank_local, fixed_config=config)
    summary = (f"PipeMesh plan (given groups, {costs_source(rate)}, budget {budget:.2f} GiB"
               f"{_placement_note(options, link)}): {plan.summary()}")
    return plan.run_plan(), summary, replan


def load_plan(path: str, pp: int, vpp: int, microbatches: int) -> RunPlan:
    """A plan saved by ``pipemesh plan --output``; raises ValueError naming the mismatch."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as error:
        raise ValueError(f"--pipemesh-plan {path}: cannot read the plan ({error}). Create one with "
                         "`pipemesh plan ... --output plan.json`") from error
    try:
        plan = RunPlan.from_json(text)
    except RunPlanError as error:
        raise ValueError(f"--pipemesh-plan {path}: {error}") from error
    check_plan_fits_host(plan, f"--pipemesh-plan {path}", host_share() if plan.host_placement else None)
    found = (plan.schedule.pp, plan.schedule.vpp, plan.schedule.microbatches)
    if found != (pp, vpp, microbatches):
        raise ValueError(f"--pipemesh-plan {path} was made for p, V, m = {found} but this run has {(pp, vpp, microbatches)}; "
                         "re-run `pipemesh plan` with this run's sizes")
    return plan
