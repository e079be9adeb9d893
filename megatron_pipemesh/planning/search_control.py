"""What the layout search (:mod:`.advice_search`, :mod:`.parallel_search`) is told from outside and says while it
runs: a stop request (a signal), why it must stop, and its progress line.

Pure: no torch.
"""
from __future__ import annotations

import bisect
import time
from typing import Any, List, Optional, Sequence, Tuple

Candidate = AdviceRow = Any
"""The advice's types (:mod:`.advice_candidates`, :mod:`.advice_rows`; not imported here)."""


class StopRequest:
    """A request from outside to stop the search now (the CLI's SIGINT / SIGTERM handler): the search ends as at its
    deadline, with the rows found so far and the bound of what it left. Safe to set from a signal handler."""

    def __init__(self) -> None:
        self.reason: Optional[str] = None
        """None, or what asked (e.g. 'SIGINT'): the first request wins."""

    def request(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason

    def __bool__(self) -> bool:
        return self.reason is not None


def stopped(deadline_s: Optional[float], stop: Optional[StopRequest]) -> Optional[str]:
    """Why the search must stop now (:attr:`.advice_rows.SearchLog.stopped_by`: 'interrupted' or 'search_seconds'),
    or None."""
    if stop:
        return "interrupted"
    if deadline_s is not None and time.monotonic() >= deadline_s:
        return "search_seconds"
    return None


def progress_line(found: Sequence[Candidate], done: int, limit_s: float, running: Sequence[Tuple[Candidate, str, float]],
                  best_pm: Optional[AdviceRow], best_st: Optional[AdviceRow], deadline_s: Optional[float]) -> str:
    """Where the layout search is: candidates done (in order), how many of the rest may still beat the rows (their
    bound below ``limit_s``, the larger best time), what runs now and for how long, the best times, the time left."""
    rest = found[done:]
    left = bisect.bisect_left([c.bound_s for c in rest], limit_s)
    now = time.monotonic()
    line = (f"{done} of {len(found)} candidates done, {left} left whose bound may beat the rows "
            f"({len(rest) - left} ruled out)")
    if running:
        line += "; simulating " + "; ".join(f"{brief(c)} ({side}, bound {c.bound_s:.3f} s, {now - since:.0f} s so far)"
                                           for c, side, since in running)
    line += "".join(f"; best {name} {row.iteration_s:.3f} s" for name, row in (("PipeMesh", best_pm), ("stock", best_st))
                    if row is not None)
    if deadline_s is not None:
        line += f"; {max(0.0, deadline_s - now):.0f} s to the deadline"
    return line


def brief(candidate: Candidate) -> str:
    """:meth:`.advice_candidates.Candidate.describe` with runs of equal layer counts written once ('1x30' for thirty
    stages of one layer): a progress line stays a line at V = 10 on 32 stages."""
    text = candidate.describe()
    if ", layers " not in text:
        return text
    head, rest = text.split(", layers ", 1)
    layers, _, tail = rest.partition(" ")
    runs: List[List] = []
    for count in layers.split("/"):
        if runs and runs[-1][0] == count:
            runs[-1][1] += 1
        else:
            runs.append([count, 1])
    short = "/".join(count if n == 1 else f"{count}x{n}" for count, n in runs)
    return f"{head}, layers {short}" + (f" {tail}" if tail else "")
