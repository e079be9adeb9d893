"""Text picture of a timeline: one row per rank, one cell per time unit (unit-cost dry run:
F = 1 cell, B = 2 cells), '.' where the rank idles."""
from __future__ import annotations

from ..schedule.timeline import Timeline


def render_ascii(timeline: Timeline, cell: int = 5) -> str:
    width = int(round(timeline.makespan))
    rows = []
    for rank, events in enumerate(timeline.compute):
        line = [". " + " " * (cell - 2)] * width
        for e in events:
            start, length = int(round(e.start)), max(1, int(round(e.end - e.start)))
            text = str(e.op).ljust(cell * length)[: cell * length]
            for k in range(length):
                line[start + k] = text[k * cell:(k + 1) * cell]
        rows.append(f"rank {rank} | " + "".join(line).rstrip())
    return "\n".join(rows)
