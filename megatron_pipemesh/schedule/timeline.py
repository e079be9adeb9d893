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

from typing import Optional, Sequence

from .engine import _INF, Engine
from .events import (CommEvent, ComputeEvent, Costs, DeadlineExceeded, DeadlockError, FinalCollective, Links,
                     ScheduleError, Timeline, TransferKey, UnitCosts)
from .lower import LoweredSchedule

__all__ = ["CommEvent", "ComputeEvent", "Costs", "DeadlineExceeded", "DeadlockError", "FinalCollective", "Links",
           "ScheduleError", "Timeline", "TransferKey", "UnitCosts", "execute"]


def execute(schedule: LoweredSchedule, costs: Optional[Costs] = None, deadline: Optional[float] = None,
            tails: Optional[Sequence[float]] = None) -> Timeline:
    """Run ``schedule`` in simulated time; raises :class:`DeadlockError` if it cannot finish, and
    :class:`DeadlineExceeded` as soon as the iteration is known to end after ``deadline`` (a search that only wants
    schedules ending by then stops there instead of running the rest of a schedule it will discard). ``tails``: per
    rank, what the iteration adds after the rank's end (the simulator's optimizer step), counted against the
    deadline."""
    return Engine(schedule, costs or UnitCosts(), _INF if deadline is None else deadline,
                  None if tails is None else list(tails)).run()
