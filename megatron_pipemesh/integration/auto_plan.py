"""``--forward-groups auto`` / ``--pipemesh-plan FILE`` inside training: a plan from Megatron's args.

``auto`` runs the planner at argument-validation time (every rank computes the same plan from the
same arguments, so no communication is needed) with analytic costs from the model shape in
Megatron's args and the cluster description in PipeMesh's flags. ``--pipemesh-plan FILE`` loads a
plan saved by ``pipemesh plan --output FILE`` (checked against this run's p, V and m).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from ..planning.costs import GB, RECOMPUTE_LEVELS, ClusterSpec, ModelSpec, analytic_costs
from ..planning.planner import NoFeasiblePlan, plan_schedule
from ..schedule.config import ScheduleConfig
from ..schedule.lower import HOST_LEVEL

PLAN_LEVELS = RECOMPUTE_LEVELS + (HOST_LEVEL,)
"""Levels a plan file may give a chunk-micro-batch (recomputation, or host placement)."""

DEFAULT_MARGIN = 0.10
"""Fraction of free device memory left unplanned (fragmentation, communication buffers, workspace)."""

# Dense 16-bit peak TFLOP/s by device-name substring, used when --pipemesh-device-tflops is not given.
_PEAK_TFLOPS = (("H200", 989.0), ("H100", 989.0), ("A100", 312.0), ("L40S", 362.0), ("A10G", 125.0),
                ("A10", 125.0), ("L4", 121.0), ("V100", 125.0), ("A6000", 155.0), ("4090", 165.0))


@dataclass(frozen=True)
class ResolvedPlan:
    config: ScheduleConfig
    recompute: Dict[Tuple[int, int, int], str]
    summary: str
    replan: Optional[dict] = None
    """Inputs of :class:`~.measured.MeasuredReplanner` (re-planning from measured costs with
    --pipemesh-measure-iters > 0, and from the minimum free memory over ranks when the budget was read
    from the device); None when neither applies."""


def _device_defaults(args) -> Tuple[Optional[float], Optional[float]]:
    """(peak TFLOP/s, memory budget GiB) of the local accelerator, or (None, None) without CUDA."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        return None, None
    if not torch.cuda.is_available():
        return None, None
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    name = torch.cuda.get_device_name(index)
    tflops = next((value for key, value in _PEAK_TFLOPS if key in name), None)
    free, _ = torch.cuda.mem_get_info(index)
    return tflops, free / GB * (1 - DEFAULT_MARGIN)


def layer_spec_fields(args) -> dict:
    """ModelSpec's layer-spec fields from Megatron's args (issue 12 point 5): Transformer Engine
    (flash attention), GQA, SwiGLU, RoPE, bf16 gradient reduction, dropout."""
    groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else None
    return {"layer_spec": "te" if getattr(args, "transformer_impl", "local") == "transformer_engine" else "local",
            "num_query_groups": groups, "swiglu": bool(getattr(args, "swiglu", False)),
            "bias_activation_fusion": bool(getattr(args, "bias_swiglu_fusion", False) if getattr(args, "swiglu", False)
                                           else getattr(args, "bias_gelu_fusion", False)),
            "position_embedding": "rope" if getattr(args, "position_embedding_type", "learned_absolute") == "rope"
            else "learned_absolute",
            "grad_bytes": 2 if getattr(args, "grad_reduce_in_bf16", False) else 4,
            "hidden_dropout": float(getattr(args, "hidden_dropout", 0.1)),
            "attention_dropout": float(getattr(args, "attention_dropout", 0.1))}


def _on_cuda() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return torch.cuda.is_available()


def model_and_cluster(args, tflops: float) -> Tuple[ModelSpec, ClusterSpec]:
    dtype_bytes = 2 if (getattr(args, "bf16", False) or getattr(args, "fp16", False)) else 4
    vocab = getattr(args, "padded_vocab_size", None)
    if vocab is None and getattr(args, "vocab_size", None):
        # Megatron pads the vocabulary only when it builds the tokenizer, after argument validation
        # (megatron/training/tokenizer: _vocab_size_with_padding): do the same here.
        multiple = (getattr(args, "make_vocab_size_divisible_by", 128) or 1) * args.tensor_model_parallel_size
        vocab = -(-args.vocab_size // multiple) * multiple
    vocab = vocab or 50304
    model = ModelSpec(num_layers=args.num_layers, hidden_size=args.hidden_size,
                      num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                      micro_batch_size=args.micro_batch_size, vocab_size=vocab,
                      ffn_hidden_size=getattr(args, "ffn_hidden_size", None), dtype_bytes=dtype_bytes,
                      dropout_mask_bytes=1 if _on_cuda() else None, **layer_spec_fields(args))
    cluster = ClusterSpec(tp=args.tensor_model_parallel_size, dp=args.data_parallel_size, device_tflops=tflops,
                          mfu=args.pipemesh_mfu, dp_gbps=args.pipemesh_dp_gbps, p2p_gbps=args.pipemesh_p2p_gbps,
                          sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
                          distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)))
    return model, cluster


def auto_plan(args, pp: int, vpp: int, microbatches: int) -> ResolvedPlan:
    """Run the planner for this run; raises ValueError with a user-facing message."""
    device_tflops, device_budget = _device_defaults(args)
    tflops = args.pipemesh_device_tflops or device_tflops
    budget = args.pipemesh_memory_budget_gb or device_budget
    if budget is None:
        raise ValueError("--forward-groups auto needs --pipemesh-memory-budget-gb on a machine without CUDA (there is "
                         "no device memory to read). Example: --pipemesh-memory-budget-gb 8")
    if tflops is None:
        raise ValueError("--forward-groups auto needs --pipemesh-device-tflops: the device's peak 16-bit TFLOP/s is not "
                         "known here. Example: --pipemesh-device-tflops 312")
    model, cluster = model_and_cluster(args, tflops)
    analytic = lambda cfg: analytic_costs(model, cluster, cfg)  # noqa: E731
    profile = getattr(args, "pipemesh_profile", None)
    source, costs_for = "analytic costs", analytic
    if profile and os.path.exists(profile):
        from .measured import load_profile, with_measured_times
        measured = load_profile(profile)
        source, costs_for = f"measured costs from {profile}", lambda cfg: with_measured_times(analytic(cfg), measured)
    try:
        best, evaluated = plan_schedule(pp, vpp, microbatches, costs_for, budget * GB)
    except NoFeasiblePlan as error:
        raise ValueError(f"--forward-groups auto: {error}") from error
    measure_iters = (getattr(args, "pipemesh_measure_iters", 0) or 0) if source == "analytic costs" else 0
    # A budget read from this rank's free memory differs between ranks; the schedule's first call (a point
    # every rank reaches, with process groups) re-plans for the minimum over all ranks when they differ.
    agree_on_budget = not args.pipemesh_memory_budget_gb
    replan = None
    if measure_iters or agree_on_budget:
        replan = {"analytic_costs_for": analytic, "costs_for": costs_for, "budget_bytes": budget * GB,
                  "agree_on_budget": agree_on_budget, "pp": pp, "vpp": vpp, "microbatches": microbatches,
                  "measure_iters": measure_iters, "profile_path": profile, "grad_bytes": model.grad_bytes,
                  "distributed_optimizer": cluster.distributed_optimizer}
    summary = f"PipeMesh plan (auto, {source}, {len(evaluated)} candidates, budget {budget:.2f} GiB): {best.summary()}"
    return ResolvedPlan(best.config, dict(best.recompute), summary, replan)


def load_plan(path: str, pp: int, vpp: int, microbatches: int) -> ResolvedPlan:
    """A plan saved by ``pipemesh plan --output``; raises ValueError naming the mismatch."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError) as error:
        raise ValueError(f"--pipemesh-plan {path}: cannot read the plan ({error}). Create one with "
                         "`pipemesh plan ... --output plan.json`") from error
    found = (data.get("pp"), data.get("vpp"), data.get("microbatches"))
    if found != (pp, vpp, microbatches):
        raise ValueError(f"--pipemesh-plan {path} was made for p, V, m = {found} but this run has {(pp, vpp, microbatches)}; "
                         "re-run `pipemesh plan` with this run's sizes")
    config = ScheduleConfig(pp, vpp, microbatches, tuple(data["forward_groups"]), tuple(data["backward_groups"]))
    recompute = {(int(e["rank"]), int(e["chunk"]), int(e["microbatch"])): e["level"] for e in data.get("recompute", [])}
    bad = [level for level in recompute.values() if level not in PLAN_LEVELS]
    if bad:
        raise ValueError(f"--pipemesh-plan {path}: unknown placement level(s) {sorted(set(bad))}; use "
                         f"{', '.join(PLAN_LEVELS)}")
    outside = sorted(key for key in recompute if not (0 <= key[0] < pp and 0 <= key[1] < vpp and 0 <= key[2] < microbatches))
    if outside:
        raise ValueError(f"--pipemesh-plan {path}: entries {outside[:3]} (rank, chunk, micro-batch) are outside p, V, m = "
                         f"{(pp, vpp, microbatches)}")
    recomputed = sum(1 for level in recompute.values() if level in ("selective", "full"))
    hosted = sum(1 for level in recompute.values() if level == HOST_LEVEL)
    return ResolvedPlan(config, recompute, f"PipeMesh plan from {path}: {config.describe()}, "
                                           f"{recomputed} recomputed and {hosted} host-placed chunk-micro-batches")
