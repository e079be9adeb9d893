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

import dataclasses

from dataclasses import dataclass, field
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

from ..schedule.config import ScheduleConfig
from ..schedule.lower import DEFAULT_RELOAD_LOOKAHEAD, LoweredSchedule, LoweringOptions, host_placement_of, lower
from ..schedule.ops import Op, OpKind
from ..schedule.timeline import DeadlineExceeded, Timeline, execute
from .costs import GB, OpCosts, ScheduleCosts
from .memory import host_block_bytes
from .path_bound import path_bound

PlacementPlan = Dict[Tuple[int, int, int], str]
"""Where each chunk-micro-batch's activations are between its forward and backward: (rank, chunk, micro-batch) ->
lever (:class:`..schedule.levers.Lever` or its name: a recompute level or host memory); missing means on the device."""

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
    """Pinned memory of the host blocks holding them, as the runtime's pool takes it (each chunk-micro-batch's bytes
    rounded up to a power of two, as the pinned allocator takes them: :func:`.memory.host_block_bytes`; per block
    size the most held at once: :func:`pinned_pool_bytes`); what the host budget limits."""
    host_blocks: Dict[int, int] = field(default_factory=dict)
    """Chunk -> bytes of the pinned block each of its host-placed chunk-micro-batches takes on this rank (what the
    runtime's pool allocates up front: ``RunPlan.host_blocks``)."""


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


def lowering_for(costs: OpCosts, placement: Optional[PlacementPlan] = None,
                 reload_lookahead: int = DEFAULT_RELOAD_LOOKAHEAD) -> LoweringOptions:
    """Emit parameter gathers only when they cost something (distributed optimizer over DP > 1), and
    the host copies of the plan's 'host' chunk-micro-batches."""
    return LoweringOptions(param_sync=costs.dp_gather_s > 0 and costs.param_gather_overlapped, grad_sync=True,
                           grad_sync_at_end=not costs.grad_reduce_overlapped,
                           host_placement=host_placement_of(placement), reload_lookahead=reload_lookahead)


def megatron_lowering(costs: OpCosts, config: ScheduleConfig) -> LoweringOptions:
    """:func:`lowering_for` a stock Megatron schedule: its receives posted and its sends waited on as Megatron's own
    schedules do (:attr:`~..schedule.lower.LoweringOptions.megatron_p2p`, ``send_wait`` per collectives library).
    Where the sends wait for their receiver (gloo), a receive's ready notice queues behind the receiver's own
    transfers to the sender when both directions of a rank pair share one communicator: Megatron's batched p2p
    (``batch_p2p_comm``, every V = 1 command) and its unbatched one beyond two stages (``_p2p_ops`` gives a pair of
    two ranks a second communicator, ``group.WORLD``, for one direction)."""
    shared = config.vpp == 1 or config.pp > 2
    return dataclasses.replace(lowering_for(costs), megatron_p2p=True, send_wait=costs.megatron_send_wait,
                               notices_behind_data=shared and costs.megatron_send_wait == "posted")


def megatron_schedule(config: ScheduleConfig, costs: OpCosts, sharding=None) -> LoweredSchedule:
    """The lowered schedule of a stock Megatron row (:func:`megatron_lowering`), with ``sharding``'s ops (a
    :class:`.sharding.ShardingModel`) where given."""
    lowering = megatron_lowering(costs, config)
    return lower(config, sharding.lowering(lowering) if sharding is not None else lowering)


def pinned_pool_bytes(host_deltas: List[Tuple[float, float]]) -> float:
    """Pinned bytes the runtime's pool takes for a rank's host copies (``(time, +bytes)`` when a chunk-micro-batch's
    activations reach the host, ``(time, -bytes)`` when they leave): each takes one block of its bytes rounded up
    to a power of two (:func:`.memory.host_block_bytes`), blocks are never given back and serve keys of their own
    size, so per block size the most blocks held at once, summed over sizes. (At least the peak of the blocks held
    together; more when sizes peak at different times.)"""
    held: Dict[int, int] = {}
    most: Dict[int, int] = {}
    blocks: Dict[float, int] = {}  # a plan has a few sizes (one per chunk kind): each rounded once
    for _, size in sorted(host_deltas):  # by time, then size: gives back before taking at equal times
        block = blocks.get(size)
        if block is None:
            block = blocks[size] = host_block_bytes(abs(size))
        count = held[block] = held.get(block, 0) + (1 if size > 0 else -1)
        if count > most.get(block, 0):
            most[block] = count
    return float(sum(block * count for block, count in most.items()))


def simulate(config: ScheduleConfig, costs: OpCosts, placement: Optional[PlacementPlan] = None,
             schedule: Optional[LoweredSchedule] = None, sharding=None,
             deadline_s: Optional[float] = None) -> SimulationResult:
    """Simulate one iteration of ``config`` (or a prebuilt lowered ``schedule``, whose host placement
    must be the plan's) under ``costs``; ``sharding`` (a :class:`.sharding.ShardingModel`) adds mixed
    sharding: its ops, their costs, the resident bytes per rank and the gathered weights / gradient
    buffers on the memory timeline. ``deadline_s``: raise :class:`.timeline.DeadlineExceeded` as soon as the
    iteration is known to end after it (a search that keeps only faster schedules; one ending exactly then
    runs to its end)."""
    if sharding is None:
        schedule = schedule or lower(config, lowering_for(costs, placement))
    else:
        schedule = schedule or lower(config, sharding.lowering(lowering_for(costs, placement)))
        splits = sharding.splits(config)
    adapter = _adapter(config, costs, placement, sharding)
    if schedule.options.host_placement != host_placement_of(placement):
        raise ValueError("the lowered schedule's host placement differs from the plan's 'host' entries: lower it "
                         "with lowering_for(costs, plan)")
    optimizer = _optimizer_seconds(config, costs, adapter, sharding)
    timeline = execute(schedule, adapter, deadline_s, optimizer)
    # Each rank steps its optimizer once its own gradients are reduced; the iteration ends with the slowest.
    end = max(timeline.rank_end[r] + optimizer[r] for r in range(config.pp))
    copies: List[list] = [[] for _ in range(config.pp)]
    for c in timeline.comms:
        if c.lane in ("d2h", "h2d"):
            copies[c.src].append(c)
    ranks, memory, host_memory = [], [], []
    for rank in range(config.pp):
        static = costs.static_bytes[rank] if rank < len(costs.static_bytes) else 0.0
        buffer_deltas = []
        if sharding is not None:
            static = splits[rank].state.resident
            buffer_deltas = sharding.memory_deltas(rank, timeline, splits)
        device = _device_memory(adapter, rank, timeline.compute[rank], copies[rank], buffer_deltas, static)
        host = _host_memory(adapter, rank, copies[rank])
        memory.append(device.steps)
        host_memory.append(host.steps)
        ranks.append(_rank_result(rank, timeline, adapter, copies[rank], costs.host_copies_on_compute, end,
                                  optimizer[rank], device, host))
    return SimulationResult(config, end, ranks, timeline, memory, host_memory)


def _adapter(config: ScheduleConfig, costs: OpCosts, placement: Optional[PlacementPlan], sharding):
    """The engine's costs of ``config``: :class:`.costs.ScheduleCosts`, or ``sharding``'s own."""
    return ScheduleCosts(config, costs, placement) if sharding is None else sharding.adapter(config, costs, placement)


def _optimizer_seconds(config: ScheduleConfig, costs: OpCosts, adapter, sharding) -> List[float]:
    """Per rank: what follows its last collective, its optimizer step (with the distributed optimizer but no
    overlapped gather, the step gathers every chunk, exposed)."""
    optimizer = [costs.optimizer_s[r] if r < len(costs.optimizer_s) else 0.0 for r in range(config.pp)]
    if sharding is not None:
        return sharding.optimizer_seconds(optimizer)
    if costs.dp_gather_s > 0 and not costs.param_gather_overlapped:
        return [seconds + sum(adapter.data_parallel(r, Op(OpKind.PARAM_SYNC, c)) for c in range(config.vpp))
                for r, seconds in enumerate(optimizer)]
    return optimizer


def lower_bound(config: ScheduleConfig, costs: OpCosts, placement: Optional[PlacementPlan] = None, sharding=None,
                options: Optional[LoweringOptions] = None) -> float:
    """At most :func:`simulate`'s iteration time for the same arguments (``options``: the lowering the schedule is
    simulated with, default :func:`lowering_for`): the critical path of :func:`.path_bound.path_bound`, without
    simulating."""
    if options is None:
        options = lowering_for(costs, placement)
        options = sharding.lowering(options) if sharding is not None else options
    adapter = _adapter(config, costs, placement, sharding)
    return path_bound(config, adapter, options, _optimizer_seconds(config, costs, adapter, sharding))


class _DeviceMemory(NamedTuple):
    """One rank's device memory timeline (:func:`_device_memory`)."""

    steps: List[Tuple[float, float]]
    """(time, bytes) steps: static bytes, activations and sharding buffers."""
    peak_live: int
    peak_activation: float
    peak_total: float


class _HostMemory(NamedTuple):
    """One rank's host memory timeline of offloaded activations (:func:`_host_memory`)."""

    steps: List[Tuple[float, float]]
    peak: float
    peak_pinned: float
    blocks: Dict[int, int]
    """Chunk -> bytes of the pinned block each of its host-placed chunk-micro-batches takes."""


def _device_memory(adapter, rank: int, events, copies, buffer_deltas, static: float) -> _DeviceMemory:
    """A forward holds its chunk-micro-batch's activations from its start, a backward re-creates its recomputation's
    transient bytes from its start and frees both at its end; an offload frees the bytes once copied, a reload holds
    them again from its start; sharding buffers change the total but not the activation peak."""
    deltas = []
    for e in events:
        size = adapter.activation(rank, e.op)
        if e.op.kind is OpKind.FORWARD:
            deltas.append((e.start, 1, size))
        else:
            # Recomputation re-creates activations inside the backward: held from its start.
            transient = adapter.transient(rank, e.op.chunk, adapter.kept_level(rank, e.op))
            deltas.append((e.start, 0, transient))
            deltas.append((e.end, -1, -size - transient))
    for c in copies:
        size = adapter.activation(rank, c.op)
        if c.op.kind is OpKind.OFFLOAD:  # off the device once copied
            deltas.append((c.end, -1, -size))
        else:  # back on the device from the reload's start
            deltas.append((c.start, 1, size))
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
    return _DeviceMemory(steps, peak_live, peak_act, peak_total)


def _host_memory(adapter, rank: int, copies) -> _HostMemory:
    """The host buffer of an offload is filled from the copy's start, that of a reload free once copied; the pinned
    bytes are the runtime's pool of blocks (:func:`pinned_pool_bytes`)."""
    host_deltas, blocks = [], {}
    for c in copies:
        size = adapter.activation(rank, c.op)
        if c.op.kind is OpKind.OFFLOAD:
            blocks[c.op.chunk] = host_block_bytes(size)
        host_deltas.append((c.start, size) if c.op.kind is OpKind.OFFLOAD else (c.end, -size))
    host = peak_host = 0.0
    steps = []
    for t, size in sorted(host_deltas, key=lambda d: (d[0], d[1])):
        host += size
        peak_host = max(peak_host, host)
        steps.append((t, host))
    return _HostMemory(steps, peak_host, pinned_pool_bytes(host_deltas), blocks)


def _rank_result(rank: int, timeline: Timeline, adapter, copies, copies_on_compute: bool, end: float,
                 optimizer_s: float, device: _DeviceMemory, host: _HostMemory) -> RankResult:
    """One rank's times (busy, idle, and what the idle time waited on) and peaks."""
    events = timeline.compute[rank]
    busy = sum(e.end - e.start for e in events)
    recompute_s = sum(adapter.recompute_time(rank, e.op) for e in events if e.op.kind is OpKind.BACKWARD)
    waits_p2p = sum(e.comm_part for e in events if e.waited_on == "p2p")
    # ZeRO-3 gathers and the ZeRO-2/3 reductions a backward waits for: exposed data-parallel time
    waits_param = sum(e.comm_part for e in events if e.waited_on == "param" or e.waited_on == "reduce")
    waits_host = sum(e.comm_part for e in events if e.waited_on == "host")
    if copies_on_compute:  # each copy held the compute stream: all of it exposed
        waits_host += sum(c.end - c.start for c in copies)
    last_compute = max(e.end for e in events)
    dp_tail = max(0.0, timeline.rank_end[rank] - last_compute)  # the optimizer step is neither idle nor comm
    idle = end - busy - optimizer_s
    exposed_dp = waits_param + dp_tail
    exposed = waits_p2p + exposed_dp + waits_host
    return RankResult(rank, busy, idle, waits_p2p, exposed_dp, max(0.0, idle - exposed), device.peak_activation,
                      device.peak_total, device.peak_live, recompute_s, waits_host, host.peak,
                      sum(1 for c in copies if c.op.kind is OpKind.OFFLOAD), host.peak_pinned, host.blocks)
