"""One rank of a simulated timeline as a model, to try host copies and recomputation without re-simulating
(:class:`RankModel`), and the running peak of memory steps (:func:`running_peak`).

Pure: no torch, no processes.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

from ..schedule.levers import DEVICE, KEPT
from ..schedule.ops import Op, OpKind
from .costs import ScheduleCosts
from .simulator import PlacementPlan, SimulationResult, pinned_pool_bytes


class RankModel:
    """One rank of a simulated timeline, to try placements without re-simulating. Host copies: offloads
    launch when their forward ends, reloads when the compute op ``reload_lookahead`` before their
    backward is reached (the end of the op before it); each direction serves its copies one at a time
    in launch order (the engine's FIFO channels), a reload no earlier than its offload's end; a backward
    waits for its reload, and the exposed wait is how much later the reload ends than the backward was
    ready. Copies on the compute stream (CPU ranks, :attr:`.costs.ScheduleCosts.host_copies_on_compute`): each
    copy holds the rank's compute for its length, offload after its forward, reload at its launch, so both are
    exposed whole. Device memory: the simulator's accounting with those copy times, compute times held fixed."""

    def __init__(self, result: SimulationResult, adapter: ScheduleCosts, rank: int, lookahead: int):
        events = result.timeline.compute[rank]
        position = {(e.op.kind, e.op.chunk, e.op.microbatch): i for i, e in enumerate(events)}
        # key -> (forward start, offload launch, reload launch, reload's program slot, backward ready,
        #         backward start, backward end, copy seconds, backward's program position)
        self.keys: Dict[Tuple[int, int], Tuple[float, ...]] = {}
        for i, e in enumerate(events):
            if e.op.kind is not OpKind.FORWARD:
                continue
            b = position[(OpKind.BACKWARD, e.op.chunk, e.op.microbatch)]
            slot = max(b - lookahead, i + 1)
            back = events[b]
            ready = back.start - (back.comm_part if back.waited_on == "host" else 0.0)
            copy = adapter.host_copy(rank, Op(OpKind.OFFLOAD, e.op.chunk, e.op.microbatch))
            self.keys[(e.op.chunk, e.op.microbatch)] = (e.start, e.end, events[slot - 1].end, slot, ready,
                                                        back.start, back.end, copy, b)
        self.by_offload = sorted(self.keys, key=lambda k: (self.keys[k][1], k))  # d2h channel order
        self.by_reload = sorted(self.keys, key=lambda k: (self.keys[k][3], k))  # h2d channel order (program order)
        self.rank, self.adapter = rank, adapter
        self.on_compute = adapter.host_copies_on_compute
        static = adapter.costs.static_bytes
        self.static = static[rank] if rank < len(static) else 0.0
        self.whole = [adapter.bytes_at(rank, chunk, DEVICE) for chunk in range(result.config.vpp)]
        """Per chunk: the bytes of one chunk-micro-batch kept whole (what a host copy moves)."""

    def wait_before_backward(self, key: Tuple[int, int]) -> float:
        """Time between the forward's end and its backward being ready."""
        return self.keys[key][4] - self.keys[key][1]

    def windows(self, placed: set) -> Tuple[Dict[Tuple[int, int], Tuple[float, ...]], float]:
        """(per key: offload start and end, reload start and end; total exposed wait) for the host set ``placed``."""
        if self.on_compute:  # no link to hide behind: every copy is compute time (the shifts they cause are ignored)
            keys = self.keys
            return ({key: (keys[key][1], keys[key][1] + keys[key][7], keys[key][2], keys[key][2] + keys[key][7])
                     for key in placed}, sum(2 * keys[key][7] for key in placed))
        keys = self.keys
        offloads: Dict[Tuple[int, int], Tuple[float, float]] = {}
        free = 0.0
        for key in self.by_offload:
            if key in placed:
                times = keys[key]
                start = max(times[1], free)
                free = start + times[7]
                offloads[key] = (start, free)
        # A backward that waits delays everything after it on the rank: later reload launches and backwards
        # shift by the waits before them (offloads, early in the iteration, are taken as they were).
        free = exposed = 0.0
        delays: List[Tuple[int, float]] = []
        out: Dict[Tuple[int, int], Tuple[float, ...]] = {}
        for key in self.by_reload:
            if key not in placed:
                continue
            _, _, launch, slot, ready, _, _, copy, position = keys[key]
            offload = offloads[key]
            start = max(launch + (sum(d for p, d in delays if p < slot) if delays else 0), free, offload[1])
            free = start + copy
            out[key] = offload + (start, free)
            wait = max(0.0, free - ready - (sum(d for p, d in delays if p < position) if delays else 0))
            if wait > 0:
                delays.append((position, wait))
                exposed += wait
        return out, exposed

    def host_peak(self, windows) -> float:
        """Pinned bytes of the copies in ``windows`` (held from the offload's start to the reload's end) as the
        runtime's pool takes them (:func:`.simulator.pinned_pool_bytes`, which the budget limits)."""
        deltas = []
        whole = self.whole
        for (chunk, _), (off_start, _, _, rel_end) in windows.items():
            deltas += [(off_start, whole[chunk]), (rel_end, -whole[chunk])]
        return pinned_pool_bytes(deltas)

    def device_peak(self, plan: PlacementPlan, windows) -> Tuple[float, float]:
        """(time, bytes) of the device memory peak under ``plan`` with the host copies at ``windows``."""
        deltas = []
        for key, (f_start, _, _, _, _, b_start, b_end, _, _) in self.keys.items():
            kept = KEPT[plan.get((self.rank,) + key, DEVICE)]
            size, extra = self.adapter.bytes_at(self.rank, key[0], kept), self.adapter.transient(self.rank, key[0], kept)
            deltas += [(f_start, size), (b_start, extra), (b_end, -size - extra)]
            if key in windows:
                deltas += [(windows[key][1], -size), (windows[key][2], size)]
        time, peak = running_peak(deltas)
        return time, self.static + peak


def running_peak(deltas: List[Tuple[float, float]]) -> Tuple[float, float]:
    """(time, value) of the running sum's maximum; frees before allocations at equal times."""
    held, peak, when = 0.0, 0.0, 0.0
    for t, size in sorted(deltas):
        held += size
        if held > peak:
            peak, when = held, t
    return when, peak
