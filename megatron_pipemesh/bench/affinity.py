"""Pin each rank of a benchmark run to one core (``pipemesh bench --pin-cores``).

With more ranks than cores the kernel lets a rank that waits for communication hand its core to any
other rank, so one pipeline stage's wait is filled with another stage's compute, which no real
cluster does. Pinning every rank of pipeline stage s to core ``s % cores`` keeps the stages apart:
the ranks sharing a core are the data-parallel replicas of one stage, which run the same program in
step (each one a device at 1/d of the core's speed).

The bench sets ``PIPEMESH_BENCH_CORES`` to the core of each global rank, comma-separated; each rank's entry
(:mod:`.rank`) calls :func:`pin_from_env` before anything starts threads.
"""
from __future__ import annotations

import os
from typing import List, Optional

ENV_VAR = "PIPEMESH_BENCH_CORES"


def stage_cores(pp: int, dp: int, cores: int) -> List[int]:
    """Core of each global rank: its pipeline stage modulo ``cores`` (Megatron's default rank order puts
    the data-parallel replicas of one stage next to each other: global rank r is stage r // dp)."""
    return [(rank // dp) % cores for rank in range(pp * dp)]


def pin_from_env(environ=None) -> Optional[int]:
    """Pin this process (``RANK``) to its core from :data:`ENV_VAR`; returns the core, None when unset."""
    environ = os.environ if environ is None else environ
    text = environ.get(ENV_VAR, "")
    if not text:
        return None
    cores = [int(c) for c in text.split(",")]
    rank = int(environ.get("RANK", "0"))
    if rank >= len(cores):
        raise SystemExit(f"{ENV_VAR}={text} names {len(cores)} ranks but this is rank {rank}: give one core per rank")
    os.sched_setaffinity(0, {cores[rank]})
    return cores[rank]
