"""The memory-fair benchmark: every schedule runs inside one activation budget per rank.

Rows (one training run per row and repeat):

* ``1f1b``: stock 1F1B; ``interleaved-g<g>``: stock interleaved with
  ``--microbatch-group-size-per-virtual-pipeline-stage g`` for every g Megatron accepts (p <= g <= m,
  m % g == 0 or >= p; g = p is depth-first, g = m breadth-first). Each with the cheapest stock
  recomputation predicted to fit the budget (the options and their order come from
  :func:`stock_levels`); when nothing fits, the option with the smallest predicted peak (the row is
  then measured and marked as not fitting);
* ``pipemesh``: the given groups with the planner's pipeline-aware recomputation for the budget;
  ``pipemesh-auto``: groups and recomputation chosen by the planner for the budget. Both are written
  as plan files and run with ``--pipemesh-plan``.

Predictions use the simulator with analytic compute (the bench's ``--device-tflops``), the shaped
rate, and the activation model of :mod:`megatron_pipemesh.planning.memory` for this CPU run (fp32,
dropout masks in fp32, local layer spec; it matches the activation meter to a few bytes), with no
static memory: the budget is for activations alone. Whether a row fits is decided by the
*measured* peak of every rank (:mod:`.activation_meter`), never by the prediction.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

from ..planning.costs import ClusterSpec, ModelSpec, OpCosts, analytic_costs
from ..planning.memory import ActivationShape, activation_bytes
from ..planning.simulator import simulate
from ..schedule.config import ScheduleConfig
from .calibrate import PADDED_VOCAB
from .runner import STOCK_FAMILIES, AutoPlanSettings, ModelSetup, ParallelConfig

MB = 2 ** 20
DROPOUT = 0.1
"""Megatron's default --hidden-dropout and --attention-dropout (the bench does not change them)."""


@dataclass(frozen=True)
class RunSpec:
    """One row of the memory-fair benchmark: a schedule with its memory setting."""

    name: str
    """Row name: ``1f1b``, ``interleaved-g<g>``, ``pipemesh``, ``pipemesh-auto``."""
    family: str
    """``1f1b``, ``interleaved``, ``pipemesh`` or ``pipemesh-auto``."""
    group_size: Optional[int] = None
    """Stock interleaved: ``--microbatch-group-size-per-virtual-pipeline-stage``."""
    recompute: str = "none"
    """Stock recomputation level (a name of :func:`stock_levels`); PipeMesh: 'planned'."""
    stock_flags: Tuple[str, ...] = ()
    """Megatron flags of the stock memory setting (group size and recomputation)."""
    groups: Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]] = None
    """PipeMesh forward / backward groups."""
    plan_path: Optional[str] = None
    """PipeMesh: the plan file passed with ``--pipemesh-plan``."""
    recomputed: int = 0
    """PipeMesh: chunk-micro-batches the plan recomputes."""
    predicted_peak_bytes: Optional[Tuple[float, ...]] = None
    """Predicted peak activation bytes per pipeline rank."""
    predicted_iteration_s: Optional[float] = None

    @property
    def stock(self) -> bool:
        return self.family in STOCK_FAMILIES

    def schedule_config(self, pp: int, vpp: int, m: int) -> ScheduleConfig:
        """The order this row runs (for the simulator and the calibration)."""
        if self.family == "1f1b":
            return ScheduleConfig(pp, 1, m)
        if self.family == "interleaved":
            return ScheduleConfig.uniform(pp, vpp, m, self.group_size or pp)
        if self.groups is None:
            raise ValueError(f"row {self.name} has no groups")
        return ScheduleConfig(pp, vpp, m, *self.groups)

    def setting(self) -> str:
        """One line: what this row runs with."""
        if self.stock:
            return " ".join(self.stock_flags) or "(no extra flags)"
        groups = f"{' '.join(map(str, self.groups[0]))} / {' '.join(map(str, self.groups[1]))}" if self.groups else ""
        return f"groups {groups}, {self.recomputed} recomputed chunk-micro-batches"


def accepted_group_sizes(pp: int, m: int) -> List[int]:
    """Group sizes Megatron's interleaved schedule accepts: p <= g <= m and m % g is 0 or >= p."""
    return [g for g in range(pp, m + 1) if m % g == 0 or m % g >= pp]


def stock_levels(layers_per_chunk: int) -> List[str]:
    """Stock recomputation options, cheapest first in recompute work for the same memory freed."""
    return ["none", "selective", "full"]


def recompute_flags(level: str) -> Tuple[str, ...]:
    """Megatron flags of a stock recomputation level."""
    if level == "none":
        return ()
    if level == "selective":
        return ("--recompute-granularity", "selective")
    if level == "full":
        return ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")
    raise ValueError(f"unknown stock recompute level {level!r}")


def cpu_activation_shape(model: ModelSetup) -> ActivationShape:
    """Activation shape of the bench's run: fp32 on CPU, local layer spec, Megatron's default dropout."""
    return ActivationShape(seq_length=model.seq_length, micro_batch_size=model.micro_batch_size,
                           hidden_size=model.hidden_size, num_attention_heads=model.num_attention_heads,
                           vocab_size=PADDED_VOCAB, dtype_bytes=4, hidden_dropout=DROPOUT, attention_dropout=DROPOUT)


def bench_costs(model: ModelSetup, config: ParallelConfig, sched: ScheduleConfig, auto: AutoPlanSettings,
                gbps: float, levels: Sequence[str] = ("none", "selective", "full")) -> OpCosts:
    """Analytic times for this CPU (``auto.device_tflops`` x ``auto.mfu``) and the shaped rate; activation
    bytes of the CPU run; no static memory (the budget is for activations)."""
    layers_total = model.num_layers(config.pp)
    spec = ModelSpec(num_layers=layers_total, hidden_size=model.hidden_size,
                     num_attention_heads=model.num_attention_heads, seq_length=model.seq_length,
                     micro_batch_size=model.micro_batch_size, vocab_size=PADDED_VOCAB, dtype_bytes=4, grad_bytes=4,
                     hidden_dropout=DROPOUT, attention_dropout=DROPOUT)
    cluster = ClusterSpec(dp=config.dp, device_tflops=auto.device_tflops, mfu=auto.mfu, dp_gbps=gbps, p2p_gbps=gbps,
                          distributed_optimizer=False)
    costs = analytic_costs(spec, cluster, sched)
    shape = cpu_activation_shape(model)
    layers = layers_total // (sched.pp * sched.vpp)
    middle = {lv: activation_bytes(shape, layers, lv) for lv in levels}
    first = {lv: activation_bytes(shape, layers, lv, first_stage=True) - middle[lv] for lv in levels}
    last = {lv: activation_bytes(shape, layers, lv, last_stage=True) - middle[lv] for lv in levels}
    return replace(costs, activation_bytes=middle, first_stage_activation_bytes=first,
                   last_stage_activation_bytes=last, static_bytes=tuple(0.0 for _ in range(sched.pp)))


def uniform_plan(sched: ScheduleConfig, level: str) -> Dict[Tuple[int, int, int], str]:
    """Every (rank, chunk, micro-batch) at one level: what Megatron's --recompute-* flags do."""
    if level == "none":
        return {}
    return {(r, c, j): level for r in range(sched.pp) for c in range(sched.vpp) for j in range(sched.microbatches)}


def predict(sched: ScheduleConfig, costs: OpCosts, level: str) -> Tuple[Tuple[float, ...], float]:
    """(peak activation bytes per pipeline rank, iteration seconds) of a stock setting."""
    result = simulate(sched, costs, uniform_plan(sched, level))
    return tuple(r.peak_activation_bytes for r in result.ranks), result.iteration_s


def auto_budget_bytes(model: ModelSetup, config: ParallelConfig, auto: AutoPlanSettings, gbps: float) -> float:
    """``--activation-budget-mb auto``: halfway between the depth-first and the breadth-first peak
    (largest rank, no recomputation) of stock interleaved for this configuration."""
    pp, vpp, m = config.pp, model.vpp, model.microbatches
    peaks = []
    for sched in (ScheduleConfig.depth_first(pp, vpp, m), ScheduleConfig.breadth_first(pp, vpp, m)):
        peaks.append(max(predict(sched, bench_costs(model, config, sched, auto, gbps), "none")[0]))
    return (peaks[0] + peaks[1]) / 2


def stock_spec(model: ModelSetup, config: ParallelConfig, family: str, group_size: Optional[int],
               budget: Optional[float], auto: AutoPlanSettings, gbps: float) -> RunSpec:
    """The row of one stock schedule with the cheapest recomputation predicted to fit ``budget``
    (no recomputation without a budget)."""
    pp, m = config.pp, model.microbatches
    vpp = 1 if family == "1f1b" else model.vpp
    base = RunSpec(name="1f1b" if family == "1f1b" else f"interleaved-g{group_size}", family=family,
                   group_size=group_size)
    sched = base.schedule_config(pp, vpp, m)
    levels = stock_levels(model.layers_per_chunk * (model.vpp if family == "1f1b" else 1))
    costs = bench_costs(model, config, sched, auto, gbps, levels)
    options = []
    for level in (levels if budget is not None else ["none"]):
        peaks, time_s = predict(sched, costs, level)
        options.append((level, peaks, time_s))
    fitting = [o for o in options if budget is None or max(o[1]) <= budget]
    level, peaks, time_s = (min(fitting, key=lambda o: o[2]) if fitting else min(options, key=lambda o: max(o[1])))
    flags: Tuple[str, ...] = ()
    if family == "interleaved":
        flags = ("--microbatch-group-size-per-virtual-pipeline-stage", str(group_size))
    return replace(base, recompute=level, stock_flags=flags + recompute_flags(level), predicted_peak_bytes=peaks,
                   predicted_iteration_s=time_s)


def stock_specs(model: ModelSetup, config: ParallelConfig, families: Sequence[str], budget: Optional[float],
                auto: AutoPlanSettings, gbps: float, group_sizes: Optional[Sequence[int]] = None) -> List[RunSpec]:
    """Every stock row: 1F1B and stock interleaved with each accepted group size (or ``group_sizes``)."""
    specs = []
    if "1f1b" in families:
        specs.append(stock_spec(model, config, "1f1b", None, budget, auto, gbps))
    if "interleaved" in families:
        accepted = accepted_group_sizes(config.pp, model.microbatches)
        for g in (group_sizes or accepted):
            if g not in accepted:
                raise ValueError(f"--group-sizes {g} is not accepted by Megatron for p={config.pp}, "
                                 f"m={model.microbatches}: use one of {' '.join(map(str, accepted))}")
            specs.append(stock_spec(model, config, "interleaved", g, budget, auto, gbps))
    return specs


def pipemesh_spec(model: ModelSetup, config: ParallelConfig, family: str, budget: Optional[float],
                  auto: AutoPlanSettings, gbps: float, plan_dir: str,
                  groups: Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]] = None) -> RunSpec:
    """A PipeMesh row planned for ``budget``: the given ``groups`` with pipeline-aware recomputation
    (``pipemesh``) or the planner's best groups and recomputation (``pipemesh-auto``); written to a plan
    file for ``--pipemesh-plan``. Without a budget nothing is recomputed (auto: an unbounded budget)."""
    from ..planning.planner import fit_with_recompute, plan_schedule

    pp, vpp, m = config.pp, model.vpp, model.microbatches
    costs_for = lambda cfg: bench_costs(model, config, cfg, auto, gbps)  # noqa: E731
    limit = budget if budget is not None else float("inf")
    if family == "pipemesh-auto":
        plan, _ = plan_schedule(pp, vpp, m, costs_for, limit)
    else:
        sched = ScheduleConfig(pp, vpp, m, *groups)
        plan = fit_with_recompute(sched, costs_for(sched), limit)
    os.makedirs(plan_dir, exist_ok=True)
    path = os.path.join(plan_dir, f"{config.name}-{family}.json")
    data = {"pp": pp, "vpp": vpp, "microbatches": m, **plan.to_dict()}
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=1)
    recomputed = sum(1 for level in plan.recompute.values() if level != "none")
    return RunSpec(name=family, family=family, recompute="planned",
                   groups=(plan.config.forward_groups, plan.config.backward_groups), plan_path=path,
                   recomputed=recomputed, predicted_peak_bytes=tuple(r.peak_activation_bytes for r in plan.result.ranks),
                   predicted_iteration_s=plan.result.iteration_s)


def fits(peaks: Optional[Sequence[Optional[float]]], budget: Optional[float]) -> bool:
    """A row fits when every rank's measured peak is known and within the budget (always without one)."""
    if budget is None:
        return True
    return bool(peaks) and all(p is not None and p <= budget for p in peaks)


def best_stock(rows: Sequence[dict]) -> Optional[dict]:
    """The fastest stock row that fits (rows: ``stock``, ``fits``, ``tokens_per_s``); None if none does."""
    candidates = [r for r in rows if r.get("stock") and r.get("fits") and r.get("tokens_per_s")]
    return max(candidates, key=lambda r: r["tokens_per_s"]) if candidates else None
