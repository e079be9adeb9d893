"""Measure stock Megatron schedules with the same activation meter as the PipeMesh runtime.

With ``--pipemesh-measure-memory`` and ``--pipeline-schedule default``, Megatron's own
forward-backward function is wrapped by :class:`MeteredStockSchedule`: the whole call runs inside
one meter scope, so every tensor autograd saves is counted until the backward that frees it (the
CPU meter follows each saved tensor's alias and stops counting it when autograd drops it; on CUDA
the allocator's peak is read). The result lands in ``last_stats`` like the PipeMesh runtime's, so
the training log, the demo and the benchmark compare both schedules by one measurement.
"""
from __future__ import annotations

import time
from typing import Callable

from .memory import make_memory_meter, model_tensors
from .stats import RuntimeStats

CALL_KEY = "forward-backward"


class MeteredStockSchedule:
    """Callable wrapper of a megatron-core forward-backward function that meters activation memory."""

    def __init__(self, function: Callable):
        self.function = function
        self.last_stats = None

    def __call__(self, **kwargs):
        model = kwargs["model"]
        chunks = model if isinstance(model, list) else [model]
        forward_only = bool(kwargs.get("forward_only", False))
        device = next((p.device for chunk in chunks for p in chunk.parameters()), None)
        meter = None if forward_only or device is None else make_memory_meter(device, model_tensors(chunks))
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        stats = RuntimeStats(rank, -1, "stock", forward_only, timed_waits=False)
        begin = time.perf_counter()
        if meter is None:
            result = self.function(**kwargs)
        else:
            meter.begin()
            with meter.record(CALL_KEY):
                result = self.function(**kwargs)
            meter.release(CALL_KEY)
            stats.memory_source = meter.kind
            stats.peak_activation_bytes = int(meter.peak_bytes)
        stats.total_s = time.perf_counter() - begin
        self.last_stats = stats
        return result
