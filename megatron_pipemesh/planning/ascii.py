"""Text picture of a timeline: one row per rank, one cell per time unit (unit-cost dry run:
F = 1 cell, B = 2 cells), '.' where the rank idles."""
from __future__ import annotations

from typing import Optional

from ..schedule.timeline import Timeline


def render_ascii(timeline: Timeline, cell: Optional[int] = None) -> str:
    """Cells are at least one character wider than the longest op name (``F0.10`` needs 6 once m > 10),
    so columns stay aligned and names never run together."""
    longest = max((len(str(e.op)) for events in timeline.compute for e in events), default=1)
    cell = max(cell or 0, longest + 1, 2)
    width = int(round(timeline.makespan))
    rows = []
    for rank, events in enumerate(timeline.compute):
        line = [".".ljust(cell)] * width
        for e in events:
            start, length = int(round(e.start)), max(1, int(round(e.end - e.start)))
            text = str(e.op).ljust(cell * length)
            for k in range(length):
                line[start + k] = text[k * cell:(k + 1) * cell]
        rows.append(f"rank {rank} | " + "".join(line).rstrip())
    return "\n".join(rows)
