"""A lower bound on the iteration time of *any* pipeline schedule, under the planner's cost model.

The study compares PipeMesh with the best stock schedule; this module answers the question behind
its targets: how much faster than the best stock schedule could any schedule be, with the same
costs? ``headroom = best stock time / bound`` is an upper bound on every schedule's ratio to best
stock (PipeMesh's included), whatever its groups, recomputation, activation placement or V.

For every V (the bound is the least over V) and every pipeline rank r, a schedule needs at least:

* **compute**: r forwards before rank r's first input exists (stage r waits for stages 0..r-1), or
  the smallest parameter gather of its chunks if longer (its first forward waits for its chunk's
  gather), then every forward and backward of its chunks on every micro-batch at no recomputation
  (one compute stream per rank), then the smallest gradient reduction of its chunks and its
  optimizer step (its last backward is its chunk's last, whose reduction follows it) or, if longer,
  r backwards (its last op is the backward of its stage r for some micro-batch, whose backwards on
  stages r-1..0 follow on the other ranks): the pipeline's fill and drain, (p-1)(f+b) of one chunk
  on the ends;
* **data parallel**: every parameter gather and gradient reduction of its chunks on its one
  data-parallel channel (the timeline's model: one channel per rank, collectives in issue order),
  then its optimizer step, which follows its last reduction. Every gather ends before any reduction
  starts (a chunk's last backward needs every chunk's forwards, and a forward its chunk's gather); a
  reduction starts after its chunk's m forwards and m backwards; the chunk gathered last still runs
  its m forwards and m backwards and its reduction after the gathers. ZeRO-1 traffic, the least of the
  data-parallel-scope sharding levels (ZeRO-2/3 only add gathers and reductions);
* **pipeline**: every activation it sends downstream, one after another on that directed link (a
  FIFO channel in the timeline): m transfers per stage it holds that is not the last one, each
  busying the link for the cost model's transfer time (the same for the gradients sent upstream).

Both are valid for the simulator's timelines: nothing in them is shorter than its op's cost, and
no bound counts an overlap twice. Memory is ignored (a looser, still valid bound): a schedule that
has to recompute or copy to the host is slower than its bound, never faster.

Pure: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

from ..schedule.config import ScheduleConfig
from ..schedule.levers import DEVICE
from ..schedule.ops import Op, OpKind
from .costs import ClusterSpec, ModelSpec, ScheduleCosts, analytic_costs


@dataclass(frozen=True)
class IterationBound:
    """The least iteration time any schedule of one (model, cluster, p, m) can reach."""

    seconds: float
    """The bound: the least over V of the slowest rank's max(compute, data-parallel) need."""
    vpp: int
    """The V that gives the bound."""
    compute_s: float
    """At that V: the largest per-rank compute need (pipeline fill + forwards + backwards + optimizer step)."""
    data_parallel_s: float
    """At that V: the largest per-rank data-parallel need (gathers + reductions + optimizer step)."""
    pipeline_s: float = 0.0
    """At that V: the busiest directed pipeline link's transfers."""

    @property
    def bottleneck(self) -> str:
        """'compute', 'data-parallel' or 'pipeline': which need sets the bound."""
        needs = {"compute": self.compute_s, "data-parallel": self.data_parallel_s, "pipeline": self.pipeline_s}
        return max(needs, key=needs.get)

    def to_dict(self) -> dict:
        return {"seconds": self.seconds, "vpp": self.vpp, "compute_s": self.compute_s,
                "data_parallel_s": self.data_parallel_s, "pipeline_s": self.pipeline_s,
                "bottleneck": self.bottleneck}


def bound_for(config: ScheduleConfig, costs: ScheduleCosts) -> IterationBound:
    """The bound of one fixed V (``config`` only gives p, V, m; its groups do not matter)."""
    c = costs.costs
    compute = data_parallel = 0.0
    for rank in range(config.pp):
        step = c.optimizer_s[rank] if rank < len(c.optimizer_s) else 0.0
        busy = sum(costs.compute(rank, Op(kind, chunk, 0)) for chunk in range(config.vpp)
                   for kind in (OpKind.FORWARD, OpKind.BACKWARD)) * config.microbatches
        gathers = [costs.data_parallel(rank, Op(OpKind.PARAM_SYNC, chunk)) for chunk in range(config.vpp)]
        reductions = [costs.data_parallel(rank, Op(OpKind.GRAD_SYNC, chunk)) for chunk in range(config.vpp)]
        # The first forward waits for its inputs (r upstream forwards) and its chunk's gather; the last
        # backward is its chunk's last, so that chunk's reduction follows all compute.
        # Rank r's last op is a backward of its stage r (a micro-batch's backward on a rank ends at its
        # lowest stage); stages r-1..0 of that micro-batch still run their backwards on other ranks.
        compute = max(compute, max(rank * c.forward_s, min(gathers)) + busy + max(rank * c.backward_s, min(reductions) + step))
        # Every gather ends before any reduction starts (a chunk's last backward needs every chunk's
        # forwards), and a reduction starts after its chunk's m forwards and m backwards.
        chunk = config.microbatches * min(costs.compute(rank, Op(OpKind.FORWARD, k, 0)) +
                                          costs.compute(rank, Op(OpKind.BACKWARD, k, 0)) for k in range(config.vpp))
        data_parallel = max(data_parallel, max(sum(gathers), rank * c.forward_s + chunk) + sum(reductions) + step,
                            sum(gathers) + chunk + min(reductions) + step)
    # Rank 0 sends one activation per micro-batch from each of its V stages (none of them is the last).
    pipeline = config.microbatches * config.vpp * c.p2p_s if config.pp > 1 else 0.0
    return IterationBound(max(compute, data_parallel, pipeline), config.vpp, compute, data_parallel, pipeline)


def virtual_sizes(model: ModelSpec, pp: int) -> List[int]:
    """V values stock and PipeMesh try: every divisor of the layers per rank (1 = no interleaving)."""
    per_rank = model.num_layers // pp
    return [v for v in range(1, per_rank + 1) if per_rank % v == 0]


def iteration_lower_bound(model: ModelSpec, cluster: ClusterSpec, pp: int, microbatches: int,
                          vpps: Optional[Sequence[int]] = None) -> IterationBound:
    """The least iteration time of any schedule over ``vpps`` (default: :func:`virtual_sizes`)."""
    best = None
    for vpp in virtual_sizes(model, pp) if vpps is None else vpps:
        config = ScheduleConfig.depth_first(pp, vpp, microbatches)
        bound = bound_for(config, ScheduleCosts(config, analytic_costs(model, cluster, config, levels=(DEVICE,))))
        if best is None or bound.seconds < best.seconds:
            best = bound
    if best is None:
        raise ValueError(f"no V divides the {model.num_layers // pp} layers per pipeline rank")
    return best
