"""Activation memory of whole forward-backward calls, whatever schedule makes them.

Megatron's ``train()`` calls its forward-backward function once per iteration with ``model=`` the rank's
chunks. :func:`metering` runs such a call inside one meter scope of :mod:`.memory`, so every tensor autograd
saves counts until the backward that frees it (the CPU meter follows each saved tensor's alias and stops
counting it when autograd drops it; on CUDA the allocator's peak is read). Two users:

* ``--pipemesh-measure-memory`` under ``--pipeline-schedule default``: :class:`MeteredStockSchedule` wraps
  Megatron's own function and leaves its result in ``last_stats`` like the PipeMesh runtime's, so the
  training log and the demo compare both schedules by one measurement;
* the bench (``bench/activation_meter.py``), which wraps every schedule, stock or PipeMesh, with its own
  meter (model state too) and makes it the ambient meter, so host-placed activations count as well.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator, List, Optional, Sequence

import torch

from .memory import make_memory_meter, measuring, model_tensors
from .stats import RuntimeStats

CALL_KEY = "forward-backward"


def model_chunks(model) -> List[torch.nn.Module]:
    """The chunks of a forward-backward call's ``model`` argument (one module or a list of them)."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [chunk for chunk in chunks if isinstance(chunk, torch.nn.Module)]


def chunks_device(chunks: Sequence[torch.nn.Module]) -> Optional[torch.device]:
    """The device of the chunks' first parameter (None without parameters)."""
    return next((p.device for chunk in chunks for p in chunk.parameters()), None)


@contextlib.contextmanager
def metering(meter, ambient: bool = False) -> Iterator[None]:
    """Measure the block (one whole call) with ``meter``; ``meter.peak_bytes`` holds its peak afterwards.
    ``ambient``: also make ``meter`` the ambient meter (:func:`.memory.measuring`), which the PipeMesh runtime
    hands the saves of host-placed chunk-micro-batches that their own hooks hide from outer ones."""
    meter.begin()
    with meter.record(CALL_KEY), (measuring(meter) if ambient else contextlib.nullcontext()):
        yield
    meter.release(CALL_KEY)  # on CUDA: reads the allocator's peak


class MeteredStockSchedule:
    """Callable wrapper of a megatron-core forward-backward function that meters activation memory."""

    def __init__(self, function: Callable):
        self.function = function
        self.last_stats = None

    def __call__(self, **kwargs):
        chunks = model_chunks(kwargs["model"])
        forward_only = bool(kwargs.get("forward_only", False))
        device = chunks_device(chunks)
        meter = None if forward_only or device is None else make_memory_meter(device, model_tensors(chunks))
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        stats = RuntimeStats(rank, -1, "stock", forward_only, timed_waits=False)
        begin = time.perf_counter()
        if meter is None:
            result = self.function(**kwargs)
        else:
            with metering(meter):
                result = self.function(**kwargs)
            stats.memory_source = meter.kind
            stats.peak_activation_bytes = int(meter.peak_bytes)
        stats.total_s = time.perf_counter() - begin
        self.last_stats = stats
        return result
