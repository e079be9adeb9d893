"""The simulated timeline's vocabulary (:mod:`.timeline`): what a cost model gives the engine (:class:`Costs`,
:class:`Links`, :class:`FinalCollective`), what the engine records (:class:`ComputeEvent`, :class:`CommEvent`,
:class:`Timeline`) and how it fails (:class:`DeadlockError`, :class:`DeadlineExceeded`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Protocol, Tuple

from .lower import LoweredSchedule
from .ops import Op, OpKind

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

