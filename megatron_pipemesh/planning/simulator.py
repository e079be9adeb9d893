"""Discrete-event simulation of a schedule: iteration time, idle/bubble/exposed communication and
a memory timeline per rank.

Built on :func:`megatron_pipemesh.schedule.timeline.execute` (the same engine as the deadlock dry
run), with durations from :class:`~.costs.OpCosts` and, where the costs carry a topology, transfers that
share its links max-min fairly (:mod:`.network`). Memory per rank = static (weights, grads,
optimizer) + the activations of every chunk-micro-batch whose forward has started and whose
backward has not finished, except that a chunk-micro-batch placed on the host (plan level 'host')
leaves the device when its OFFLOAD copy ends and is back when its RELOAD copy starts; a second
timeline per rank counts the host memory it holds from the OFFLOAD's start to the RELOAD's end.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from ..schedule.config import ScheduleConfig
from ..schedule.lower import DEFAULT_RELOAD_LOOKAHEAD, LoweredSchedule, LoweringOptions, host_placement_of, lower
from ..schedule.ops import OpKind
from ..schedule.timeline import DeadlineExceeded, Timeline, execute
from .costs import GB, OpCosts, ScheduleCosts
from .memory import host_block_bytes

RecomputePlan = Dict[Tuple[int, int, int], str]
"""(rank, chunk, micro-batch) -> lever (:class:`..schedule.levers.Lever` or its name); missing means 'none'."""

TimeUp = Optional[Callable[[], bool]]
"""A search's time limit: asked before each simulation; True stops the search with :class:`SearchTimeUp`."""


class SearchTimeUp(Exception):
    """A search stopped before it finished because the time given to it had passed."""


def check_time(time_up: TimeUp) -> None:
    """Raise :class:`SearchTimeUp` if ``time_up`` says the time has passed."""
    if time_up is not None and time_up():
        raise SearchTimeUp("the time given to the search has passed")


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
    """Idle time waiting for parameter gathers and, before a backward of a ZeRO-2/3 chunk, for its previous group's
    reduction, plus the gradient-sync tail after the last backward (the embedding all-reduce of the first and last
    stage included)."""
    bubble_s: float
    """Idle time that no communication explains (pipeline fill/drain and dependency bubbles)."""
    peak_activation_bytes: float
    peak_memory_bytes: float
    peak_live: int
    """Peak number of live chunk-micro-batches."""
    recompute_s: float
    exposed_host_s: float = 0.0
    """Idle time backwards spent waiting for their activations to come back from host memory."""
    peak_host_bytes: float = 0.0
    """Peak host memory held by this rank's offloaded activations."""
    host_placed: int = 0
    """Chunk-micro-batches whose activations this rank offloads to host memory."""
    peak_pinned_bytes: float = 0.0
    """Peak of the host blocks holding them (each chunk-micro-batch's bytes rounded up to a power of two, as the
    pinned allocator takes them: :func:`.memory.host_block_bytes`); what the host budget limits."""


@dataclass
class SimulationResult:
    config: ScheduleConfig
    iteration_s: float
    ranks: List[RankResult]
    timeline: Timeline
    memory: List[List[Tuple[float, float]]] = field(default_factory=list)
    """Per rank: (time, bytes) steps of the memory timeline."""
    host_memory: List[List[Tuple[float, float]]] = field(default_factory=list)
    """Per rank: (time, bytes) steps of the host memory its offloaded activations hold (empty: none)."""

    @property
    def idle_fraction(self) -> float:
        return sum(r.idle_s for r in self.ranks) / (self.iteration_s * len(self.ranks)) if self.iteration_s else 0.0

    @property
    def exposed_comm_s(self) -> float:
        """Mean over ranks of exposed p2p + data-parallel time."""
        return sum(r.exposed_p2p_s + r.exposed_dp_s for r in self.ranks) / len(self.ranks)

    @property
    def exposed_host_s(self) -> float:
        """Mean over ranks of the time backwards waited for reloads from host memory."""
        return sum(r.exposed_host_s for r in self.ranks) / len(self.ranks)

    def to_dict(self) -> dict:
        return {
            "schedule": self.config.describe(),
            "forward_groups": list(self.config.forward_groups),
            "backward_groups": list(self.config.backward_groups),
            "iteration_s": self.iteration_s,
            "idle_fraction": self.idle_fraction,
            "exposed_comm_s": self.exposed_comm_s,
            "exposed_host_s": self.exposed_host_s,
            "ranks": [
                {"rank": r.rank, "busy_s": r.busy_s, "idle_s": r.idle_s, "exposed_p2p_s": r.exposed_p2p_s,
                 "exposed_dp_s": r.exposed_dp_s, "bubble_s": r.bubble_s, "peak_live": r.peak_live,
                 "peak_activation_gb": r.peak_activation_bytes / GB, "peak_memory_gb": r.peak_memory_bytes / GB,
                 "recompute_s": r.recompute_s, "exposed_host_s": r.exposed_host_s,
                 "peak_host_gb": r.peak_host_bytes / GB, "host_placed": r.host_placed}
                for r in self.ranks
            ],
        }


def lowering_for(costs: OpCosts, recompute: Optional[RecomputePlan] = None,
                 reload_lookahead: int = DEFAULT_RELOAD_LOOKAHEAD) -> LoweringOptions:
    """Emit parameter gathers only when they cost something (distributed optimizer over DP > 1), and
    the host copies of the plan's 'host' chunk-micro-batches."""
    return LoweringOptions(param_sync=costs.dp_gather_s > 0, grad_sync=True,
                           host_placement=host_placement_of(recompute), reload_lookahead=reload_lookahead)


def simulate(config: ScheduleConfig, costs: OpCosts, recompute: Optional[RecomputePlan] = None,
             schedule: Optional[LoweredSchedule] = None, sharding=None,
             deadline_s: Optional[float] = None) -> SimulationResult:
    """Simulate one iteration of ``config`` (or a prebuilt lowered ``schedule``, whose host placement
    must be the plan's) under ``costs``; ``sharding`` (a :class:`.sharding.ShardingModel`) adds mixed
    sharding: its ops, their costs, the resident bytes per rank and the gathered weights / gradient
    buffers on the memory timeline. ``deadline_s``: raise :class:`.timeline.DeadlineExceeded` as soon as the
    iteration is known to end after it (a search that keeps only faster schedules; one ending exactly then
    runs to its end)."""
    if sharding is None:
        schedule = schedule or lower(config, lowering_for(costs, recompute))
        adapter = ScheduleCosts(config, costs, recompute)
    else:
        schedule = schedule or lower(config, sharding.lowering(lowering_for(costs, recompute)))
        adapter = sharding.adapter(config, costs, recompute)
        splits = sharding.splits(config)
    if schedule.options.host_placement != host_placement_of(recompute):
        raise ValueError("the lowered schedule's host placement differs from the plan's 'host' entries: lower it "
                         "with lowering_for(costs, plan)")
    timeline = execute(schedule, adapter, deadline_s)
    optimizer = [costs.optimizer_s[r] if r < len(costs.optimizer_s) else 0.0 for r in range(config.pp)]
    if sharding is not None:
        optimizer = sharding.optimizer_seconds(optimizer)
    # Each rank steps its optimizer once its own gradients are reduced; the iteration ends with the slowest.
    end = max(timeline.rank_end[r] + optimizer[r] for r in range(config.pp))
    copies: List[list] = [[] for _ in range(config.pp)]
    for c in timeline.comms:
        if c.lane in ("d2h", "h2d"):
            copies[c.src].append(c)
    ranks, memory, host_memory = [], [], []
    for rank in range(config.pp):
        events = timeline.compute[rank]
        busy = sum(e.end - e.start for e in events)
        recompute_s = sum(adapter.recompute_time(rank, e.op) for e in events if e.op.kind is OpKind.BACKWARD)
        waits_p2p = sum(e.comm_part for e in events if e.waited_on == "p2p")
        # ZeRO-3 gathers and the ZeRO-2/3 reductions a backward waits for: exposed data-parallel time
        waits_param = sum(e.comm_part for e in events if e.waited_on == "param" or e.waited_on == "reduce")
        waits_host = sum(e.comm_part for e in events if e.waited_on == "host")
        if costs.host_copies_on_compute:  # each copy held the compute stream: all of it exposed
            waits_host += sum(c.end - c.start for c in copies[rank])
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
                transient = adapter.transient(rank, e.op.chunk, adapter.kept_level(rank, e.op))
                deltas.append((e.start, 0, transient))
                deltas.append((e.end, -1, -size - transient))
        host_deltas = []
        for c in copies[rank]:
            size = adapter.activation(rank, c.op)
            if c.op.kind is OpKind.OFFLOAD:  # off the device once copied; host buffer filled from the copy's start
                deltas.append((c.end, -1, -size))
                host_deltas.append((c.start, size))
            else:  # back on the device from the reload's start; host buffer free once copied
                deltas.append((c.start, 1, size))
                host_deltas.append((c.end, -size))
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
        host = peak_host = pinned = peak_pinned = 0.0
        host_steps = []
        for t, size in sorted(host_deltas, key=lambda d: (d[0], d[1])):
            host += size
            pinned += math.copysign(host_block_bytes(abs(size)), size)
            peak_host, peak_pinned = max(peak_host, host), max(peak_pinned, pinned)
            host_steps.append((t, host))
        memory.append(steps)
        host_memory.append(host_steps)
        exposed = waits_p2p + exposed_dp + waits_host
        ranks.append(RankResult(rank, busy, idle, waits_p2p, exposed_dp, max(0.0, idle - exposed),
                                peak_act, peak_total, peak_live, recompute_s, waits_host, peak_host,
                                sum(1 for c in copies[rank] if c.op.kind is OpKind.OFFLOAD), peak_pinned))
    return SimulationResult(config, end, ranks, timeline, memory, host_memory)
