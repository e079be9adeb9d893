"""This machine's own speed at a moment: the profile's pace block (:mod:`..integration.profile_pace`) timed on
every core at once, one pinned one-thread process per core, as the bench's ranks compute.

A VM's speed moves by itself, every core alike: 10-25% over seconds and minutes here, and a layer's time with it
(``scripts/machine_pace_check.py``). ``pipemesh profile`` gives every time at the pace of the block over its rounds
(:class:`..planning.profile_quality.MachinePace`); ``pipemesh bench --advice`` times the same block on every core
before and after each run of a row, so that a row's compute measured against the profile's pieces can be read beside
how much slower or faster the machine itself ran then (:func:`drift`); nothing is scaled by it.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from typing import List, Optional, Sequence, Tuple

from ..integration.profile_pace import BLOCK

WORKER = r"""
import json, os, sys, time, torch
os.sched_setaffinity(0, {int(sys.argv[1])})
torch.set_num_threads(1)
from megatron_pipemesh.integration.profile_pace import Pace
pace = Pace()
pace.ticks.clear()
until = time.monotonic() + float(sys.argv[2])
while time.monotonic() < until:
    pace.tick()
print(json.dumps(pace.ticks))
"""
REFERENCE_SECONDS = 1.0
"""How long each core times the block for one reading (about 300 blocks here)."""


def time_blocks(seconds: float, cores: Optional[Sequence[int]] = None) -> List[List[Tuple[float, float]]]:
    """Per core (every core this process may use, by default), (monotonic clock, seconds) of every block timed
    during ``seconds``, all cores at once."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else list(cores)
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, str(core), str(seconds)], stdout=subprocess.PIPE,
                                text=True) for core in cores]
    return [[(float(a), float(b)) for a, b in json.loads(worker.communicate()[0])] for worker in workers]


def reference_s(seconds: float = REFERENCE_SECONDS) -> float:
    """One reading: the median block time over every core's blocks, seconds."""
    return statistics.median(s for samples in time_blocks(seconds) for _, s in samples)


def drift(readings: Sequence[float], baseline: Sequence[float]) -> Optional[float]:
    """How much slower the machine ran during ``readings`` than during ``baseline`` (their medians; +0.05: 5% slower);
    None without both."""
    if not readings or not baseline:
        return None
    return statistics.median(readings) / statistics.median(baseline) - 1.0
