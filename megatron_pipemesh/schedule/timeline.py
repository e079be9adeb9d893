"""Execute lowered programs in simulated time: the engine shared by the deadlock dry run and the
planning simulator.

Semantics (the runtime's): each rank runs its program in order on one compute stream. Receive
posts, sends and data-parallel launches never block; a compute op starts when the stream is free,
its input has arrived, and (first forward of a chunk) that chunk's parameter gather has finished.
With the lowering's ``send_wait`` (Megatron's schedules) it also waits for the sends issued since the rank's
previous compute op: until each one's receive is posted ("posted") or its transfer has ended ("delivered");
with ``megatron_p2p``, in the warm-up (after one of the forwards before the last forward that precedes the first
backward) also for the receives posted since then. With ``notices_behind_data`` a receive counts as posted for its
sender only once the transfers its rank has in flight back to that sender have ended.
Each directed pipeline link (src, dst, direction) is a FIFO channel: a transfer starts when it
was sent, its receive was posted and the previous transfer on the link has left it. Each rank has
one data-parallel channel that serves its PARAM_SYNC / GRAD_SYNC collectives in issue order, and
two host-link channels (device-to-host for OFFLOAD, host-to-device for RELOAD: the link is
full-duplex) that serve its copies in issue order; a RELOAD starts no earlier than its OFFLOAD
ended, and a backward whose activations were offloaded starts when its RELOAD has finished. With
``costs.host_copies_on_compute`` (CPU ranks copy on their own thread) an OFFLOAD or RELOAD runs on the
compute stream instead, in program order, and holds it for its duration.
Mixed sharding: GATHER and REDUCE run on the data-parallel channel like the syncs; a compute op of
a ZeRO-3 chunk starts when the GATHER of its span has finished, a backward of a ZeRO-2/3 chunk when the
chunk's last REDUCE issued before it has (the runtime waits for it before the next group accumulates
into the chunk's one gradient buffer); RELEASE is instantaneous (a zero-length 'release' event).
If no rank can make progress before every program ends, the schedule deadlocks.

How long a transfer takes: without shared links each takes its own duration (``Costs.transfer``,
``data_parallel``, ``host_copy``). With them (``costs.links()``, a :class:`Links`, e.g. the planner's
:class:`~megatron_pipemesh.planning.topology.Topology`) every transfer runs on its route through
resources (a rank's NIC egress and ingress, its host link, ...) that the transfers running at the same time
share max-min fairly (:class:`~megatron_pipemesh.planning.network.FairShareNetwork`): its duration is the
time it would take alone, stretched while it shares.

How long a compute op takes: its own duration (``Costs.compute``), unless the links give the rank a compute
route (``Links.compute_route``: ranks sharing the CPU cores of one host, e.g. the bench's emulated cluster with
more ranks than cores). Then the op is a flow on that route, sharing the cores max-min fairly with the other ranks
computing at the same time: it starts when it would start anyway (stream free, input arrived), its work is its
duration at one full core, and the rank resumes when the flow ends, so a rank waiting in a bubble lends its core to
the others. Host copies on the compute stream (``host_copies_on_compute``: a memcpy on the rank's thread) share
the cores the same way.

``costs.final_collectives()`` adds what runs after the programs (:class:`FinalCollective`: the tied embedding's
all-reduce); a rank ends with its last compute op, data-parallel collective or final collective.

Speed (the planner and ``pipemesh study`` simulate thousands of schedules): each lowered schedule is
compiled once into per-rank instruction tuples with interned transfer keys and channels, memoized per
(config, lowering options) while its programs hold the same op objects, and run in time order (a heap of
compute ends, fixed-length transfers and the network's own ends) by one function with local state; without
compute routes a compute op is one heap entry (its end), never a flow. Without shared links the results are those
of the plain reading of the rules above (``tests/schedule/test_timeline.py``).
"""
from __future__ import annotations

import heapq
import operator
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional, Protocol, Tuple

from .config import ScheduleConfig
from .lower import SEND_WAITS, LoweredSchedule, LoweringOptions, input_source, output_target
from .ops import Op, OpKind, format_ops

TransferKey = Tuple[int, Op]  # (consumer rank, consumer compute op)


class ScheduleError(RuntimeError):
    """A built schedule that cannot run; the message names rank, step and the per-rank order."""


class DeadlockError(ScheduleError):
    pass


class DeadlineExceeded(Exception):
    """The iteration is known to end after the deadline given to :func:`execute`: the simulated clock passed it (no
    event of an iteration comes after the last end of a rank's compute, collective or final collective), or a rank's
    compute left, run back to back from the start of its current op, ends after it. ``clock``: that time."""

    def __init__(self, deadline: float, clock: float):
        super().__init__(f"the iteration ends at {clock!r} s or later, past the deadline of {deadline!r} s")
        self.deadline, self.clock = deadline, clock


class Costs(Protocol):
    """Durations in seconds (any consistent unit works)."""

    def compute(self, rank: int, op: Op) -> float: ...

    def transfer(self, src: int, dst: int, op: Op) -> Tuple[float, float]:
        """(link busy time, extra latency) of sending the output of compute ``op`` of rank src."""
        ...

    def data_parallel(self, rank: int, op: Op) -> float: ...

    def host_copy(self, rank: int, op: Op) -> float:
        """Seconds the host link of ``rank`` is busy with the OFFLOAD / RELOAD ``op`` (optional:
        cost models without it copy for free)."""
        ...

    # Optional: ``links() -> Links`` (shared links: transfers share their resources; without it each
    # transfer takes its own duration), ``final_collectives() -> Sequence[FinalCollective]`` and
    # ``host_copies_on_compute`` (True: host copies hold up the compute stream instead of a host link).


class UnitCosts:
    """F = 1, B = 2, free communication: the dry-run and textbook setting."""

    def __init__(self, forward: float = 1.0, backward: float = 2.0, transfer: float = 0.0, dp: float = 0.0):
        self.forward, self.backward, self._transfer, self.dp = forward, backward, transfer, dp

    def compute(self, rank: int, op: Op) -> float:
        return self.forward if op.kind is OpKind.FORWARD else self.backward

    def transfer(self, src: int, dst: int, op: Op) -> Tuple[float, float]:
        return self._transfer, 0.0

    def data_parallel(self, rank: int, op: Op) -> float:
        return self.dp

    def host_copy(self, rank: int, op: Op) -> float:
        return 0.0


@dataclass
class ComputeEvent:
    rank: int
    op: Op
    start: float
    end: float
    ready: float
    """When the stream was free; start - ready is the wait."""
    data_ready: float
    """When the input (or parameters) arrived; 0 when nothing was awaited."""
    waited_on: str
    """'p2p', 'param', 'host', 'reduce' (its ZeRO-2/3 chunk's previous REDUCE) or '': what the latest-arriving
    dependency was."""
    comm_part: float = 0.0
    """Part of the wait caused by the transfer itself (the rest is pipeline bubble)."""


@dataclass
class CommEvent:
    src: int
    dst: int
    op: Op
    """Producer op (for transfers) or the data-parallel op."""
    start: float
    end: float
    lane: str
    """'p2p', 'dp' (also GATHER / REDUCE), 'd2h' (OFFLOAD), 'h2d' (RELOAD) or 'release' (RELEASE, zero length)."""


@dataclass
class Timeline:
    schedule: LoweredSchedule
    compute: List[List[ComputeEvent]] = field(default_factory=list)
    comms: List[CommEvent] = field(default_factory=list)
    rank_end: List[float] = field(default_factory=list)
    """Per rank: when its last compute op, data-parallel collective or final collective finished."""

    @property
    def makespan(self) -> float:
        return max(self.rank_end) if self.rank_end else 0.0


# Instruction codes of the compiled programs (small ints: the inner loop dispatches on them).
_COMPUTE_OP, _RECV_OP, _SEND_OP, _DP_OP, _HOST_OP, _RELEASE_OP = range(6)


@dataclass
class _Compiled:
    """A lowered schedule in the engine's form: per rank, one tuple per op whose transfer keys and
    channels are small ints (interned once per schedule, not hashed as ``(rank, Op)`` per step)."""

    config: ScheduleConfig
    ops: Tuple[Tuple[Op, ...], ...]
    """The programs compiled (identity-checked on reuse: a caller may edit a schedule's programs)."""
    code: List[List[tuple]]
    keys: int
    """Number of transfer keys (consumer rank, direction, chunk, micro-batch)."""
    channels: List[Tuple[int, int, str]]
    """Channel id -> (src, dst, direction 'F' / 'B')."""


_COMPILED: "OrderedDict[Tuple[ScheduleConfig, LoweringOptions], _Compiled]" = OrderedDict()
_COMPILED_MAX = 256
_COMPILED_LOCK = threading.Lock()
"""Least-recently-used compiled schedules (the same bound as the lowering's memo)."""


def _compile(schedule: LoweredSchedule) -> _Compiled:
    """Each op of each rank program as a tuple the engine reads without recomputing placement:

    * compute: (code, op, input key id or -1, waits for a parameter gather, is forward, host key,
      waits for its ZeRO-3 span's GATHER, waits for its ZeRO-2/3 chunk's last REDUCE);
    * receive: (code, key id, channel id, held: the next compute op waits for it); send: (code, key id, channel
      id, producer compute op);
    * data-parallel and GATHER / REDUCE: (code, op, is PARAM_SYNC, is GATHER, is REDUCE); RELEASE: (code, op);
    * host copy: (code, op, is OFFLOAD, host key).

    Memoized per (config, options) while the programs hold the very same op objects (every
    :func:`~.lower.lower` of one (config, options) shares them)."""
    memo_key = (schedule.config, schedule.options)
    with _COMPILED_LOCK:  # rank threads (the GPU check) validate plans concurrently
        cached = _COMPILED.get(memo_key)
        if cached is not None:
            _COMPILED.move_to_end(memo_key)
    if cached is not None and len(cached.ops) == len(schedule.programs) and all(
            len(old) == len(new) and all(map(operator.is_, old, new)) for old, new in zip(cached.ops, schedule.programs)):
        return cached
    cfg = schedule.config
    key_ids: Dict[tuple, int] = {}
    channel_ids: Dict[Tuple[int, int, str], int] = {}
    code: List[List[tuple]] = []
    for rank, program in enumerate(schedule.programs):
        # (direction, chunk) -> (input source, output target), from the lowering's own placement rules.
        peers: Dict[Tuple[str, int], Tuple[Optional[Tuple[int, int]], Optional[Tuple[int, int]]]] = {}
        for op in program:
            if (op.kind._value_[-1], op.chunk) not in peers:
                for direction, kind in (("F", OpKind.FORWARD), ("B", OpKind.BACKWARD)):
                    probe = Op(kind, op.chunk, 0)
                    peers[direction, op.chunk] = (input_source(cfg, rank, probe), output_target(cfg, rank, probe))
        param_chunks = {op.chunk for op in program if op.kind is OpKind.PARAM_SYNC}
        zero3 = set() if schedule.options.forward_only else set(schedule.options.zero3_chunks)
        zero2 = set() if schedule.options.forward_only else set(schedule.options.zero2_chunks)
        producers: Dict[Tuple[str, int, Optional[int]], Op] = {}
        warmup = _warmup_forwards(program) if schedule.options.megatron_p2p else 0
        computed = 0
        out = []
        append = out.append
        for op in program:
            kind, chunk, microbatch = op.kind._value_, op.chunk, op.microbatch
            if kind == "F" or kind == "B":
                key = -1
                if peers[kind, chunk][0] is not None:
                    name = (rank, kind, chunk, microbatch) if op.peer is None else (rank, kind, chunk, microbatch, op.peer)
                    key = key_ids.setdefault(name, len(key_ids))
                forward = kind == "F"
                # A ZeRO-3 chunk waits for the GATHER of its span instead of a PARAM_SYNC; a backward of a
                # ZeRO-2/3 chunk for the reduction of the chunk's previous backward group (its REDUCE).
                append((_COMPUTE_OP, op, key, forward and chunk in param_chunks and chunk not in zero3, forward,
                        (rank, chunk, microbatch), chunk in zero3, not forward and chunk in zero2))
                computed += 1
                if op.peer is None:
                    producers[kind, chunk, microbatch] = op
            elif kind == "RECV_F" or kind == "RECV_B":
                direction = kind[-1]
                source = peers[direction, chunk][0]
                key = key_ids.setdefault((rank, direction, chunk, microbatch), len(key_ids))
                append((_RECV_OP, key, channel_ids.setdefault((source[0], rank, direction), len(channel_ids)),
                        1 <= computed <= warmup))
            elif kind == "SEND_F" or kind == "SEND_B":
                direction = kind[-1]
                target = peers[direction, chunk][1]
                assert target is not None
                key = key_ids.setdefault((target[0], direction, target[1], microbatch), len(key_ids))
                channel = channel_ids.setdefault((rank, target[0], direction), len(channel_ids))
                append((_SEND_OP, key, channel, producers.get((direction, chunk, microbatch)) or op.compute))
            elif op.kind is OpKind.RELEASE:
                append((_RELEASE_OP, op))
            elif op.kind.is_dp or op.kind.is_shard:
                append((_DP_OP, op, op.kind is OpKind.PARAM_SYNC, op.kind is OpKind.GATHER, op.kind is OpKind.REDUCE))
            else:
                append((_HOST_OP, op, op.kind is OpKind.OFFLOAD, (rank, chunk, microbatch)))
        code.append(out)
    compiled = _Compiled(cfg, tuple(tuple(program) for program in schedule.programs), code, len(key_ids),
                         [channel for channel, _ in sorted(channel_ids.items(), key=lambda item: item[1])])
    with _COMPILED_LOCK:
        _COMPILED[memo_key] = compiled
        _COMPILED.move_to_end(memo_key)
        while len(_COMPILED) > _COMPILED_MAX:
            _COMPILED.popitem(last=False)
    return compiled


def _warmup_forwards(program) -> int:
    """Megatron's warm-up forwards of a rank: the forwards before its first backward but the last of them (the
    first of the steady 1F1B phase); all of them without a backward (evaluation)."""
    leading = 0
    for op in program:
        if op.kind is OpKind.BACKWARD:
            return max(0, leading - 1)
        if op.kind is OpKind.FORWARD:
            leading += 1
    return leading


class Links(Protocol):
    """Shared network links (e.g. :class:`~megatron_pipemesh.planning.topology.Topology`): where each
    transfer runs and a fresh network that shares its resources among the transfers running at once."""

    def p2p_route(self, src: int, dst: int) -> object: ...

    def dp_route(self, rank: int) -> object: ...

    def host_route(self, rank: int, offload: bool) -> object: ...

    def embedding_route(self, src: int, dst: int) -> object: ...

    def new_network(self) -> object:
        """An object with ``start(token, route, seconds)``, ``advance(t)``, ``next_time()`` and ``pop()``
        (:class:`~megatron_pipemesh.planning.network.FairShareNetwork`)."""
        ...

    # Optional: ``compute_route(rank)``, the route of the rank's compute on CPU cores it shares with other ranks
    # (None: a device of its own), whose ``lone_bytes_per_s`` is the cores it gets alone (a compute op's work on
    # the network is its one-core seconds over that).


@dataclass(frozen=True)
class FinalCollective:
    """A collective after the programs: Megatron's ``finalize_model_grads`` all-reduces the tied word
    embedding's gradient between the first and the last pipeline stage once their own gradients are reduced."""

    ranks: Tuple[int, ...]
    """Pipeline ranks taking part: it starts once each has run its program and its data-parallel collectives."""
    transfers: Tuple[Tuple[int, int, float, int], ...]
    """(src, dst, seconds alone, chunk of the src's copy) of each transfer; all run at once, and the collective
    ends when the last has arrived."""
    latency_s: float = 0.0
    """Added once after the transfers."""


# heap event kinds: a rank's compute op ended; a transfer without shared links ended; a rank's compute on shared
# cores starts (its input arrives then)
_RESUME, _END, _CORE = 0, 1, 2
_INF = float("inf")


class _Engine:
    def __init__(self, schedule: LoweredSchedule, costs: Costs, deadline: float = _INF):
        self.s, self.costs, self.cfg = schedule, costs, schedule.config
        self.deadline = deadline
        p = self.cfg.pp
        self.compiled = _compile(schedule)
        self.index = [0] * p
        self.arrival: List[Optional[Tuple[float, float]]] = [None] * self.compiled.keys  # (arrival, send time)
        host_copy = getattr(costs, "host_copy", None)
        self.host_copy = host_copy if callable(host_copy) else (lambda rank, op: 0.0)
        self.copies_on_compute = bool(getattr(costs, "host_copies_on_compute", False))
        links = getattr(costs, "links", None)
        self.links: Optional[Links] = links() if callable(links) else None
        compute_route = getattr(self.links, "compute_route", None)
        cores = [compute_route(rank) for rank in range(p)] if callable(compute_route) else []
        self.cores: Optional[List[object]] = cores if any(route is not None for route in cores) else None
        """Per rank: the route of its compute on shared cores (or None); None when no rank shares cores."""
        finals = getattr(costs, "final_collectives", None)
        self.finals: Tuple[FinalCollective, ...] = tuple(finals()) if callable(finals) and not schedule.options.forward_only else ()
        self.timeline = Timeline(schedule, [[] for _ in range(p)], [], [0.0] * p)

    def run(self) -> Timeline:
        """The semantics of the module docstring, in time order.

        Each rank runs its instructions at its stream's free time until a compute op, which either starts
        (the rank resumes at its end) or waits for a transfer, gather, reduction or reload (the rank resumes when it
        ends). Transfers run on FIFO channels; on shared links (``costs.links()``) their pace follows the
        network, otherwise each takes its own duration. Written as one function with local state (it is the
        simulator's inner loop)."""
        compiled, costs, timeline, cfg = self.compiled, self.costs, self.timeline, self.cfg
        p = cfg.pp
        compute_cost, transfer_cost, dp_cost, host_cost = costs.compute, costs.transfer, costs.data_parallel, self.host_copy
        code, channels = compiled.code, compiled.channels
        index, arrival = self.index, self.arrival
        rank_end, comms, compute_events = timeline.rank_end, timeline.comms, timeline.compute
        free = [0.0] * p
        blocked = [False] * p
        posted: List[Optional[float]] = [None] * compiled.keys
        queues: List[Deque[Tuple[int, float, Op]]] = [deque() for _ in channels]
        in_flight: List[Optional[tuple]] = [None] * len(channels)
        dp_queue: List[Deque[tuple]] = [deque() for _ in range(p)]
        dp_flight: List[Optional[tuple]] = [None] * p
        host_queue = {"d2h": [deque() for _ in range(p)], "h2d": [deque() for _ in range(p)]}
        host_flight: Dict[str, List[Optional[tuple]]] = {"d2h": [None] * p, "h2d": [None] * p}
        param_ready: List[Dict[int, Optional[float]]] = [
            {op.chunk: None for op, is_param in ((ins[1], ins[2]) for ins in program if ins[0] == _DP_OP) if is_param}
            for program in code]
        # ZeRO-3 chunk -> end of its open GATHER (None while released or gathering)
        gathered: List[Dict[int, Optional[float]]] = [{c: None for c in self.s.options.zero3_chunks} for _ in range(p)]
        # ZeRO-2/3 chunk -> end of its last REDUCE (None while it runs; absent before the first)
        reduced: List[Dict[int, Optional[float]]] = [{} for _ in range(p)]
        offloaded: Dict[Tuple[int, int, int], Optional[float]] = {}  # None: the copy is running
        reloaded: Dict[Tuple[int, int, int], Optional[float]] = {}
        links = self.links
        copies_on_compute = self.copies_on_compute
        send_wait = self.s.options.send_wait
        sends_hold = send_wait in SEND_WAITS[1:]  # "posted" / "delivered": Megatron's schedules
        holds: List[List[Tuple[int, bool]]] = [[] for _ in range(p)]  # per rank: (key, is a receive) its next compute waits for
        send_waiters: Dict[int, int] = {}  # send key -> the rank blocked on it
        behind_data = self.s.options.notices_behind_data
        # channel -> the channels from its receiver back to its sender (a ready notice queues behind their transfer)
        reverse = [[c for c, (s2, d2, _) in enumerate(channels) if s2 == dst and d2 == src] for src, dst, _ in channels]
        notices: List[List[Tuple[int, int]]] = [[] for _ in channels]  # channel -> (key, its channel) notices behind it
        notice_left: Dict[int, int] = {}  # key -> transfers its notice still waits behind
        self.holds = holds
        net = links.new_network() if links is not None else None
        p2p_routes = [links.p2p_route(src, dst) if links is not None else None for src, dst, _ in channels]
        dp_routes = [links.dp_route(r) if links is not None else None for r in range(p)]
        host_routes = {lane: [links.host_route(r, lane == "d2h") if links is not None else None for r in range(p)]
                       for lane in ("d2h", "h2d")}
        finals, final_left, final_started = self.finals, [len(f.transfers) for f in self.finals], [False] * len(self.finals)
        cores = self.cores
        # Per rank on shared cores: (one-core seconds, the ComputeEvent or the host copy's (op, offload, host key,
        # start)) of the op its core runs or is about to run.
        core_job: List[Optional[tuple]] = [None] * p
        heap: List[tuple] = []
        seq = [0]
        clock = [0.0]
        deadline = self.deadline
        # With a deadline, per rank and instruction: the compute seconds of its compute ops from there on (one core
        # each); a rank's ops run one after another, so its end is at least an op's start plus that.
        left: Optional[List[List[float]]] = None
        cut = deadline + 1e-9 * abs(deadline)  # sums in another order may round past a schedule ending exactly then
        if deadline < _INF:
            left = []
            for rank, program in enumerate(code):
                suffix, total = [0.0] * (len(program) + 1), 0.0
                for i in range(len(program) - 1, -1, -1):
                    if program[i][0] == _COMPUTE_OP:
                        total += compute_cost(rank, program[i][1])
                    suffix[i] = total
                left.append(suffix)

        def launch(token: tuple, seconds: float, route) -> None:
            """Start a transfer now: on the shared network when it has a route, else for its own duration."""
            if net is not None and route is not None and seconds > 0.0:
                net.start(token, route, seconds)
            else:
                seq[0] += 1
                heapq.heappush(heap, (clock[0] + seconds, seq[0], _END, token))

        def start_channel(channel: int) -> None:
            queue = queues[channel]
            if in_flight[channel] is not None or not queue or posted[queue[0][0]] is None:
                return
            key, sent, producer = queue.popleft()
            src, dst, _ = channels[channel]
            busy, latency = transfer_cost(src, dst, producer)
            in_flight[channel] = (key, sent, producer, clock[0], latency)
            launch(("p2p", channel), busy, p2p_routes[channel])

        def start_dp(rank: int) -> None:
            if dp_flight[rank] is not None or not dp_queue[rank]:
                return
            op, is_param, is_gather, is_reduce = dp_queue[rank].popleft()
            dp_flight[rank] = (op, is_param, is_gather, is_reduce, clock[0])
            launch(("dp", rank), dp_cost(rank, op), dp_routes[rank])

        def start_host(lane: str, rank: int) -> None:
            queue = host_queue[lane][rank]
            if host_flight[lane][rank] is not None or not queue:
                return
            op, offload, host_key = queue[0]
            if not offload and offloaded.get(host_key, 0.0) is None:
                return  # a reload starts once its offload has ended
            queue.popleft()
            host_flight[lane][rank] = (op, offload, host_key, clock[0])
            launch((lane, rank), host_cost(rank, op), host_routes[lane][rank])

        def run_on_core(rank: int) -> None:
            """Start the rank's core job now: a flow of its one-core seconds on its share of the cores."""
            route = cores[rank]
            launch(("core", rank), core_job[rank][0] / route.lone_bytes_per_s, route)

        def wake(rank: int) -> None:
            if blocked[rank]:
                blocked[rank] = False
                step(rank)

        def wake_sender(key: int) -> None:
            """The send ``key`` a blocked rank waits for is done: it resumes at the current time (an event, not a
            nested step: this runs inside the receiver's step)."""
            rank = send_waiters.pop(key, None)
            if rank is not None and blocked[rank]:
                blocked[rank] = False
                seq[0] += 1
                heapq.heappush(heap, (clock[0], seq[0], _RESUME, rank))

        def try_finals() -> None:
            for k, final in enumerate(finals):
                if final_started[k] or not all(index[r] == len(code[r]) and dp_flight[r] is None and not dp_queue[r]
                                               for r in final.ranks):
                    continue
                final_started[k] = True
                for j, (src, dst, seconds, _) in enumerate(final.transfers):
                    launch(("final", k, j, clock[0]), seconds, links.embedding_route(src, dst) if links is not None else None)

        def ended(token: tuple) -> None:
            """A transfer ended now: record it, release what waited on it, start the next on its channel."""
            now = clock[0]
            kind = token[0]
            if kind == "p2p":
                channel = token[1]
                key, sent, producer, start, latency = in_flight[channel]
                in_flight[channel] = None
                src, dst, _ = channels[channel]
                if notices[channel]:
                    deliver_notices(channel)
                arrival[key] = (now + latency, sent)
                comms.append(CommEvent(src, dst, producer, start, now + latency, "p2p"))
                if send_waiters:
                    wake_sender(key)  # a sender waiting for delivery, or a receiver for its warm-up receive
                wake(dst)
                start_channel(channel)
            elif kind == "dp":
                rank = token[1]
                op, is_param, is_gather, is_reduce, start = dp_flight[rank]
                dp_flight[rank] = None
                comms.append(CommEvent(rank, rank, op, start, now, "dp"))
                if is_param:
                    param_ready[rank][op.chunk] = now
                elif is_gather:
                    gathered[rank][op.chunk] = now
                elif is_reduce:
                    reduced[rank][op.chunk] = now
                if now > rank_end[rank]:
                    rank_end[rank] = now
                wake(rank)
                start_dp(rank)
                if finals:
                    try_finals()
            elif kind == "final":
                k, j, start = token[1], token[2], token[3]
                final = finals[k]
                src, dst, _, chunk = final.transfers[j]
                comms.append(CommEvent(src, dst, Op(OpKind.GRAD_SYNC, chunk), start, now + final.latency_s, "embedding"))
                final_left[k] -= 1
                if final_left[k] == 0:
                    for r in final.ranks:
                        rank_end[r] = max(rank_end[r], now + final.latency_s)
            elif kind == "core":  # the rank's compute op or host copy on shared cores ended; the rank steps on
                rank = token[1]
                job = core_job[rank][1]
                core_job[rank] = None
                if job.__class__ is ComputeEvent:
                    job.end = now
                else:
                    op, offload, host_key, start = job
                    (offloaded if offload else reloaded)[host_key] = now
                    comms.append(CommEvent(rank, rank, op, start, now, "d2h" if offload else "h2d"))
                if now > rank_end[rank]:
                    rank_end[rank] = now
                free[rank] = now
                step(rank)
            else:
                lane, rank = kind, token[1]
                op, offload, host_key, start = host_flight[lane][rank]
                host_flight[lane][rank] = None
                (offloaded if offload else reloaded)[host_key] = now
                comms.append(CommEvent(rank, rank, op, start, now, lane))
                if offload:
                    start_host("h2d", rank)
                else:
                    wake(rank)
                start_host(lane, rank)

        def post(key: int, channel: int, at: float) -> None:
            """The receive ``key`` is posted as its sender sees it, at ``at``: its transfer may start."""
            posted[key] = at
            if send_waiters and send_wait == "posted":
                wake_sender(key)
            start_channel(channel)

        def deliver_notices(channel: int) -> None:
            """The transfer on ``channel`` left: the ready notices queued behind it reach their senders."""
            waiting, notices[channel] = notices[channel], []
            for key, its_channel in waiting:
                notice_left[key] -= 1
                if notice_left[key] == 0:
                    del notice_left[key]
                    post(key, its_channel, clock[0])

        def hold(rank: int, resume_at: int, end: float) -> None:
            """The rank's stream is busy until ``end``; it resumes there at instruction ``resume_at``."""
            if end > rank_end[rank]:
                rank_end[rank] = end
            index[rank], free[rank] = resume_at, end
            seq[0] += 1
            heapq.heappush(heap, (end, seq[0], _RESUME, rank))

        def step(rank: int) -> None:
            """Run ``rank``'s instructions from its stream's free time until a compute op starts or waits."""
            program = code[rank]
            i, n, now = index[rank], len(program), free[rank]
            events = compute_events[rank]
            while i < n:
                ins = program[i]
                what = ins[0]
                if what == _COMPUTE_OP:
                    _, op, key, waits_param, forward, host_key, waits_gather, waits_reduce = ins
                    data_ready, waited_on, comm_part = 0.0, "", 0.0
                    if key >= 0:
                        got = arrival[key]
                        if got is None:
                            blocked[rank] = True
                            break
                        data_ready, waited_on = got[0], "p2p"
                        sent = got[1]
                        comm_part = got[0] - (now if now > sent else sent)
                        if not comm_part > 0.0:
                            comm_part = 0.0
                    if waits_param or waits_gather:
                        ready = (gathered if waits_gather else param_ready)[rank][op.chunk]
                        if ready is None:
                            blocked[rank] = True
                            break
                        if ready > data_ready:
                            data_ready, waited_on = ready, "param"
                            comm_part = ready - now
                    back = None
                    if not forward and host_key in reloaded:
                        back = reloaded[host_key]
                        if back is None:
                            blocked[rank] = True
                            break
                    if back is not None and back > max(data_ready, now):
                        data_ready, waited_on = back, "host"
                        comm_part = back - now
                    if holds[rank]:  # Megatron waits on the sends it issued since its previous compute op
                        done = None
                        for sent_key, received in holds[rank]:
                            if send_wait == "posted" and not received:
                                done = posted[sent_key]
                            else:
                                got = arrival[sent_key]
                                done = None if got is None else got[0]
                            if done is None:
                                send_waiters[sent_key] = rank
                                break
                            if done > max(data_ready, now):
                                data_ready, waited_on = done, "p2p"
                                comm_part = done - now
                        if done is None:
                            blocked[rank] = True
                            break
                        holds[rank].clear()
                    if waits_reduce:
                        reduce_end = reduced[rank].get(op.chunk, 0.0)
                        if reduce_end is None:
                            blocked[rank] = True
                            break
                        if reduce_end > max(data_ready, now):
                            data_ready, waited_on = reduce_end, "reduce"
                            comm_part = reduce_end - now
                    start = data_ready if data_ready > now else now
                    if left is not None and start + left[rank][i] > cut:
                        raise DeadlineExceeded(deadline, start + left[rank][i])
                    if 0.0 > comm_part:
                        comm_part = 0.0
                    if start - now < comm_part:
                        comm_part = start - now
                    if cores is not None and cores[rank] is not None:
                        # On shared cores: a flow from its start; the event's end is set when the flow ends.
                        event = ComputeEvent(rank, op, start, start, now, data_ready, waited_on, comm_part)
                        events.append(event)
                        core_job[rank] = (compute_cost(rank, op), event)
                        index[rank] = i + 1
                        if start > now:
                            seq[0] += 1
                            heapq.heappush(heap, (start, seq[0], _CORE, rank))
                        else:
                            run_on_core(rank)
                        return
                    end = start + compute_cost(rank, op)
                    events.append(ComputeEvent(rank, op, start, end, now, data_ready, waited_on, comm_part))
                    hold(rank, i + 1, end)
                    return
                if what == _RECV_OP:
                    if ins[3]:
                        holds[rank].append((ins[1], True))
                    ahead = [c for c in reverse[ins[2]] if in_flight[c] is not None] if behind_data else ()
                    if ahead:  # the ready notice leaves behind this rank's transfers to the sender
                        notice_left[ins[1]] = len(ahead)
                        for c in ahead:
                            notices[c].append((ins[1], ins[2]))
                    else:
                        post(ins[1], ins[2], now)
                elif what == _SEND_OP:
                    queues[ins[2]].append((ins[1], now, ins[3]))
                    if sends_hold:
                        holds[rank].append((ins[1], False))
                    start_channel(ins[2])
                elif what == _DP_OP:
                    if ins[4]:
                        reduced[rank][ins[1].chunk] = None
                    dp_queue[rank].append((ins[1], ins[2], ins[3], ins[4]))
                    start_dp(rank)
                elif what == _RELEASE_OP:
                    op = ins[1]
                    gathered[rank][op.chunk] = None
                    comms.append(CommEvent(rank, rank, op, now, now, "release"))
                else:
                    _, op, offload, host_key = ins
                    lane = "d2h" if offload else "h2d"
                    if copies_on_compute:  # the copy holds the stream; the rank resumes at its end
                        if cores is not None and cores[rank] is not None:  # a memcpy on the rank's thread: a core
                            core_job[rank] = (host_cost(rank, op), (op, offload, host_key, now))
                            index[rank] = i + 1
                            run_on_core(rank)
                            return
                        end = now + host_cost(rank, op)
                        (offloaded if offload else reloaded)[host_key] = end
                        comms.append(CommEvent(rank, rank, op, now, end, lane))
                        hold(rank, i + 1, end)
                        return
                    (offloaded if offload else reloaded)[host_key] = None
                    host_queue[lane][rank].append((op, offload, host_key))
                    start_host(lane, rank)
                i += 1
            index[rank], free[rank] = i, now
            if i == n and finals:
                try_finals()

        for rank in range(p):
            step(rank)
        while True:
            t_net = net.next_time() if net is not None else _INF
            t_heap = heap[0][0] if heap else _INF
            if t_net <= t_heap:
                if t_net == _INF:
                    break
                if t_net > deadline:
                    raise DeadlineExceeded(deadline, t_net)
                clock[0], done = net.pop()
                for token in done:
                    ended(token)
                continue
            when, _, kind, payload = heapq.heappop(heap)
            if when > deadline:
                raise DeadlineExceeded(deadline, when)
            clock[0] = when
            if net is not None:
                net.now = when  # no flow ends before it (t_net > when): advance()'s check, without its second look
            if kind == _RESUME:
                step(payload)
            elif kind == _END:
                ended(payload)
            else:
                run_on_core(payload)
        stuck = [r for r in range(p) if index[r] < len(code[r])]
        if stuck:
            self.param_ready = param_ready
            raise DeadlockError(self._deadlock_message(stuck))
        return timeline

    def _deadlock_message(self, stuck: List[int]) -> str:
        lines = [f"schedule deadlocks ({self.cfg.describe()}): no rank can make progress."]
        for rank in stuck:
            step = self.index[rank]
            op = self.s.programs[rank][step]
            source = input_source(self.cfg, rank, op)
            key = self.compiled.code[rank][step][2]
            if source and self.arrival[key] is None:
                why = f"waits for its input from rank {source[0]}"
            elif self.holds[rank]:
                why = f"waits for its sends to be received (send_wait {self.s.options.send_wait}) before it starts"
            else:
                why = f"waits for the parameter gather of chunk {op.chunk}"
            lines.append(f"rank {rank}, step {step}: {op} {why}")
        for rank, program in enumerate(self.s.programs):
            mark = self.index[rank] if rank in stuck else None
            lines.append(f"rank {rank}: {format_ops(program, mark)}")
        return "\n".join(lines)


def execute(schedule: LoweredSchedule, costs: Optional[Costs] = None, deadline: Optional[float] = None) -> Timeline:
    """Run ``schedule`` in simulated time; raises :class:`DeadlockError` if it cannot finish, and
    :class:`DeadlineExceeded` as soon as its clock passes ``deadline`` (a search that only wants schedules ending
    by then stops there instead of running the rest of a schedule it will discard)."""
    return _Engine(schedule, costs or UnitCosts(), _INF if deadline is None else deadline).run()
