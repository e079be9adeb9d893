"""``pipemesh profile``'s measuring loop: how every time in a profile is taken (the layers and the ends, the schedule
step, the optimizer), and how much is measured (:class:`ProfileSettings`).

:func:`medians` is the one loop: each named measurement is called once per round, the names taking turns in every
round so that a drift of the machine's speed (other processes, clocks) reaches them alike and their differences (a
recomputation's extra, a step less its pieces) stay fair; the first ``warmup`` rounds are dropped (first-call
allocations, lazy initialisation) and the median of each number over the others is kept.

:class:`Timer` takes one block's seconds: the wall clock on CPU, CUDA events on CUDA.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple


@dataclass(frozen=True)
class ProfileSettings:
    """How much to measure."""

    warmup: int = 2
    """Calls before the timed ones (first-call allocations, lazy initialisation)."""
    repeats: int = 5
    """Timed calls; the median is kept."""
    max_micro_batch: Optional[int] = None
    """The largest micro-batch size measured (None: the command's); larger than the command's measures the sizes
    the advice may change it to (1, 2, 4, ... and this one)."""
    seed: int = 1234
    """Seed of the weights and inputs."""
    bucket_bytes: Optional[int] = None
    """The larger message the links are timed with (None: on CUDA Megatron's gradient bucket of the command,
    :func:`.profile_links.megatron_bucket_bytes`; on CPU :data:`.profile_links.CPU_BUCKET_BYTES`)."""
    ranks_per_node: int = 1
    """On CPU: the ranks that will compute at once on this machine; the compute is timed with that many cores
    computing (the others run the command's layer, :mod:`.profile_siblings`), at most the cores this process may
    use. Ignored on CUDA (each rank computes on a device of its own)."""


class Timer:
    """Seconds of a block: CUDA events on CUDA, the wall clock on CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def __call__(self, fn: Callable[[], object]) -> Tuple[object, float]:
        import torch

        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            return out, start.elapsed_time(end) / 1e3
        began = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - began


def medians(calls: Mapping[str, Callable[[], Sequence[float]]], warmup: int,
            repeats: int) -> Dict[str, Tuple[float, ...]]:
    """Per name, the median of each number ``calls[name]()`` returns (seconds) over ``repeats`` rounds after
    ``warmup`` rounds, the names taking turns in every round (see the module)."""
    samples: Dict[str, List[Sequence[float]]] = {name: [] for name in calls}
    for round_ in range(warmup + repeats):
        for name, call in calls.items():
            found = call()
            if round_ >= warmup:
                samples[name].append(found)
    return {name: tuple(statistics.median(column) for column in zip(*rows)) for name, rows in samples.items()}
