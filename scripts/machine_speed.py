"""How steady is this machine's own speed? One process per core (pinned, one thread each, as the bench's ranks run)
times the profile's pace block (:mod:`megatron_pipemesh.integration.profile_pace`) back to back for ``--seconds``;
the script prints per window of ``--window`` seconds each core's median block time and how far the slowest window is
from the fastest.

    .venv/bin/python scripts/machine_speed.py [--seconds 300] [--window 10]

Nothing else should run meanwhile: the load average before and after is printed. A move between windows here is the
machine's (its host, its clocks), not any model's: a prediction cannot be judged on this machine more closely than
the spread this prints.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_pipemesh.bench.machine_speed import BLOCK, time_blocks  # noqa: E402


def windows(samples: List[List[float]], start: float, width: float) -> Dict[int, float]:
    """Median block seconds per window index (``width`` seconds from ``start``)."""
    by: Dict[int, List[float]] = {}
    for stamp, seconds in samples:
        by.setdefault(int((stamp - start) // width), []).append(seconds)
    return {index: statistics.median(values) for index, values in sorted(by.items())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--window", type=float, default=10.0)
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    before = os.getloadavg()
    found = time_blocks(args.seconds, cores)
    after = os.getloadavg()
    start = min(samples[0][0] for samples in found)
    per_core = [windows(samples, start, args.window) for samples in found]
    print(f"load average before {before[0]:.2f}, after {after[0]:.2f}; cores {cores}; block = {BLOCK}")
    print("window  " + "  ".join(f"core {core} ms" for core in cores))
    for index in sorted(set().union(*per_core)):
        print(f"{index * args.window:>5.0f}s  " + "  ".join(
            f"{per.get(index, float('nan')) * 1e3:>9.2f}" for per in per_core))
    for core, per in zip(cores, per_core):
        values = list(per.values())[1:-1] or list(per.values())  # whole windows only
        print(f"core {core}: windows' medians {min(values) * 1e3:.2f}-{max(values) * 1e3:.2f} ms, slowest "
              f"{(max(values) / min(values) - 1) * 100:+.1f}% over fastest")
    return 0


if __name__ == "__main__":
    sys.exit(main())
