"""The fixed time of one message between two of the bench's ranks, measured where the rows will run (``pipemesh bench
--advice`` plans with it, as ``pipemesh plan --latency-us``).

:func:`measure_latency` starts two gloo ranks on the network the rows use (each in its own shaped namespace, or the
plain loopback with ``--unshaped``) running this module, which times :func:`..integration.profile_links.
time_round_trips` (a 4-byte message and its answer after the link idled, as ``pipemesh profile`` on several ranks
times it) and prints one line: ``[pipemesh-latency] {"seconds": [...]}`` (rank 0). Half the median round trip is the
latency. On this machine's emulated NICs it is 250-450 us one way, ten times the planner's default: gloo's threads
wake up for each message after the sender computed (``scripts/nic_burst_check.py``).
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from typing import Optional, Tuple

LINE_PREFIX = "[pipemesh-latency] "
WARMUP, REPEATS = 3, 15
"""Untimed and timed round trips (each after the link idled
:data:`~megatron_pipemesh.planning.profile_network.ROUND_TRIP_IDLE_S`: about half a second in all)."""


@dataclass(frozen=True)
class MeasuredLatency:
    """What :func:`measure_latency` found."""

    us: float
    """Half the median round trip, microseconds."""
    round_trips_s: Tuple[float, ...]
    """Every timed round trip, seconds."""
    where: str
    """The network it was timed on, in words."""

    def describe(self) -> str:
        ordered = sorted(self.round_trips_s)
        return (f"message latency {self.us:.0f} us (half the median of {len(ordered)} round trips of 4 bytes, "
                f"{ordered[0] * 1e6 / 2:.0f}-{ordered[-1] * 1e6 / 2:.0f} us; {self.where})")


def worker() -> None:
    """One torchrun rank: time the round trips between ranks 0 and 1; rank 0 prints them."""
    import torch
    import torch.distributed as dist

    from ..integration.profile_links import time_round_trips

    dist.init_process_group("gloo")
    seconds = time_round_trips(0, 1, dist.get_rank(), torch.device("cpu"), WARMUP, REPEATS, cuda=False)
    if dist.get_rank() == 0:
        print(LINE_PREFIX + json.dumps({"seconds": seconds}), flush=True)
    dist.destroy_process_group()


def parse_round_trips(text: str) -> Optional[Tuple[float, ...]]:
    """The round trips rank 0 printed in ``text`` (None: no such line)."""
    for line in text.splitlines():
        at = line.find(LINE_PREFIX)
        if at >= 0:
            return tuple(float(s) for s in json.loads(line[at + len(LINE_PREFIX):])["seconds"])
    return None


def measure_latency(shaping, log_path: str, timeout_s: float = 120.0) -> MeasuredLatency:
    """Time the round trips on the network of ``shaping`` (a :class:`.netns.Shaping`; None: the plain loopback);
    RuntimeError naming the log where the two ranks failed."""
    from .runner import error_excerpt, run_workers

    code, _, text = run_workers(shaping, 2, ("-m", "megatron_pipemesh.bench.message_probe"), [], log_path, timeout_s)
    where = "the plain loopback" if shaping is None else f"two ranks' NICs, {shaping.describe()}"
    trips = parse_round_trips(text) if code == 0 else None
    if not trips:
        what = f"did not finish within {timeout_s:g} s" if code == 124 else f"failed (exit {code})"
        raise RuntimeError(f"timing the message latency {what}; log {log_path}: {error_excerpt(text, 6)}")
    return MeasuredLatency(statistics.median(trips) / 2 * 1e6, trips, where)


if __name__ == "__main__":
    worker()
