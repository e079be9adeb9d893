"""The memory-fair benchmark: every schedule runs inside one activation budget per rank.

Rows (one training run per row and repeat):

* stock: every (schedule, V, g) of :func:`megatron_pipemesh.planning.stock.schedule_options` (1F1B
  ``1f1b``; interleaved ``interleaved-V<v>-g<g>`` for every V dividing the layers per rank and every
  group size g Megatron accepts), each with its fastest stock recomputation predicted to fit the budget
  (:func:`choose_stock`: none, selective with each ``--recompute-modules`` set that runs on this CPU
  stack, full uniform/block with each k); where nothing is predicted to fit, the setting with the
  smallest predicted peak (measured, and then marked as not fitting);
* Megatron's default command (``default``: what users run): 1F1B, and interleaved with the default group size
  g = p at every V, each with the first of none, ``--recompute-granularity selective`` (Megatron's default
  core_attn) and full block recomputation with the fewest layers predicted to fit, no offloading (the ladder of
  :func:`megatron_pipemesh.planning.stock.default_recompute_ladder`, the study's ``default``). Where that is the
  row's setting already, the row is marked ``default``; else the default setting runs as a row of its own,
  ``<row>-default``;
* ``pipemesh``: the given groups with the planner's pipeline-aware recomputation for the budget;
  ``pipemesh-auto``: groups and recomputation chosen by the planner for the budget. Both are written
  as plan files and run with ``--pipemesh-plan``.

With ``--sharding`` every row runs with Megatron's distributed optimizer and the budget is per-rank
*memory*: weights + gradients + optimizer state + activations. Stock rows are ZeRO-1 everywhere (``optim``:
Megatron's ZeRO-2/3 is Megatron-FSDP, CUDA-only: :data:`STOCK_SHARDING_NOTE`); their recomputation is
chosen for what the ZeRO-1 state leaves of the budget. PipeMesh rows get a level per chunk chosen jointly
with the groups, recomputation and activation placement
(:func:`megatron_pipemesh.planning.sharding.plan_with_sharding`; for the given groups, :func:`fit_levels`).
A row fits when every rank's measured peak of model state + activations is within the budget.

Predictions (stock choice and PipeMesh plans alike) use the same simulator and analytic costs:
compute at the bench's ``--device-tflops`` x ``--mfu``, the shaped rate for pipeline and
data-parallel transfers, activation bytes of :mod:`megatron_pipemesh.planning.memory` for this run
(fp32, local layer spec, dropout 0: the bench runs with ``--hidden-dropout 0 --attention-dropout 0``
so that CPU and CUDA keep the same tensors; the model matches the activation meter to a few bytes),
and no static memory without ``--sharding``: the budget is then for activations alone. Whether a row fits
is decided by the *measured* peak of every rank (:mod:`.activation_meter`), never by the prediction.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Tuple

from ..planning.costs import ClusterSpec, ModelSpec, OpCosts, analytic_costs, planning_levels
from ..planning.memory import recomputable_modules
from ..planning.sharding import ShardingModel, ShardingSpec, candidate_levels, rank_splits
from ..planning.stock import (StockRecompute, StockResult, StockSetting, default_recompute_ladder, evaluate,
                              order_peaks, recompute_options, schedule_options)
from ..schedule.config import ScheduleConfig
from .calibrate import network_cluster
from .runner import STOCK_FAMILIES, AutoPlanSettings, ModelSetup, ParallelConfig

MB = 2 ** 20
CPU_MEMORY_GBS = 10.0
"""Memory bandwidth one CPU core reaches (GB/s): the optimizer step and norm recomputation."""
CPU_HOST_LINK_GBPS = CPU_MEMORY_GBS * 8 / 2
"""The "host link" on CPU (Gbit/s): an OFFLOAD / RELOAD is a memcpy within the same RAM (read + write at
:data:`CPU_MEMORY_GBS`), run synchronously on the rank's compute thread, so its time is charged to
compute in the measurement however the planner expected it to hide."""


@dataclass(frozen=True)
class RunSpec:
    """One row of the memory-fair benchmark: a schedule with its memory setting."""

    name: str
    """Row name: ``1f1b``, ``interleaved-V<v>-g<g>``, ``pipemesh``, ``pipemesh-auto``."""
    family: str
    """``1f1b``, ``interleaved``, ``pipemesh`` or ``pipemesh-auto``."""
    setting: Optional[StockSetting] = None
    """Stock rows: schedule, V, g and recomputation (its ``flags()`` are what the run adds)."""
    groups: Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]] = None
    """PipeMesh forward / backward groups."""
    plan_path: Optional[str] = None
    """PipeMesh: the plan file passed with ``--pipemesh-plan``."""
    recomputed: int = 0
    """PipeMesh: chunk-micro-batches the plan recomputes."""
    host_placed: int = 0
    """PipeMesh: chunk-micro-batches the plan places in host memory between forward and backward."""
    predicted_peak_bytes: Optional[Tuple[float, ...]] = None
    """Predicted peak activation bytes per pipeline rank."""
    predicted_iteration_s: Optional[float] = None
    predicted_fits: bool = True
    """Whether the prediction fits the budget (False: the least-memory stock setting of a schedule where
    nothing is predicted to fit)."""
    sharding: Optional[Tuple[str, ...]] = None
    """``--sharding``: the ZeRO level of each virtual chunk (stock: ``optim`` everywhere); None without it."""
    default: bool = False
    """Megatron's default command at this row's V: 1F1B or g = p, with the first rung of the default recomputation
    ladder predicted to fit (:func:`choose_stock` with ``default_only``)."""
    predicted_state_bytes: Optional[Tuple[float, ...]] = None
    """``--sharding``: predicted weights + gradients + optimizer state per pipeline rank outside any group."""
    predicted_peak_memory_bytes: Optional[Tuple[float, ...]] = None
    """``--sharding``: predicted peak of model state (gathered weights and gradient buffers included) plus
    activations, per pipeline rank."""

    @property
    def stock(self) -> bool:
        return self.family in STOCK_FAMILIES

    @property
    def group_size(self) -> Optional[int]:
        return self.setting.effective_group_size if self.setting else None

    @property
    def recompute(self) -> str:
        return self.setting.recompute.describe() if self.setting else f"planned ({self.recomputed} recomputed)"

    @property
    def stock_flags(self) -> Tuple[str, ...]:
        """Megatron flags of the stock setting beyond the pipeline size (V, g, recomputation)."""
        return tuple(self.setting.flags()[2:]) if self.setting else ()

    @property
    def sharding_flags(self) -> Tuple[str, ...]:
        """``--sharding``: Megatron's distributed optimizer for every row, and PipeMesh's level per chunk."""
        if self.sharding is None:
            return ()
        levels = ("--pipemesh-sharding", *self.sharding) if not self.stock else ()
        return DISTRIBUTED_OPTIMIZER_FLAGS + levels

    def schedule_config(self, pp: int, vpp: int, m: int) -> ScheduleConfig:
        """The order this row runs (for the simulator and the calibration)."""
        if self.setting is not None:
            return self.setting.config()
        if self.groups is None:
            raise ValueError(f"row {self.name} has no groups")
        return ScheduleConfig(pp, vpp, m, *self.groups)

    def describe(self) -> str:
        """One line: what this row runs with."""
        levels = f", sharding {' '.join(self.sharding)}" if self.sharding else ""
        if self.setting is not None:
            return self.setting.describe() + levels
        groups = f"{' '.join(map(str, self.groups[0]))} / {' '.join(map(str, self.groups[1]))}" if self.groups else ""
        host = f", {self.host_placed} on the host" if self.host_placed else ""
        return f"PipeMesh groups {groups}, {self.recomputed} recomputed chunk-micro-batches{host}{levels}"


STOCK_LEVEL = "optim"
"""The one sharding level stock Megatron runs on CPU (``--sharding``): ZeRO-1, its distributed optimizer."""
DISTRIBUTED_OPTIMIZER_FLAGS = ("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather")
"""What every ``--sharding`` row runs with: Megatron's distributed optimizer, reductions and gathers overlapped."""
STOCK_SHARDING_NOTE = (
    "stock rows run ZeRO-1 only (optim: Megatron's distributed optimizer): Megatron's ZeRO-2/3 is Megatron-FSDP "
    "(--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads / optim_grads_params), which is CUDA-only "
    "(megatron/core/distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py:231-234 calls torch.cuda.current_device(), "
    ":406-407 creates CUDA streams) and cannot run on this CPU/gloo machine")


def cluster_spec(config: ParallelConfig, auto: AutoPlanSettings, gbps: float,
                 distributed_optimizer: bool = False) -> ClusterSpec:
    """One CPU core per rank at ``auto.device_tflops`` x ``auto.mfu``; pipeline links at the shaped rate
    (``gbps``, the link share applied); data parallel at ``gbps`` per rank with a NIC per rank
    (``auto.per_rank_network``), else at ``gbps`` / d: the d ranks of a ring all send through the one shaped
    token bucket at once (:func:`.calibrate.network_cluster`); with the distributed optimizer (``--sharding``) the
    all-reduce becomes a reduce-scatter (on gloo as dear as the all-reduce) plus an all-gather."""
    return network_cluster(config.dp, gbps, auto.per_rank_network, device_tflops=auto.device_tflops, mfu=auto.mfu,
                           distributed_optimizer=distributed_optimizer, memory_gbs=CPU_MEMORY_GBS,
                           host_link_gbps=CPU_HOST_LINK_GBPS)


def activation_costs(model: ModelSetup, config: ParallelConfig, sched: ScheduleConfig, auto: AutoPlanSettings,
                     gbps: float, distributed_optimizer: bool = False) -> OpCosts:
    """Analytic costs with no static memory: what the planner sees under an activation budget (with
    ``--sharding`` the simulator adds each level's model state itself)."""
    spec = model.model_spec(config.pp)
    costs = analytic_costs(spec, cluster_spec(config, auto, gbps, distributed_optimizer), sched, planning_levels(spec))
    return replace(costs, static_bytes=tuple(0.0 for _ in range(sched.pp)))


def state_bytes(model: ModelSetup, config: ParallelConfig, sched: ScheduleConfig, levels: Sequence[str],
                cluster: ClusterSpec) -> Tuple[float, ...]:
    """Weights + gradients + optimizer state per pipeline rank outside any group at ``levels`` (one per chunk;
    fp32 on CPU: :func:`megatron_pipemesh.planning.sharding.bytes_per_param`)."""
    splits = rank_splits(model.model_spec(config.pp), cluster, sched, ShardingSpec(tuple(levels)))
    return tuple(split.state.resident for split in splits)


def step_state_bytes(model: ModelSetup, config: ParallelConfig, sched: ScheduleConfig, levels: Sequence[str],
                     cluster: ClusterSpec) -> Tuple[float, ...]:
    """Model state per pipeline rank during Megatron's optimizer step under the mixed-sharding runtime (no
    activations then): whole parameter and gradient buffers (the distributed optimizer's fp32 shard is a view of
    them) and, for ZeRO-2/3 chunks, the gradient-shard accumulators the runtime keeps
    (:class:`megatron_pipemesh.runtime.sharding.ChunkSharding`: ``grad_accum``, allocated once)."""
    splits = rank_splits(model.model_spec(config.pp), cluster, sched, ShardingSpec(tuple(levels)))
    return tuple(sum(chunk.peak + (chunk.grads if level != STOCK_LEVEL else 0.0)
                     for chunk, level in zip(split.chunks, levels)) for split in splits)


def stock_state_bytes(model: ModelSetup, config: ParallelConfig, sched: ScheduleConfig,
                      cluster: ClusterSpec) -> Tuple[float, ...]:
    """ZeRO-1 (``optim`` for every chunk) model state per pipeline rank: what stock holds with ``--sharding``."""
    return state_bytes(model, config, sched, (STOCK_LEVEL,) * sched.vpp, cluster)


def auto_budget_bytes(model: ModelSetup, config: ParallelConfig, auto: AutoPlanSettings, gbps: float,
                      fraction: float = 0.5, sharding: bool = False) -> float:
    """``--activation-budget-mb auto[:F]``: ``fraction`` of the way from the depth-first to the breadth-first
    peak (largest rank, no recomputation) of stock interleaved at the bench's V (auto: halfway). With
    ``sharding`` (``--memory-budget-mb auto[:F]``) each peak is ZeRO-1 model state + activations."""
    pp, vpp, m = config.pp, model.vpp, model.microbatches
    spec, cluster = model.model_spec(config.pp), cluster_spec(config, auto, gbps, sharding)
    peaks = []
    for g in (pp, m):
        setting = StockSetting(pp, vpp, m, g)
        static = stock_state_bytes(model, config, setting.config(), cluster) if sharding else (0.0,) * pp
        peaks.append(max(a + s for a, s in zip(evaluate(setting, spec, cluster).peak_activation_bytes, static)))
    return peaks[0] + fraction * (peaks[1] - peaks[0])


def _row_name(setting: StockSetting) -> str:
    return "1f1b" if setting.vpp == 1 else f"interleaved-V{setting.vpp}-g{setting.effective_group_size}"


def runnable_options(layers_per_chunk: int, model: ModelSpec) -> List[StockRecompute]:
    """Stock recomputation settings that run here: every option of :func:`recompute_options` whose
    ``--recompute-modules`` megatron-core 0.19.2 can recompute for ``model`` without Transformer Engine
    (:func:`megatron_pipemesh.planning.memory.recomputable_modules`, which PipeMesh's planner uses too). For the
    bench's GPT (linear biases, local spec) that leaves out ``layernorm`` (``CheckpointWithoutOutput`` needs
    Transformer Engine) and ``mlp`` (its first training step never finishes: the MLP returns its bias
    parameter)."""
    runnable = recomputable_modules(model.layer_spec, model.linear_bias, transformer_engine=False)
    return [o for o in recompute_options(layers_per_chunk, model.layer_spec) if set(o.modules) <= runnable]


def choose_stock(spec: ModelSpec, cluster: ClusterSpec, pp: int, vpp: int, m: int, g: Optional[int],
                 budget: Optional[float], static: Optional[Sequence[float]] = None,
                 default_only: bool = False) -> Tuple[StockResult, bool]:
    """(simulated setting, predicted to fit) of one stock schedule: the fitting runnable recomputation with the
    least recomputation time (a fixed order is never faster with longer ops: see :mod:`..planning.stock`); when
    none fits, the one with the smallest peak (largest rank). ``static``: model state per pipeline rank that
    shares the budget with the activations (``--sharding``; none otherwise). ``default_only``: Megatron's default
    command, the first runnable rung of :func:`~megatron_pipemesh.planning.stock.default_recompute_ladder` that fits
    (none, selective, full block with the fewest layers)."""
    layers_per_chunk = spec.num_layers // (pp * vpp)
    options = runnable_options(layers_per_chunk, spec)
    if default_only:
        options = [o for o in default_recompute_ladder(layers_per_chunk) if o in options]
    probe = StockSetting(pp, vpp, m, g)
    costs = analytic_costs(spec, cluster, probe.config(), levels=tuple(o.level for o in options))
    peaks = order_peaks(probe.config(), costs, [o.level for o in options])
    static = tuple(static) if static is not None else (0.0,) * pp
    total = lambda option: max(a + s for a, s in zip(peaks[option.level], static))  # noqa: E731
    fitting = [o for o in options if budget is None or total(o) <= budget]
    if fitting:
        choice = fitting[0] if default_only else min(fitting, key=lambda o: costs.recompute_s[o.level])
    else:
        choice = min(options, key=lambda o: (total(o), costs.recompute_s[o.level]))
    return evaluate(replace(probe, recompute=choice), spec, cluster), bool(fitting)


def _stock_row(result: StockResult, fits_predicted: bool, family: str, static: Optional[Sequence[float]],
               default: bool, suffix: str = "") -> RunSpec:
    """The row of one simulated stock setting (``static``: its ZeRO-1 model state per rank with ``--sharding``)."""
    peaks = tuple(result.peak_activation_bytes)
    return RunSpec(name=_row_name(result.setting) + suffix, family=family, setting=result.setting,
                   predicted_peak_bytes=peaks, predicted_iteration_s=result.iteration_s, predicted_fits=fits_predicted,
                   sharding=(STOCK_LEVEL,) * result.setting.vpp if static is not None else None,
                   predicted_state_bytes=static,
                   predicted_peak_memory_bytes=tuple(a + s for a, s in zip(peaks, static)) if static is not None else None,
                   default=default)


def stock_specs(model: ModelSetup, config: ParallelConfig, budget: Optional[float], auto: AutoPlanSettings,
                gbps: float, families: Sequence[str] = STOCK_FAMILIES, group_sizes: Optional[Sequence[int]] = None,
                vpps: Optional[Sequence[int]] = None, sharding: bool = False) -> List[RunSpec]:
    """Every stock row (optionally only ``group_sizes`` / ``vpps`` of the interleaved ones), each with its
    fastest runnable setting predicted to fit ``budget`` (no recomputation without a budget); the rows of Megatron's
    default command (1F1B and g = p) marked ``default`` when their setting is the default one, else followed by a
    ``-default`` row with it. ``sharding``: Megatron's distributed optimizer, ZeRO-1 for every chunk, the budget
    covering model state + activations."""
    spec, cluster = model.model_spec(config.pp), cluster_spec(config, auto, gbps, sharding)
    pp, m = config.pp, model.microbatches
    rows = []
    for vpp, g in schedule_options(pp, spec.num_layers, m):
        family = "1f1b" if vpp == 1 else "interleaved"
        if family not in families or (vpp > 1 and ((group_sizes and g not in group_sizes)
                                                   or (vpps and vpp not in vpps))):
            continue
        static = stock_state_bytes(model, config, StockSetting(pp, vpp, m, g).config(), cluster) if sharding else None
        best = choose_stock(spec, cluster, pp, vpp, m, g, budget, static)
        default = choose_stock(spec, cluster, pp, vpp, m, g, budget, static, default_only=True) \
            if vpp == 1 or g == pp else None
        same = default is not None and default[0].setting == best[0].setting
        rows.append(_stock_row(*best, family, static, default=same))
        if default is not None and not same:
            rows.append(_stock_row(*default, family, static, default=True, suffix="-default"))
    return rows


def fit_levels(sched: ScheduleConfig, costs: OpCosts, budget: float, options, model: ModelSpec, cluster: ClusterSpec):
    """The given groups with mixed sharding: for each level tuple ``auto`` tries
    (:func:`megatron_pipemesh.planning.sharding.candidate_levels`) the planner's recomputation and placement
    for ``budget``; the fastest fitting plan wins (ties: less peak memory, then fewer sharded chunks), or,
    when none fits, the one with the least peak memory."""
    from ..planning.planner import fit_with_recompute
    from ..schedule.spans import ZERO_STAGE

    plans = [fit_with_recompute(sched, costs, budget, options, ShardingModel(model, cluster, ShardingSpec(levels)))
             for levels in candidate_levels(sched.vpp)]
    peak = lambda plan: max(r.peak_memory_bytes for r in plan.result.ranks)  # noqa: E731
    fitting = [plan for plan in plans if plan.fits]
    if not fitting:
        return min(plans, key=peak)
    return min(fitting, key=lambda plan: (round(plan.result.iteration_s, 12), peak(plan),
                                          sum(ZERO_STAGE[level] for level in plan.sharding.spec.levels)))


def pipemesh_spec(model: ModelSetup, config: ParallelConfig, family: str, budget: Optional[float],
                  auto: AutoPlanSettings, gbps: float, plan_dir: str,
                  groups: Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]] = None, sharding: bool = False) -> RunSpec:
    """A PipeMesh row planned for ``budget``: the given ``groups`` with pipeline-aware recomputation
    (``pipemesh``) or the planner's best groups and recomputation (``pipemesh-auto``); written to a plan
    file for ``--pipemesh-plan``. Without a budget nothing is recomputed (auto: an unbounded budget).
    ``sharding``: the level per chunk is planned with them (the plan file and ``--pipemesh-sharding`` carry it)
    and ``budget`` covers model state + activations."""
    from ..planning.planner import PlannerOptions, fit_with_recompute, plan_schedule
    from ..planning.sharding import plan_with_sharding

    pp, vpp, m = config.pp, model.vpp, model.microbatches
    costs_for = lambda cfg: activation_costs(model, config, cfg, auto, gbps, sharding)  # noqa: E731
    limit = budget if budget is not None else float("inf")
    options = PlannerOptions(activation_placement=auto.activation_placement)
    spec, cluster = model.model_spec(pp), cluster_spec(config, auto, gbps, sharding)
    if family == "pipemesh-auto":
        if sharding:
            plan, _ = plan_with_sharding(pp, vpp, m, costs_for, limit, spec, cluster, options=options)
        else:
            plan, _ = plan_schedule(pp, vpp, m, costs_for, limit, options)
    else:
        sched = ScheduleConfig(pp, vpp, m, *groups)
        if sharding:
            plan = fit_levels(sched, costs_for(sched), limit, options, spec, cluster)
        else:
            plan = fit_with_recompute(sched, costs_for(sched), limit, options)
    os.makedirs(plan_dir, exist_ok=True)
    path = os.path.join(plan_dir, f"{config.name}-{family}.json")
    run_plan = plan.run_plan()
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(run_plan.to_json())
    recomputed, host_placed = len(run_plan.recomputed), len(run_plan.host_placement)
    levels = peak_memory = None
    fits_predicted = plan.fits
    if sharding:
        levels = tuple(plan.sharding.spec.levels)
        # The runtime hands Megatron's optimizer step whole buffers (docs/sharding.md, Limits): the planner's
        # peak (during the schedule) or the step's, whichever is larger.
        step = step_state_bytes(model, config, plan.config, levels, cluster)
        peak_memory = tuple(max(r.peak_memory_bytes, s) for r, s in zip(plan.result.ranks, step))
        fits_predicted = plan.fits and max(peak_memory) <= limit
    return RunSpec(name=family, family=family, groups=(plan.config.forward_groups, plan.config.backward_groups),
                   plan_path=path, recomputed=recomputed, host_placed=host_placed,
                   predicted_peak_bytes=tuple(r.peak_activation_bytes for r in plan.result.ranks),
                   predicted_iteration_s=plan.result.iteration_s, predicted_fits=fits_predicted, sharding=levels,
                   predicted_state_bytes=state_bytes(model, config, plan.config, levels, cluster) if sharding else None,
                   predicted_peak_memory_bytes=peak_memory)


def fits(peaks: Optional[Sequence[Optional[float]]], budget: Optional[float]) -> bool:
    """A row fits when every rank's measured peak is known and within the budget (always without one)."""
    if budget is None:
        return True
    return bool(peaks) and all(p is not None and p <= budget for p in peaks)


def best_stock(rows: Sequence[dict], default_only: bool = False) -> Optional[dict]:
    """The fastest stock row that fits (rows: ``stock``, ``fits``, ``tokens_per_s``; ``default_only``: only rows of
    Megatron's default command, ``default``); None if none does."""
    candidates = [r for r in rows if r.get("stock") and r.get("fits") and r.get("tokens_per_s")
                  and (r.get("default") or not default_only)]
    return max(candidates, key=lambda r: r["tokens_per_s"]) if candidates else None
