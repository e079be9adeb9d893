"""This machine's own speed at a moment: a fixed matmul block timed on every core at once, one pinned one-thread
process per core, as the bench's ranks compute.

A VM's speed moves by itself: run alone for 3 minutes, the block's 10-second medians here span +7-8% on each core
(``scripts/machine_speed.py``). ``pipemesh bench --advice`` times the block before and after its profile and before
each run of a row, so that a row's compute measured against the profile's pieces can be read beside how much slower
or faster the machine itself ran then (:func:`drift`); nothing is scaled by it. The block is compute-bound (it fits a
core's L2): a small layer's memory-bound speed moves by more, from second to second, where the block holds
(``scripts/layer_drift_check.py``), so a small drift does not clear the machine.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from typing import List, Optional, Sequence, Tuple

BLOCK = "20 products of 512x256 @ 256x1024 (the ledger GPT's layer shape), one thread"
"""The block each core times, in words."""
WORKER = r"""
import json, os, sys, time, torch
os.sched_setaffinity(0, {int(sys.argv[1])})
torch.set_num_threads(1)
x, w = torch.randn(512, 256), torch.randn(256, 1024)
until = time.time() + float(sys.argv[2])
out = []
while time.time() < until:
    began = time.perf_counter()
    for _ in range(20):
        x @ w
    out.append((time.time(), time.perf_counter() - began))
print(json.dumps(out))
"""
REFERENCE_SECONDS = 1.0
"""How long each core times the block for one reading (about 35 blocks here)."""


def time_blocks(seconds: float, cores: Optional[Sequence[int]] = None) -> List[List[Tuple[float, float]]]:
    """Per core (every core this process may use, by default), (wall clock, seconds) of every block timed during
    ``seconds``, all cores at once."""
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
