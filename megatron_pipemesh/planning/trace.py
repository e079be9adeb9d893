"""Chrome / Perfetto trace of a simulated (or measured) timeline: one process per rank with a
compute track, a pipeline-send track per link, a data-parallel track, device-to-host and host-to-device
tracks (activation offloads and reloads), and device and host memory counters."""
from __future__ import annotations

import json
from typing import List

from .costs import GB
from .simulator import SimulationResult

_LANE_TRACKS = {"dp": "data-parallel", "d2h": "device to host", "h2d": "host to device",
                "embedding": "embedding all-reduce"}


def trace_events(result: SimulationResult) -> List[dict]:
    us = 1e6
    events: List[dict] = []
    for rank in range(result.config.pp):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        for e in result.timeline.compute[rank]:
            events.append({"name": str(e.op), "cat": "compute", "ph": "X", "pid": rank, "tid": "compute",
                           "ts": e.start * us, "dur": (e.end - e.start) * us,
                           "args": {"chunk": e.op.chunk, "microbatch": e.op.microbatch, "wait_us": (e.start - e.ready) * us,
                                    "waited_on": e.waited_on}})
        for t, size in result.memory[rank]:
            events.append({"name": "memory", "ph": "C", "pid": rank, "ts": t * us, "args": {"GiB": size / GB}})
        for t, size in (result.host_memory[rank] if result.host_memory else ()):
            events.append({"name": "host memory", "ph": "C", "pid": rank, "ts": t * us, "args": {"GiB": size / GB}})
    for c in result.timeline.comms:
        tid = f"send to rank {c.dst}" if c.lane == "p2p" else _LANE_TRACKS.get(c.lane, "data-parallel")
        name = f"{'act' if c.op.kind.value == 'F' else 'grad'} {c.op}" if c.lane == "p2p" else str(c.op)
        events.append({"name": name, "cat": c.lane, "ph": "X", "pid": c.src, "tid": tid,
                       "ts": c.start * us, "dur": max(c.end - c.start, 0.0) * us})
    return events


def write_trace(result: SimulationResult, path: str) -> None:
    """Write a JSON trace loadable by chrome://tracing or ui.perfetto.dev."""
    with open(path, "w", encoding="utf-8") as handle:
        json.dump({"traceEvents": trace_events(result), "displayTimeUnit": "ms"}, handle)
