"""Execute lowered programs in simulated time: the engine shared by the deadlock dry run and the
planning simulator.

Semantics (the runtime's): each rank runs its program in order on one compute stream. Receive
posts, sends and data-parallel launches never block; a compute op starts when the stream is free,
its input has arrived, and (first forward of a chunk) that chunk's parameter gather has finished.
Each directed pipeline link (src, dst, direction) is a FIFO channel: a transfer starts when it
was sent, its receive was posted and the previous transfer on the link has left it. Each rank has
one data-parallel channel that serves its PARAM_SYNC / GRAD_SYNC collectives in issue order, and
two host-link channels (device-to-host for OFFLOAD, host-to-device for RELOAD: the link is
full-duplex) that serve its copies in issue order; a RELOAD starts no earlier than its OFFLOAD
ended, and a backward whose activations were offloaded starts when its RELOAD has finished.
Mixed sharding: GATHER and REDUCE run on the data-parallel channel like the syncs; a compute op of
a ZeRO-3 chunk starts when the GATHER of its span has finished; RELEASE is instantaneous (recorded
as a zero-length 'release' event, for the memory timeline).
If no rank can make progress before every program ends, the schedule deadlocks.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional, Protocol, Tuple

from .lower import LoweredSchedule, input_source, output_target
from .ops import Op, OpKind, format_ops

TransferKey = Tuple[int, Op]  # (consumer rank, consumer compute op)


class ScheduleError(RuntimeError):
    """A built schedule that cannot run; the message names rank, step and the per-rank order."""


class DeadlockError(ScheduleError):
    pass


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
    """'p2p', 'param', 'host' or '' : what the latest-arriving dependency was."""
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
    """Per rank: when its last compute op or data-parallel collective finished."""

    @property
    def makespan(self) -> float:
        return max(self.rank_end) if self.rank_end else 0.0


class _Engine:
    def __init__(self, schedule: LoweredSchedule, costs: Costs):
        self.s, self.costs, self.cfg = schedule, costs, schedule.config
        p = self.cfg.pp
        self.index = [0] * p
        self.free = [0.0] * p
        self.dp_free = [0.0] * p
        self.channels: Dict[Tuple[int, int, OpKind], Deque[Tuple[TransferKey, float, Op]]] = {}
        self.channel_free: Dict[Tuple[int, int, OpKind], float] = {}
        self.posted: Dict[TransferKey, float] = {}
        self.arrival: Dict[TransferKey, Tuple[float, float]] = {}  # key -> (arrival, send time)
        self.host_free = {"d2h": [0.0] * p, "h2d": [0.0] * p}
        self.offloaded: Dict[Tuple[int, int, int], float] = {}  # (rank, chunk, micro-batch) -> copy end
        self.reloaded: Dict[Tuple[int, int, int], float] = {}
        host_copy = getattr(costs, "host_copy", None)
        self.host_copy = host_copy if callable(host_copy) else (lambda rank, op: 0.0)
        self.param_ready: List[Dict[int, Optional[float]]] = []
        for rank, program in enumerate(schedule.programs):
            self.param_ready.append({op.chunk: None for op in program if op.kind is OpKind.PARAM_SYNC})
        # ZeRO-3 chunk -> end of its open GATHER (None while released)
        self.gathered: List[Dict[int, Optional[float]]] = [{c: None for c in schedule.options.zero3_chunks}
                                                           for _ in range(p)]
        self.timeline = Timeline(schedule, [[] for _ in range(p)], [], [0.0] * p)

    def _consumer_key(self, rank: int, op: Op) -> TransferKey:
        compute = op.compute
        target = output_target(self.cfg, rank, compute)
        assert target is not None
        return target[0], Op(compute.kind, target[1], compute.microbatch)

    def _resolve(self, channel: Tuple[int, int, OpKind]) -> None:
        queue = self.channels.get(channel)
        while queue and queue[0][0] in self.posted:
            key, sent, producer = queue.popleft()
            busy, latency = self.costs.transfer(channel[0], channel[1], producer)
            start = max(sent, self.posted[key], self.channel_free.get(channel, 0.0))
            self.channel_free[channel] = start + busy
            self.arrival[key] = (start + busy + latency, sent)
            self.timeline.comms.append(CommEvent(channel[0], channel[1], producer, start, start + busy + latency, "p2p"))

    def _step(self, rank: int) -> bool:
        """Run rank's next op if it can; False when blocked."""
        op = self.s.programs[rank][self.index[rank]]
        now = self.free[rank]
        if op.kind in (OpKind.RECV_FORWARD, OpKind.RECV_BACKWARD):
            key = (rank, op.compute)
            self.posted[key] = now
            src = input_source(self.cfg, rank, op.compute)
            self._resolve((src[0], rank, op.compute.kind))
        elif op.kind in (OpKind.SEND_FORWARD, OpKind.SEND_BACKWARD):
            key = self._consumer_key(rank, op)
            channel = (rank, key[0], op.compute.kind)
            self.channels.setdefault(channel, deque()).append((key, now, op.compute))
            self._resolve(channel)
        elif op.kind is OpKind.RELEASE:
            self.gathered[rank][op.chunk] = None
            self.timeline.comms.append(CommEvent(rank, rank, op, now, now, "release"))
        elif op.kind.is_dp or op.kind.is_shard:
            start = max(now, self.dp_free[rank])
            end = start + self.costs.data_parallel(rank, op)
            self.dp_free[rank] = end
            self.timeline.comms.append(CommEvent(rank, rank, op, start, end, "dp"))
            if op.kind is OpKind.PARAM_SYNC:
                self.param_ready[rank][op.chunk] = end
            elif op.kind is OpKind.GATHER:
                self.gathered[rank][op.chunk] = end
            self.timeline.rank_end[rank] = max(self.timeline.rank_end[rank], end)
        elif op.kind.is_host:
            key = (rank, op.chunk, op.microbatch)
            offload = op.kind is OpKind.OFFLOAD
            lane = "d2h" if offload else "h2d"
            start = max(now, self.host_free[lane][rank], 0.0 if offload else self.offloaded.get(key, 0.0))
            end = start + self.host_copy(rank, op)
            self.host_free[lane][rank] = end
            (self.offloaded if offload else self.reloaded)[key] = end
            self.timeline.comms.append(CommEvent(rank, rank, op, start, end, lane))
        else:
            data_ready, waited_on, comm_part = 0.0, "", 0.0
            if input_source(self.cfg, rank, op) is not None:
                got = self.arrival.get((rank, op))
                if got is None:
                    return False
                data_ready, waited_on = got[0], "p2p"
                comm_part = max(0.0, got[0] - max(got[1], now))
            # The chunk's parameters: its PARAM_SYNC (first forward) or the GATHER of its span (ZeRO-3).
            waits = self.param_ready[rank] if op.kind is OpKind.FORWARD else {}
            if op.chunk in self.gathered[rank] and not self.s.options.forward_only:
                waits = self.gathered[rank]
            if op.chunk in waits:
                ready = waits[op.chunk]
                if ready is None:
                    return False
                if ready > data_ready:
                    data_ready, waited_on = ready, "param"
                    comm_part = ready - now
            reloaded = self.reloaded.get((rank, op.chunk, op.microbatch)) if op.kind is OpKind.BACKWARD else None
            if reloaded is not None and reloaded > max(data_ready, now):
                data_ready, waited_on = reloaded, "host"
                comm_part = reloaded - now
            start = max(now, data_ready)
            end = start + self.costs.compute(rank, op)
            comm_part = min(max(comm_part, 0.0), start - now)
            self.timeline.compute[rank].append(ComputeEvent(rank, op, start, end, now, data_ready, waited_on, comm_part))
            self.free[rank] = end
            self.timeline.rank_end[rank] = max(self.timeline.rank_end[rank], end)
        self.index[rank] += 1
        return True

    def run(self) -> Timeline:
        programs = self.s.programs
        progress = True
        while progress:
            progress = False
            for rank in range(self.cfg.pp):
                while self.index[rank] < len(programs[rank]) and self._step(rank):
                    progress = True
        stuck = [r for r in range(self.cfg.pp) if self.index[r] < len(programs[r])]
        if stuck:
            raise DeadlockError(self._deadlock_message(stuck))
        return self.timeline

    def _deadlock_message(self, stuck: List[int]) -> str:
        lines = [f"schedule deadlocks ({self.cfg.describe()}): no rank can make progress."]
        for rank in stuck:
            step = self.index[rank]
            op = self.s.programs[rank][step]
            source = input_source(self.cfg, rank, op)
            why = (f"waits for its input from rank {source[0]}" if source and (rank, op) not in self.arrival
                   else f"waits for the parameter gather of chunk {op.chunk}")
            lines.append(f"rank {rank}, step {step}: {op} {why}")
        for rank, program in enumerate(self.s.programs):
            mark = self.index[rank] if rank in stuck else None
            lines.append(f"rank {rank}: {format_ops(program, mark)}")
        return "\n".join(lines)


def execute(schedule: LoweredSchedule, costs: Optional[Costs] = None) -> Timeline:
    """Run ``schedule`` in simulated time; raises :class:`DeadlockError` if it cannot finish."""
    return _Engine(schedule, costs or UnitCosts()).run()
