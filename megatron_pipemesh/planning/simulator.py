"""Discrete-event simulation of a schedule: iteration time, idle/bubble/exposed communication and
a memory timeline per rank.

Built on :func:`megatron_pipemesh.schedule.timeline.execute` (the same engine as the deadlock dry
run), with durations from :class:`~.costs.OpCosts`. Memory per rank = static (weights, grads,
optimizer) + the activations of every chunk-micro-batch whose forward has started and whose
backward has not finished.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ..schedule.config import ScheduleConfig
from ..schedule.lower import LoweredSchedule, LoweringOptions, lower
from ..schedule.ops import OpKind
from ..schedule.timeline import Timeline, execute
from .costs import GB, OpCosts, ScheduleCosts

RecomputePlan = Dict[Tuple[int, int, int], str]
"""(rank, chunk, micro-batch) -> 'none' | 'selective' | 'full'; missing means 'none'."""


@dataclass
class RankResult:
    rank: int
    busy_s: float
    """Compute time (forward + backward + recompute)."""
    idle_s: float
    """Iteration time minus busy time."""
    exposed_p2p_s: float
    """Idle time spent waiting for pipeline transfers in flight."""
    exposed_dp_s: float
    """Idle time waiting for parameter gathers plus the gradient-sync tail after the last backward."""
    bubble_s: float
    """Idle time that no communication explains (pipeline fill/drain and dependency bubbles)."""
    peak_activation_bytes: float
    peak_memory_bytes: float
    peak_live: int
    """Peak number of live chunk-micro-batches."""
    recompute_s: float


@dataclass
class SimulationResult:
    config: ScheduleConfig
    iteration_s: float
    ranks: List[RankResult]
    timeline: Timeline
    memory: List[List[Tuple[float, float]]] = field(default_factory=list)
    """Per rank: (time, bytes) steps of the memory timeline."""

    @property
    def idle_fraction(self) -> float:
        return sum(r.idle_s for r in self.ranks) / (self.iteration_s * len(self.ranks)) if self.iteration_s else 0.0

    @property
    def exposed_comm_s(self) -> float:
        """Mean over ranks of exposed p2p + data-parallel time."""
        return sum(r.exposed_p2p_s + r.exposed_dp_s for r in self.ranks) / len(self.ranks)

    def to_dict(self) -> dict:
        return {
            "schedule": self.config.describe(),
            "forward_groups": list(self.config.forward_groups),
            "backward_groups": list(self.config.backward_groups),
            "iteration_s": self.iteration_s,
            "idle_fraction": self.idle_fraction,
            "exposed_comm_s": self.exposed_comm_s,
            "ranks": [
                {"rank": r.rank, "busy_s": r.busy_s, "idle_s": r.idle_s, "exposed_p2p_s": r.exposed_p2p_s,
                 "exposed_dp_s": r.exposed_dp_s, "bubble_s": r.bubble_s, "peak_live": r.peak_live,
                 "peak_activation_gb": r.peak_activation_bytes / GB, "peak_memory_gb": r.peak_memory_bytes / GB,
                 "recompute_s": r.recompute_s}
                for r in self.ranks
            ],
        }


def lowering_for(costs: OpCosts) -> LoweringOptions:
    """Emit parameter gathers only when they cost something (distributed optimizer over DP > 1)."""
    return LoweringOptions(param_sync=costs.dp_gather_s > 0, grad_sync=True)


def simulate(config: ScheduleConfig, costs: OpCosts, recompute: Optional[RecomputePlan] = None,
             schedule: Optional[LoweredSchedule] = None, sharding=None) -> SimulationResult:
    """Simulate one iteration of ``config`` (or a prebuilt lowered ``schedule``) under ``costs``;
    ``sharding`` (a :class:`.sharding.ShardingModel`) adds mixed sharding: its ops, their costs, the
    resident bytes per rank and the gathered weights / gradient buffers on the memory timeline."""
    if sharding is None:
        schedule = schedule or lower(config, lowering_for(costs))
        adapter = ScheduleCosts(config, costs, recompute)
    else:
        schedule = schedule or lower(config, sharding.lowering(lowering_for(costs)))
        adapter = sharding.adapter(config, costs, recompute)
        splits = sharding.splits(config)
    timeline = execute(schedule, adapter)
    optimizer = [costs.optimizer_s[r] if r < len(costs.optimizer_s) else 0.0 for r in range(config.pp)]
    # Each rank steps its optimizer once its own gradients are reduced; the iteration ends with the slowest.
    end = max(timeline.rank_end[r] + optimizer[r] for r in range(config.pp))
    ranks, memory = [], []
    for rank in range(config.pp):
        events = timeline.compute[rank]
        busy = sum(e.end - e.start for e in events)
        recompute_s = sum(costs.recompute_s[adapter.level(rank, e.op)] for e in events if e.op.kind is OpKind.BACKWARD)
        waits_p2p = sum(e.comm_part for e in events if e.waited_on == "p2p")
        waits_param = sum(e.comm_part for e in events if e.waited_on == "param")
        last_compute = max(e.end for e in events)
        dp_tail = max(0.0, timeline.rank_end[rank] - last_compute)  # the optimizer step is neither idle nor comm
        idle = end - busy - optimizer[rank]
        exposed_dp = waits_param + dp_tail
        static = costs.static_bytes[rank] if rank < len(costs.static_bytes) else 0.0
        deltas, buffer_deltas = [], []
        if sharding is not None:
            static = splits[rank].state.resident
            buffer_deltas = sharding.memory_deltas(rank, timeline, splits)
        for e in events:
            size = adapter.activation(rank, e.op)
            if e.op.kind is OpKind.FORWARD:
                deltas.append((e.start, 1, size))
            else:
                # Recomputation re-creates activations inside the backward: held from its start.
                transient = costs.transient_bytes.get(adapter.level(rank, e.op), 0.0)
                deltas.append((e.start, 0, transient))
                deltas.append((e.end, -1, -size - transient))
        # Sharding buffers (count None) change the total but not the activation peak.
        deltas += [(t, None, size) for t, size in buffer_deltas]
        deltas.sort(key=lambda d: (d[0], -1 if d[1] is None and d[2] < 0 else (d[1] if d[1] is not None else 0)))  # frees first
        live = peak_live = 0
        act = peak_act = buffers = 0.0
        peak_total = static
        steps = [(0.0, static)]
        for t, count, size in deltas:
            if count is None:
                buffers += size
            else:
                live += count
                act += size
            peak_live = max(peak_live, live)
            peak_act = max(peak_act, act)
            peak_total = max(peak_total, static + act + buffers)
            steps.append((t, static + act + buffers))
        memory.append(steps)
        ranks.append(RankResult(rank, busy, idle, waits_p2p, exposed_dp, max(0.0, idle - waits_p2p - exposed_dp),
                                peak_act, peak_total, peak_live, recompute_s))
    return SimulationResult(config, end, ranks, timeline, memory)
