"""What else computed on the machine while ``pipemesh profile`` timed its pieces (CPU, Linux): the cores' busy time
from ``/proc/stat`` less this process's CPU time and its children's (the siblings computing beside it on purpose,
:mod:`.profile_siblings`), per group of pieces timed together.

A profile timed while another job used both cores of this machine priced the compute 3-4x too high; the advice made
from it measured 0.79x the user's command. The record (:class:`..planning.profile_quality.LoadRecord`) lets the
profile say so and ``pipemesh bench --advice`` refuse it.
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Dict, Iterator, Optional, Sequence, Tuple

from ..planning.profile_quality import LoadRecord

BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
"""Of a ``/proc/stat`` cpu line's counters: user, nice, system, irq, softirq, steal (not idle nor iowait; guest time
is already in user)."""

SLACK_TICKS = 2
"""Clock ticks each counter read may be off by (the kernel charges CPU time a tick at a time): taken off the others'
time so that the sampling alone never reads as load."""


def _ticks_per_s() -> float:
    return float(os.sysconf("SC_CLK_TCK"))


def busy_ticks(cores: Sequence[int], stat_text: str) -> int:
    """The busy clock ticks of ``cores`` in the text of ``/proc/stat``."""
    wanted = {f"cpu{core}" for core in cores}
    total = 0
    for line in stat_text.splitlines():
        fields = line.split()
        if fields and fields[0] in wanted:
            counters = [int(value) for value in fields[1:]]
            total += sum(counters[i] for i in BUSY_FIELDS if i < len(counters))
    return total


def process_ticks(stat_line: str) -> Tuple[int, int]:
    """(parent pid, user + system clock ticks) from a ``/proc/<pid>/stat`` line (the command name may hold spaces and
    parentheses: the fields are counted after its last ')')."""
    fields = stat_line[stat_line.rindex(")") + 2:].split()
    return int(fields[1]), int(fields[11]) + int(fields[12])


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError:  # a process that ended between the listing and the read
        return None


def own_ticks() -> int:
    """This process's and its children's (alive) CPU clock ticks."""
    me, total = os.getpid(), 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        text = _read(f"/proc/{entry}/stat")
        if text is None:
            continue
        parent, ticks = process_ticks(text)
        if int(entry) == me or parent == me:
            total += ticks
    return total


class LoadWatch:
    """Watches the cores this process may use while groups of pieces are timed (:meth:`piece`); :meth:`record`
    gives the :class:`LoadRecord`. Where ``/proc`` cannot be read (not Linux) it records nothing."""

    def __init__(self):
        self.cores = sorted(os.sched_getaffinity(0))
        self.others_cores: Dict[str, float] = {}
        self.loadavg_before = os.getloadavg()
        self.readable = os.path.exists("/proc/stat") and os.path.exists(f"/proc/{os.getpid()}/stat")

    def _snapshot(self) -> Tuple[int, int, float]:
        return busy_ticks(self.cores, _read("/proc/stat") or ""), own_ticks(), time.perf_counter()

    @contextlib.contextmanager
    def piece(self, label: str) -> Iterator[None]:
        """Within the block, count other processes' CPU time on the cores as ``label``'s (in cores: CPU seconds per
        wall second; a label timed twice keeps the larger)."""
        if not self.readable:
            yield
            return
        busy, own, began = self._snapshot()
        yield
        busy_after, own_after, ended = self._snapshot()
        others = max(0, (busy_after - busy) - (own_after - own) - SLACK_TICKS * (len(self.cores) + 1))
        cores = others / _ticks_per_s() / max(ended - began, 1e-9)
        self.others_cores[label] = max(cores, self.others_cores.get(label, 0.0))

    def record(self) -> Optional[LoadRecord]:
        """What was seen (None where ``/proc`` could not be read)."""
        if not self.readable:
            return None
        return LoadRecord(cores=len(self.cores), loadavg_before=tuple(self.loadavg_before),
                          loadavg_after=tuple(os.getloadavg()), others_cores=dict(self.others_cores))
