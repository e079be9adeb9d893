"""What a user sees of PipeMesh in the training log.

* :func:`announce_plan`: once at start-up (rank 0), the ``PipeMesh plan:`` line (p, V, m, groups,
  the plan digest the runtime will check, recomputation, predicted peak activation memory per rank,
  predicted iteration time next to depth-first and breadth-first) and, with
  ``--pipemesh-print-schedule``, the text timeline of the first pipeline ranks.
* :class:`IntervalReport`: every ``--log-interval``, PipeMesh's own per-iteration figures next to
  Megatron's iteration line (exposed pipeline wait and data-parallel wait per rank, measured peak
  activation memory per rank), also to TensorBoard / W&B when Megatron's writers are on. The figures
  come from the runtime's per-call statistics; one small all-gather per log interval (never per
  iteration) brings them to the last rank, which prints Megatron's line.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

from ..planning.costs import ScheduleCosts, analytic_costs
from ..planning.planner import baseline_plans
from ..planning.simulator import simulate
from ..schedule.config import ScheduleConfig
from ..schedule.levers import DEVICE, Lever
from ..schedule.lower import host_placement_of, lower
from ..schedule.plan import RunPlan
from .flags import microbatches_per_iteration

MiB = 1024.0 ** 2
PICTURE_RANKS = 4
"""Pipeline ranks drawn by --pipemesh-print-schedule (the picture of 64 ranks helps nobody)."""


def megatron_syncs(args) -> Dict[str, bool]:
    """The data-parallel sync points Megatron drives for these args (``RunPlan.lowering``'s ``param_sync`` /
    ``grad_sync``): ``train()`` sets ``grad_sync_func`` only with ``--overlap-grad-reduce`` and
    ``align_grad_reduce``, ``param_sync_func`` only with ``--overlap-param-gather`` and ``--align-param-gather``
    (megatron/training/training.py); the runtime lowers with the functions it is given."""
    return {"param_sync": bool(getattr(args, "overlap_param_gather", False) and getattr(args, "align_param_gather", False)),
            "grad_sync": bool(getattr(args, "overlap_grad_reduce", False) and getattr(args, "align_grad_reduce", True))}


def training_config(args, plan: RunPlan) -> ScheduleConfig:
    """The schedule of this run's training iterations (the plan's groups, else Megatron's group size)."""
    if plan.schedule is not None:
        return plan.schedule
    return plan.config_for(args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size,
                           microbatches_per_iteration(args), getattr(args, "microbatch_group_size_per_vp_stage", None))


@dataclass
class Prediction:
    """Simulated iteration of the plan and of the stock orders, from analytic costs."""

    iteration_s: float
    peak_activation_bytes: List[float]
    depth_first_s: float
    breadth_first_s: float
    source: str
    """Where the costs came from (shown in brackets after the prediction)."""
    host_bytes: List[float] = field(default_factory=list)
    """Per rank: activation bytes of its chunk-micro-batches placed on the host (one iteration, summed)."""


def predict(args, config: ScheduleConfig, recompute: Optional[Dict] = None,
            ranks_per_node: Optional[int] = None) -> Optional[Prediction]:
    """Predict ``config`` (with its recomputation) for this run (``ranks_per_node``: the node scope's nodes); None
    when the model shape is unknown."""
    from .auto_plan import costs_source, device_rate, model_and_cluster

    model_args = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size")
    if any(getattr(args, name, None) is None for name in model_args):
        return None
    rate = device_rate(args, "the predicted iteration")
    source = costs_source(rate)
    model, cluster = model_and_cluster(args, rate, ranks_per_node=ranks_per_node)
    costs = analytic_costs(model, cluster, config)
    result = simulate(config, costs, recompute or {})
    placed = ScheduleCosts(config, costs, recompute or {})
    host_bytes = [0.0] * config.pp
    for rank, chunk, _ in host_placement_of(recompute):
        host_bytes[rank] += placed.bytes_at(rank, chunk, DEVICE)
    baselines = baseline_plans(config.pp, config.vpp, config.microbatches, lambda cfg: analytic_costs(model, cluster, cfg),
                               float("inf"))  # stock orders as they are, without recomputation
    return Prediction(result.iteration_s, [r.peak_activation_bytes for r in result.ranks],
                      baselines["depth-first"].result.iteration_s, baselines["breadth-first"].result.iteration_s, source,
                      host_bytes)


def split_summary(args, config: ScheduleConfig) -> str:
    """'layers per stage 1 2 2 1' for an uneven split of Megatron's flags ('' when even or unknown)."""
    from .auto_plan import layer_split

    try:
        split = layer_split(args)
        return "" if split.even else split.describe(args.num_layers, config.pp, config.vpp)
    except (ValueError, TypeError) as error:  # a report must not stop training
        return f"layer split unknown ({error})"


def sharding_summary(args, config: ScheduleConfig, plan: RunPlan, ranks_per_node: Optional[int] = None) -> str:
    """The levels and the model's weights + grads + optimizer bytes per pipeline rank for them and for ZeRO-1
    everywhere (the runtime prints the measured bytes next to its own prediction at iteration 2)."""
    from ..planning.sharding import ShardingSpec, rank_splits
    from .auto_plan import DeviceRate, model_and_cluster

    levels, scope = plan.sharding, plan.shard_scope
    text = f"sharding {' '.join(levels)}" + (f" (scope node, ranks per node: {ranks_per_node})"
                                             if scope == "node" else "")
    try:
        model, cluster = model_and_cluster(args, DeviceRate(1.0, 1.0), ranks_per_node=ranks_per_node)
        mine = rank_splits(model, cluster, config, ShardingSpec(tuple(levels), scope))
        zero1 = rank_splits(model, cluster, config, ShardingSpec(("optim",) * config.vpp, scope))
    except Exception as error:  # a report must not stop training
        return f"{text} (no memory prediction: {type(error).__name__}: {error})"
    return (f"{text}: predicted weights+grads+optimizer MiB per pipeline rank "
            f"{' '.join(f'{s.state.resident / MiB:.2f}' for s in mine)} (optim everywhere "
            f"{' '.join(f'{s.state.resident / MiB:.2f}' for s in zero1)}; measured at iteration 2)")


def recompute_summary(recompute: Optional[Dict], config: ScheduleConfig) -> str:
    total = config.pp * config.vpp * config.microbatches
    counts: Dict[str, int] = {}
    for level in (recompute or {}).values():
        if Lever.parse(level).recomputes:  # host placement has its own part of the line
            counts[level] = counts.get(level, 0) + 1
    if not counts:
        return "recompute none"
    return "recompute " + ", ".join(f"{level} {n}" for level, n in sorted(counts.items())) + \
        f" of {total} chunk-micro-batches"


def host_summary(recompute: Optional[Dict], config: ScheduleConfig, host_bytes: Optional[Sequence[float]] = None) -> str:
    """``host N (X MiB) ...`` per pipeline rank: chunk-micro-batches whose activations wait in host memory
    (and their bytes per iteration, when the model shape is known); empty without host placement."""
    counts = [0] * config.pp
    for rank, _, _ in host_placement_of(recompute):
        counts[rank] += 1
    if not any(counts):
        return ""
    if host_bytes:
        per_rank = " ".join(f"{n} ({b / MiB:.1f} MiB)" for n, b in zip(counts, host_bytes))
    else:
        per_rank = " ".join(str(n) for n in counts)
    return f"host {per_rank} per rank"


def plan_line(args, settings) -> str:
    """The one-line ``PipeMesh plan:`` summary of validated settings (:class:`~.flags.PipeMeshArgs`)."""
    plan: RunPlan = settings.plan
    config = training_config(args, plan)
    digest = lower(config, plan.lowering(**megatron_syncs(args))).digest()
    given = settings.flags.schedule
    origin = (f"plan file {given.plan}" if given.plan else "planned by auto" if given.forward_groups == "auto"
              else "given groups" if given.forward_groups else "Megatron's group size")
    parts = [f"p={config.pp} V={config.vpp} m={config.microbatches}", config.group_flags(), f"digest {digest}",
             recompute_summary(plan.placement, config)]
    split = split_summary(args, config)
    if split:
        parts[0] += f" ({split})"
    if plan.sharding:
        parts.append(sharding_summary(args, config, plan, settings.ranks_per_node))
    try:
        prediction = predict(args, config, plan.placement, settings.ranks_per_node)
    except Exception as error:  # a report must not stop training; say why there is no prediction
        prediction = None
        parts.append(f"no prediction ({type(error).__name__}: {error})")
    host = host_summary(plan.placement, config, prediction.host_bytes if prediction is not None else None)
    if host:
        parts.insert(4, host)
    if prediction is not None:
        peaks = " ".join(f"{b / MiB:.2f}" for b in prediction.peak_activation_bytes)
        parts.append(f"predicted peak activation MiB per rank {peaks}")
        parts.append(f"predicted iteration {prediction.iteration_s * 1e3:.1f} ms (depth-first "
                     f"{prediction.depth_first_s * 1e3:.1f} ms, breadth-first {prediction.breadth_first_s * 1e3:.1f} ms) "
                     f"[{prediction.source}]")
    return f"PipeMesh plan: {' | '.join(parts)} | {origin}"


def schedule_picture(config: ScheduleConfig, ranks: int = PICTURE_RANKS) -> str:
    """``pipemesh show --picture`` of the first ``ranks`` pipeline ranks."""
    from ..planning.ascii import render_ascii
    from ..schedule.timeline import execute

    picture = render_ascii(execute(lower(config)))
    lines = picture.splitlines()
    shown = lines[:ranks]
    more = (f"\n  ... {len(lines) - ranks} more ranks (pipemesh show --picture --pp {config.pp} --vpp {config.vpp} "
            f"-m {config.microbatches} {config.group_flags()})") if len(lines) > ranks else ""
    return "PipeMesh schedule (F = 1, B = 2 time units, free communication):\n" + "\n".join(shown) + more


def announce_plan(args, settings) -> None:
    """Print the plan line (and picture) once, on global rank 0, before any process group exists."""
    if not settings.enabled or os.environ.get("RANK", "0") != "0":
        return
    print(plan_line(args, settings), flush=True)
    if settings.flags.measurement.print_schedule:
        print(schedule_picture(training_config(args, settings.plan)), flush=True)


# Per log interval --------------------------------------------------------------------------------
@dataclass
class _Totals:
    iterations: int = 0
    timed_waits: bool = True
    pipeline_wait_s: float = 0.0
    dp_wait_s: float = 0.0
    total_s: float = 0.0
    peak_activation_bytes: int = 0
    memory_source: str = ""
    peak_host_bytes: int = 0


@dataclass
class IntervalReport:
    """Accumulates the runtime's per-iteration statistics and reports them every log interval."""

    totals: _Totals = field(default_factory=_Totals)
    _seen: object = None

    def add(self, stats) -> None:
        """Account one training call of the schedule (``RuntimeStats``); repeated reads are ignored."""
        if stats is None or stats.forward_only or stats is self._seen:
            return
        self._seen = stats
        t = self.totals
        t.iterations += 1
        t.timed_waits = t.timed_waits and stats.timed_waits
        t.pipeline_wait_s += stats.recv_wait_s + stats.send_drain_s
        t.dp_wait_s += stats.dp_sync_s
        t.total_s += stats.total_s
        t.peak_host_bytes = max(t.peak_host_bytes, getattr(stats, "peak_host_bytes", 0))
        if stats.memory_source:
            t.peak_activation_bytes = max(t.peak_activation_bytes, stats.peak_activation_bytes)
            t.memory_source = stats.memory_source

    def local_figures(self) -> Dict[str, float]:
        t = self.totals
        n = max(t.iterations, 1)
        waits = t.timed_waits
        return {"pipeline_wait_ms": 1e3 * t.pipeline_wait_s / n if waits else None,
                "dp_wait_ms": 1e3 * t.dp_wait_s / n if waits else None,
                "forward_backward_ms": 1e3 * t.total_s / n, "peak_activation_mib": t.peak_activation_bytes / MiB,
                "memory_source": t.memory_source, "iterations": t.iterations,
                "peak_host_mib": t.peak_host_bytes / MiB}


def format_interval(iteration: int, figures: Sequence[Dict]) -> Optional[str]:
    if not figures or not any(f["iterations"] for f in figures):
        return None

    def column(key: str, fmt: str = "{:.1f}") -> str:
        return " ".join("n/a" if f[key] is None else fmt.format(f[key]) for f in figures)

    parts = [f"forward-backward ms/iter {column('forward_backward_ms')}"]
    if all(f["pipeline_wait_ms"] is not None for f in figures):
        parts += [f"pipeline wait ms/iter {column('pipeline_wait_ms')}",
                  f"data-parallel wait ms/iter {column('dp_wait_ms')}"]
    line = f"PipeMesh [iteration {iteration}] per rank: " + " | ".join(parts)
    if all(f["memory_source"] for f in figures):
        line += f" | peak activation MiB {column('peak_activation_mib', '{:.2f}')} ({figures[0]['memory_source']})"
    if any(f.get("peak_host_mib") for f in figures):  # activations placed in host memory (device peak excludes them)
        line += f" | peak host MiB {' '.join('{:.2f}'.format(f.get('peak_host_mib', 0.0)) for f in figures)}"
    return line


INTERVAL_RE = re.compile(r"PipeMesh \[iteration (\d+)\] per rank: (.*)$")


def parse_interval_line(line: str) -> Optional[Dict[str, object]]:
    """The figures of a line written by :func:`format_interval` ({'iteration': n, name: [per rank]})."""
    match = INTERVAL_RE.search(line)
    if not match:
        return None
    out: Dict[str, object] = {"iteration": int(match.group(1))}
    for part in match.group(2).split(" | "):
        name, _, rest = part.partition(" ms/iter ") if " ms/iter " in part else part.partition(" MiB ")
        values = rest.split(" (")[0].split()
        out[name.strip()] = [None if v == "n/a" else float(v) for v in values]
    return out


def write_scalars(iteration: int, figures: Sequence[Dict], tensorboard=None, wandb=None) -> None:
    """Per-rank figures to Megatron's TensorBoard / W&B writers (those that are on)."""
    scalars = {}
    hosted = any(f.get("peak_host_mib") for f in figures)  # host placement on some rank
    for rank, f in enumerate(figures):
        for key in ("pipeline_wait_ms", "dp_wait_ms", "forward_backward_ms", "peak_activation_mib", "peak_host_mib"):
            if f.get(key) is None or (key == "peak_host_mib" and not hosted) or (key == "peak_activation_mib" and not f["memory_source"]):
                continue
            scalars[f"pipemesh/{key}/rank{rank}"] = f[key]
    if tensorboard is not None:
        for name, value in scalars.items():
            tensorboard.add_scalar(name, value, iteration)
    if wandb is not None:
        wandb.log(scalars, iteration)


_INTERVAL = IntervalReport()


def _gather_figures(local: Dict) -> List[Dict]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [local]
    figures: List[Optional[Dict]] = [None] * dist.get_world_size()
    dist.all_gather_object(figures, local)
    return figures  # type: ignore[return-value]


def after_training_log(iteration: int, args, schedule) -> None:
    """Called on every rank after Megatron's ``training_log`` of each iteration."""
    if schedule is None:
        return
    _INTERVAL.add(getattr(schedule, "last_stats", None))
    interval = getattr(args, "log_interval", 0) or 0
    if not interval or iteration % interval:
        return
    import torch.distributed as dist

    figures = _gather_figures(_INTERVAL.local_figures())
    _INTERVAL.totals = _Totals()
    line = format_interval(iteration, figures)
    last = not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1
    if line is None or not last:  # Megatron prints its iteration line on the last rank
        return
    print(line, flush=True)
    from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

    write_scalars(iteration, figures, get_tensorboard_writer(), get_wandb_writer())


def patch_training_log(training, reported_schedule: Callable[[], object]) -> None:
    """Wrap ``megatron.training.training.training_log`` (called by every rank once per iteration) to report the
    statistics of ``reported_schedule()`` after it."""
    original = training.training_log
    if getattr(original, "_pipemesh", False):
        return
    import functools

    @functools.wraps(original)
    def training_log(*args, **kwargs):
        result = original(*args, **kwargs)
        from megatron.training.global_vars import get_args

        iteration = kwargs["iteration"] if "iteration" in kwargs else args[3]
        after_training_log(iteration, get_args(), reported_schedule())
        return result

    training_log._pipemesh = True
    training.training_log = training_log
