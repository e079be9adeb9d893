"""Activation memory of whole forward-backward calls, whatever schedule makes them.

Megatron's ``train()`` calls its forward-backward function once per iteration with ``model=`` the rank's
chunks. :func:`metering` runs such a call inside one meter scope of :mod:`.memory`, so every tensor autograd
saves counts until the backward that frees it (the CPU meter follows each saved tensor's alias and stops
counting it when autograd drops it). On CUDA the allocator meter needs op boundaries inside the call:
:func:`op_boundaries` wraps Megatron's ``forward_step`` / ``backward_step`` / ``deallocate_output_tensor`` (the
module globals of ``megatron.core.pipeline_parallel.schedules`` that every schedule calls, stock or PipeMesh), so
each forward is one key, from its ``forward_step`` to the end of the ``backward_step`` of its output. Two users:

* ``--pipemesh-measure-memory`` under ``--pipeline-schedule default``: :class:`MeteredStockSchedule` wraps
  Megatron's own function and leaves its result in ``last_stats`` like the PipeMesh runtime's, so the
  training log and the demo compare both schedules by one measurement;
* the bench (``bench/activation_meter.py``), which wraps every schedule, stock or PipeMesh, with its own
  meter (model state too) and makes it the ambient meter, so host-placed activations count as well.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import torch

from .memory import AllocatorMeter, make_memory_meter, measuring, model_tensors
from .stats import RuntimeStats

CALL_KEY = "forward-backward"


def model_chunks(model) -> List[torch.nn.Module]:
    """The chunks of a forward-backward call's ``model`` argument (one module or a list of them)."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [chunk for chunk in chunks if isinstance(chunk, torch.nn.Module)]


def chunks_device(chunks: Sequence[torch.nn.Module]) -> Optional[torch.device]:
    """The device of the chunks' first parameter (None without parameters)."""
    return next((p.device for chunk in chunks for p in chunk.parameters()), None)


_BOUNDARY = threading.local()
"""This thread's meters taking Megatron's op boundaries (:func:`op_boundaries`), innermost last."""
_WRAPPED: List[str] = []


class _CallKeys:
    """One whole-call meter's keys: each forward's, found again at its backward and deallocation by its output."""

    def __init__(self, meter):
        self.meter = meter
        self.by_output: Dict[int, object] = {}
        """``id`` of a forward's output object -> its key (the object stays alive in the schedule until then)."""
        self.anonymous = itertools.count()

    def key(self, kwargs) -> object:
        """(chunk, micro-batch) as PipeMesh's runtime names it, so host placement's reports find the key."""
        microbatch, chunk = kwargs.get("current_microbatch"), kwargs.get("vp_stage")
        return ("call", next(self.anonymous)) if microbatch is None else (chunk or 0, microbatch)


def _forward_step(original, *args, **kwargs):
    calls = getattr(_BOUNDARY, "calls", None)
    if not calls:
        return original(*args, **kwargs)
    call = calls[-1]
    key = call.key(kwargs)
    with call.meter.record(key):
        result = original(*args, **kwargs)
    output = result[0] if isinstance(result, tuple) else result
    call.meter.hold_input(key, args[4] if len(args) > 4 else kwargs.get("input_tensor"))
    call.meter.track(key, output)
    call.by_output[id(output)] = key
    return result


def _backward_step(original, input_tensor, output_tensor, *args, **kwargs):
    calls = getattr(_BOUNDARY, "calls", None)
    result = original(input_tensor, output_tensor, *args, **kwargs)
    if calls:
        key = calls[-1].by_output.pop(id(output_tensor), None)
        if key is not None:
            calls[-1].meter.release(key)
    return result


def _deallocate_output_tensor(original, out, *args, **kwargs):
    result = original(out, *args, **kwargs)
    calls = getattr(_BOUNDARY, "calls", None)
    deallocate = args[0] if args else kwargs.get("deallocate_pipeline_outputs", False)
    if calls and deallocate:
        key = calls[-1].by_output.get(id(out))
        if key is not None:
            calls[-1].meter.untrack(key)
    return result


def _wrap_schedules() -> None:
    """Route Megatron's three functions through the boundary wrappers, once per process (they only pass through
    on a thread without a whole-call meter)."""
    if _WRAPPED:
        return
    from megatron.core.pipeline_parallel import schedules

    for name, wrapper in (("forward_step", _forward_step), ("backward_step", _backward_step),
                          ("deallocate_output_tensor", _deallocate_output_tensor)):
        original = getattr(schedules, name)
        wrapped = functools.wraps(original)(functools.partial(wrapper, original))
        setattr(schedules, name, wrapped)
        _WRAPPED.append(name)


@contextlib.contextmanager
def op_boundaries(meter) -> Iterator[None]:
    """Within the block, on this thread, every Megatron ``forward_step`` is a :meth:`~.memory.AllocatorMeter.record`
    of its own key (its input held, its output tracked), the ``backward_step`` of that output releases it, and a
    ``deallocate_output_tensor`` of it untracks it: what the allocator meter needs to measure a whole call."""
    _wrap_schedules()
    calls = getattr(_BOUNDARY, "calls", None)
    if calls is None:
        calls = _BOUNDARY.calls = []
    call = _CallKeys(meter)
    calls.append(call)
    try:
        yield
    finally:
        calls.remove(call)


@contextlib.contextmanager
def metering(meter, ambient: bool = False) -> Iterator[None]:
    """Measure the block (one whole call) with ``meter``; ``meter.peak_bytes`` holds its peak afterwards.
    ``ambient``: also make ``meter`` the ambient meter (:func:`.memory.measuring`), which the PipeMesh runtime
    hands host placement's reports and (saved-tensor meter) the saves of host-placed chunk-micro-batches that
    their own hooks hide from outer ones. The saved-tensor meter records the whole call as one key; the allocator
    meter takes Megatron's op boundaries (:func:`op_boundaries`)."""
    meter.begin()
    whole_call = not isinstance(meter, AllocatorMeter)
    with meter.record(CALL_KEY) if whole_call else op_boundaries(meter), \
            measuring(meter) if ambient else contextlib.nullcontext():
        yield
    if whole_call:
        meter.release(CALL_KEY)


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
