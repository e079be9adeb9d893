"""Does the profile's pace block move as a layer does? One process per core (pinned, one thread), each timing the
command's layer (forward + backward at micro-batch 1, as ``pipemesh profile`` builds it) and the pace block
(:mod:`megatron_pipemesh.integration.profile_pace`) in turn for ``--seconds``; prints per window each core's layer and
block medians, and per window width how far the layer alone and the layer over the block moved (range and standard
deviation of the windows, % of their median).

    .venv/bin/python scripts/machine_pace_check.py [--megatron-args "..."] [--seconds 180]

Nothing else should run meanwhile. Where layer over block holds while the layer moves, the machine moved, not the
layer, and a profile taken at one pace can be compared with another.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.profile_repeatability import LLAMA  # noqa: E402

WIDTHS = (2.0, 10.0, 30.0)
"""Window widths the moves are summed up at, seconds."""


def worker(megatron_args: str, core: int, seconds: float) -> List[Tuple[float, float, float]]:
    """(monotonic clock, layer seconds, block seconds) per turn on ``core``."""
    from scripts.layer_instances_check import layer_call, prepared

    args, _, run, end = prepared(megatron_args)
    os.sched_setaffinity(0, {core})
    from megatron_pipemesh.integration.profile_pace import Pace

    once, pace = layer_call(args, run, 1), Pace()
    for _ in range(5):
        once()
    rows, until = [], time.monotonic() + seconds
    while time.monotonic() < until:
        layer_s = once()
        rows.append((time.monotonic(), layer_s, pace.tick()))
    end()
    return rows


def windows(rows, start: float, width: float) -> Dict[int, Tuple[float, float]]:
    """Per window index: (layer median, block median), seconds."""
    by: Dict[int, list] = {}
    for at, layer_s, block_s in rows:
        by.setdefault(int((at - start) // width), []).append((layer_s, block_s))
    return {index: (statistics.median(a for a, _ in values), statistics.median(b for _, b in values))
            for index, values in sorted(by.items())}


def moved(values: List[float]) -> str:
    middle = statistics.median(values)
    return (f"range {100 * (max(values) - min(values)) / middle:5.1f}%, "
            f"stdev {100 * statistics.pstdev(values) / statistics.mean(values):4.1f}%")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-args", default=LLAMA)
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker is not None:
        print(json.dumps(worker(options.megatron_args, options.worker, options.seconds)))
        return 0
    cores = sorted(os.sched_getaffinity(0))
    before = os.getloadavg()
    workers = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--megatron-args", options.megatron_args,
                                 "--seconds", str(options.seconds), "--worker", str(core)], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True) for core in cores]
    found = [json.loads(w.communicate()[0].strip().splitlines()[-1]) for w in workers]
    print(f"load average before {before[0]:.2f}, after {os.getloadavg()[0]:.2f}; cores {cores}")
    start = min(rows[0][0] for rows in found)
    per_core = [windows(rows, start, 10.0) for rows in found]
    print("window  " + "  ".join(f"core {core} layer ms / block ms" for core in cores))
    for index in sorted(set().union(*per_core)):
        print(f"{index * 10:>5.0f}s  " + "  ".join(
            f"{per[index][0] * 1e3:>15.2f} / {per[index][1] * 1e3:>6.3f}" if index in per else f"{'-':>24}"
            for per in per_core))
    for width in WIDTHS:
        for core, rows in zip(cores, found):
            whole = list(windows(rows, start, width).values())
            whole = whole[1:-1] or whole  # whole windows only
            print(f"windows of {width:>4g} s, core {core}: layer {moved([a for a, _ in whole])}; block "
                  f"{moved([b for _, b in whole])}; layer over block {moved([a / b for a, b in whole])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
