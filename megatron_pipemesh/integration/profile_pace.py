"""The machine's pace while ``pipemesh profile`` times (CPU): a fixed matmul block timed once per measuring round.

:func:`.profile_timing.measure` ticks the pace before each round and takes that round's samples at the pace of its
tick (:meth:`Pace.at_base`); once every piece is timed, :meth:`Pace.factor` brings them from the first reading's pace
to the median of all, which the profile records (:class:`..planning.profile_quality.MachinePace`). Why: see there.
``pipemesh bench --advice`` times the same block before and after each run (:mod:`..bench.machine_speed`), so that a
row's compute can be read against the pace it ran at.
"""
from __future__ import annotations

import statistics
import time
from typing import List, Optional, Tuple

from ..planning.profile_quality import MachinePace, pace_of

BLOCK_SHAPE = (512, 256, 1024)
"""(m, k, n) of the block's products (the ledger GPT's layer shape: 512 tokens x hidden 256 into 1024)."""
BLOCK_PRODUCTS = 2
"""Products per block: about 3 ms here (a tick runs one product more first), small beside a round of layers."""
BLOCK = f"{BLOCK_PRODUCTS} products of {BLOCK_SHAPE[0]}x{BLOCK_SHAPE[1]} @ {BLOCK_SHAPE[1]}x{BLOCK_SHAPE[2]}, one thread"
"""The block, in words."""
BASE_TICKS = 15
"""Ticks whose median is the first reading (:attr:`Pace.base`)."""


class Pace:
    """Ticks of the block on this process's thread: (clock seconds, block seconds) each."""

    def __init__(self):
        import torch

        generator = torch.Generator().manual_seed(0)
        m, k, n = BLOCK_SHAPE
        self._x, self._w = torch.randn(m, k, generator=generator), torch.randn(k, n, generator=generator)
        self.ticks: List[Tuple[float, float]] = []
        self.tick()  # the first product allocates and warms the kernels
        self.ticks.clear()
        self.base: float = statistics.median(self.tick() for _ in range(BASE_TICKS))
        """The first reading: the pace :meth:`at_base` takes samples to."""

    def tick(self) -> float:
        """Runs the block once, then times it once (recorded); its seconds. The first run brings its operands into
        the caches: timed right after a layer the block took 5% longer than timed again at once, so a tick between a
        profile's pieces and one among ticks back to back (the bench's readings) would not read alike."""
        self._x @ self._w
        began = time.perf_counter()
        for _ in range(BLOCK_PRODUCTS):
            self._x @ self._w
        seconds = time.perf_counter() - began
        self.ticks.append((time.monotonic(), seconds))
        return seconds

    def at_base(self, samples: Tuple[float, ...], tick_s: float) -> Tuple[float, ...]:
        """``samples`` timed in a round whose tick took ``tick_s``, at the :attr:`base` pace."""
        return tuple(sample * self.base / tick_s for sample in samples)

    def factor(self) -> float:
        """From the base pace to the median of every tick (what :meth:`record` gives as the profile's pace)."""
        return statistics.median(seconds for _, seconds in self.ticks) / self.base

    def record(self) -> MachinePace:
        return pace_of(BLOCK, self.ticks)


def pace_here(cuda: bool) -> Optional[Pace]:
    """A :class:`Pace` on CPU; None on CUDA (a device's kernels are not timed by the host's matmul)."""
    return None if cuda else Pace()
