"""Device-host link bandwidth and how much of it hides behind compute (CUDA only).

* :func:`measure_host_link`: pinned copies of ``nbytes`` (256 MiB by default) device-to-host and
  host-to-device on a side stream, timed with CUDA events (one warm-up, then the median of
  ``repeats``). Training calls it once, before the first iteration, when ``--pipemesh-activation-placement
  auto`` needs a host-link bandwidth and ``--pipemesh-host-link-gbps`` is not given; the planner uses
  the slower direction. ``scripts/gpu_check.sh`` reports it with the overlap below.
* :func:`measure_overlap`: the same copy launched on the offload stream while ``compute`` runs on the
  compute stream (as OFFLOAD / RELOAD run next to the following forwards / preceding backwards):
  the fraction of the copy hidden behind the compute, and the bandwidth the copy reached while
  overlapping.

Both synchronise the device (they run at start-up or in checks, never inside an iteration) and free
what they allocated.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Optional

import torch

MEASURE_BYTES = 256 * 1024 * 1024
"""Bytes per measured copy: large enough for the link's steady rate, small enough for any host."""


@dataclass(frozen=True)
class HostLink:
    """Measured copy bandwidth of one device's host link, per direction (Gbit/s)."""

    d2h_gbps: float
    h2d_gbps: float
    nbytes: int

    @property
    def planning_gbps(self) -> float:
        """What the planner uses for both directions: the slower one."""
        return min(self.d2h_gbps, self.h2d_gbps)


def _gbps(nbytes: int, ms: float) -> float:
    return nbytes * 8 / (ms / 1e3) / 1e9 if ms > 0 else float("inf")


def _require_cuda(device: torch.device) -> torch.device:
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"measuring the host link needs a CUDA device, got {device}; give "
                           "--pipemesh-host-link-gbps instead")
    return device


def _timed_copy(stream: "torch.cuda.Stream", dst: torch.Tensor, src: torch.Tensor,
                before: Optional[Callable[[], None]] = None) -> float:
    """Milliseconds of one non-blocking copy on ``stream`` (synchronises), started after ``before()``."""
    if before is not None:
        before()
        torch.cuda.synchronize(dst.device if dst.is_cuda else src.device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        dst.copy_(src, non_blocking=True)
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end)


def measure_host_link(device: torch.device, nbytes: int = MEASURE_BYTES, repeats: int = 3,
                      before_copy: Optional[Callable[[], None]] = None) -> HostLink:
    """Pinned device-to-host and host-to-device copy bandwidth of ``device`` (see module doc). ``before_copy``: called
    before every copy (warm-up included), e.g. a barrier, so that the ranks of a node copy at once."""
    device = _require_cuda(device)
    with torch.cuda.device(device):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
        stream = torch.cuda.Stream(device=device)
        try:
            _timed_copy(stream, host, on_device, before_copy)  # warm-up: page mapping, DMA engines
            _timed_copy(stream, on_device, host, before_copy)
            d2h = statistics.median([_timed_copy(stream, host, on_device, before_copy) for _ in range(repeats)])
            h2d = statistics.median([_timed_copy(stream, on_device, host, before_copy) for _ in range(repeats)])
        finally:
            del host, on_device
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
    return HostLink(_gbps(nbytes, d2h), _gbps(nbytes, h2d), nbytes)


@dataclass(frozen=True)
class Overlap:
    """A copy next to compute: times alone and together (ms), hidden fraction, bandwidth while overlapping."""

    direction: str
    compute_ms: float
    copy_ms: float
    together_ms: float
    nbytes: int

    @property
    def hidden_fraction(self) -> float:
        """Share of the copy's time that did not lengthen the compute (1: fully hidden)."""
        if self.copy_ms <= 0:
            return 1.0
        return max(0.0, min(1.0, (self.compute_ms + self.copy_ms - self.together_ms) / self.copy_ms))

    @property
    def overlapped_gbps(self) -> float:
        """Bandwidth of the copy when it shares the device with compute (end of both / copy size, bounded by
        the copy's own time when the compute is longer)."""
        return _gbps(self.nbytes, max(self.copy_ms, self.together_ms - self.compute_ms))


def measure_overlap(device: torch.device, compute: Callable[[], object], nbytes: int, direction: str = "d2h",
                    repeats: int = 3) -> Overlap:
    """Run ``compute`` (on the current stream) alone, a pinned copy of ``nbytes`` in ``direction`` ('d2h' or
    'h2d') alone on a side stream, and both at once; medians over ``repeats``."""
    device = _require_cuda(device)
    if direction not in ("d2h", "h2d"):
        raise ValueError(f"direction must be 'd2h' or 'h2d', got {direction!r}")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst, src = (host, on_device) if direction == "d2h" else (on_device, host)
    side, main = torch.cuda.Stream(device=device), torch.cuda.current_stream(device)

    def window(run_compute: bool, run_copy: bool) -> float:
        start, end, copied = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        torch.cuda.synchronize(device)
        start.record(main)
        if run_copy:
            side.wait_event(start)
            with torch.cuda.stream(side):
                dst.copy_(src, non_blocking=True)
                copied.record(side)
        if run_compute:
            compute()
        if run_copy:
            main.wait_event(copied)
        end.record(main)
        end.synchronize()
        return start.elapsed_time(end)

    try:
        window(True, True)  # warm-up
        compute_ms = statistics.median(window(True, False) for _ in range(repeats))
        copy_ms = statistics.median(window(False, True) for _ in range(repeats))
        together_ms = statistics.median(window(True, True) for _ in range(repeats))
    finally:
        del host, on_device  # (dst and src alias them; the closure keeps its own cells)
        torch.cuda.synchronize(device)
    return Overlap(direction, compute_ms, copy_ms, together_ms, nbytes)


def startup_host_link(device: Optional[torch.device] = None) -> HostLink:
    """The start-up measurement of training on the local device (LOCAL_RANK's GPU)."""
    import os

    if device is None:
        index = int(os.environ.get("LOCAL_RANK", "0")) % max(torch.cuda.device_count(), 1)
        device = torch.device("cuda", index)
    return measure_host_link(device)
