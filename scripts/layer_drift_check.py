"""Does one process time the same layer alike over a few minutes? Pinned to core 0, one thread: a bare loop of the
command's layer (forward + backward at micro-batch 1, 40 calls, median) between passes of the profile's own layer
measurement (:func:`megatron_pipemesh.integration.profile_pieces.measure_compute` at micro-batch 1), with the
process's resident memory, so that a move can be told from the process growing.

    .venv/bin/python scripts/layer_drift_check.py [--megatron-args "..."] [--passes 3]
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.layer_instances_check import layer_call, prepared  # noqa: E402
from scripts.profile_repeatability import LLAMA  # noqa: E402


def resident_mib() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-args", default=LLAMA)
    parser.add_argument("--passes", type=int, default=3)
    options = parser.parse_args()
    args, planned, run, end = prepared(options.megatron_args)
    from megatron_pipemesh.integration.profile import ProfileSettings
    from megatron_pipemesh.integration.profile_models import megatron_quiet
    from megatron_pipemesh.integration.profile_pieces import measure_compute

    started = time.monotonic()

    def bare() -> float:
        once = layer_call(args, run, 1)
        for _ in range(3):
            once()
        return statistics.median(once() for _ in range(40)) * 1e3

    def say(what: str) -> None:
        print(f"{time.monotonic() - started:6.1f} s  {what}; resident {resident_mib():.0f} MiB", flush=True)

    say(f"bare loop {bare():.2f} ms")
    for _ in range(options.passes):
        with megatron_quiet():
            found = measure_compute(args, planned.model, run.model.layer_spec, ProfileSettings(max_micro_batch=1),
                                    False, lambda line: None, [])[0]
        say(f"the profile's layer {1e3 * (found.layer_forward_s + found.layer_backward_s):.2f} ms")
        say(f"bare loop {bare():.2f} ms")
        gc.collect()
        say(f"bare loop after gc.collect() {bare():.2f} ms")
    end()
    return 0


if __name__ == "__main__":
    sys.exit(main())
