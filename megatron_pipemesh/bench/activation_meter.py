"""Peak activation memory of every rank of a benchmark run, stock schedules included.

The training entry point (``megatron_pipemesh.training.pretrain_gpt``) calls :func:`install_from_env`;
with ``PIPEMESH_BENCH_ACTIVATION_METER=1`` in the environment, the forward-backward function Megatron's
``train()`` obtains (stock 1F1B, stock interleaved or PipeMesh alike) is wrapped so that each training
call runs under one meter of :mod:`megatron_pipemesh.runtime.memory`:

* CPU: :class:`~megatron_pipemesh.runtime.memory.SavedTensorMeter` around the *whole* call (forwards
  and backwards, so that a recomputation's re-saved tensors count while its backward holds them).
  Every storage autograd saves counts from its save until the last saved alias of it dies (the graph
  node that held it was freed by its backward); parameters and buffers never count;
* CUDA: :class:`~megatron_pipemesh.runtime.memory.AllocatorMeter`: the allocator's peak over the call
  above what was allocated when the call began.

Each rank prints one line per training iteration, parsed by :func:`parse_activation_peaks`::

    [pipemesh-bench] activation peak: rank 3 iteration 2 bytes 12582912 meter saved-tensors

Evaluation (``forward_only``) calls are not measured. The same wrapper measures every schedule, so
the numbers compare like with like.
"""
from __future__ import annotations

import functools
import os
import re
from typing import Callable, Dict, List, Optional

ENV_VAR = "PIPEMESH_BENCH_ACTIVATION_METER"
"""Set to 1 to measure (the bench sets it for every run)."""
LINE_RE = re.compile(r"\[pipemesh-bench\] activation peak: rank (\d+) iteration (\d+) bytes (\d+) meter ([\w-]+)")


def enabled(environ=None) -> bool:
    return (environ if environ is not None else os.environ).get(ENV_VAR, "") not in ("", "0")


def measure_forward_backward(func: Callable, report: Callable[[str], None] = print) -> Callable:
    """``func`` (a Megatron schedule function) with each training call's peak activation bytes reported."""
    if getattr(func, "_pipemesh_activation_meter", False):
        return func
    state = {"iteration": 0}

    @functools.wraps(func)
    def measured(*args, **kwargs):
        if kwargs.get("forward_only", False):
            return func(*args, **kwargs)
        import torch
        import torch.distributed as dist

        from ..runtime.memory import make_memory_meter

        model = kwargs.get("model")
        chunks = model if isinstance(model, (list, tuple)) else [model]
        chunks = [chunk for chunk in chunks if isinstance(chunk, torch.nn.Module)]
        device = next((p.device for chunk in chunks for p in chunk.parameters()), torch.device("cpu"))
        # Module.buffers explicitly: Megatron's DDP wrapper shadows ``buffers`` with its gradient buffers.
        meter = make_memory_meter(device, (t for chunk in chunks for t in (*torch.nn.Module.parameters(chunk),
                                                                           *torch.nn.Module.buffers(chunk))))
        meter.begin()
        if meter.kind == "saved-tensors":
            with meter.record("iteration"):
                result = func(*args, **kwargs)
        else:
            result = func(*args, **kwargs)
            meter.release("iteration")  # updates the allocator peak
        state["iteration"] += 1
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        report(f"[pipemesh-bench] activation peak: rank {rank} iteration {state['iteration']} "
               f"bytes {int(meter.peak_bytes)} meter {meter.kind}")
        return result

    measured._pipemesh_activation_meter = True
    return measured


def install() -> None:
    """Wrap the forward-backward function ``megatron.training.training`` hands to ``train_step``."""
    from megatron.training import training

    getter = training.get_forward_backward_func
    if getattr(getter, "_pipemesh_activation_meter", False):
        return

    @functools.wraps(getter)
    def get_forward_backward_func(*args, **kwargs):
        return measure_forward_backward(getter(*args, **kwargs), functools.partial(print, flush=True))

    get_forward_backward_func._pipemesh_activation_meter = True
    training.get_forward_backward_func = get_forward_backward_func


def install_from_env() -> bool:
    """:func:`install` when :data:`ENV_VAR` is set; returns whether it did."""
    if not enabled():
        return False
    install()
    return True


def parse_activation_peaks(text: str) -> Dict[int, List[int]]:
    """Rank -> peak activation bytes of each measured training iteration, in log order."""
    out: Dict[int, List[int]] = {}
    for match in LINE_RE.finditer(text):
        out.setdefault(int(match.group(1)), []).append(int(match.group(3)))
    return out


def peak_per_rank(text: str, world: int) -> Optional[List[Optional[int]]]:
    """Largest peak of each rank 0..world-1 over the run (None for a rank that reported nothing;
    None overall when no rank reported)."""
    peaks = parse_activation_peaks(text)
    if not peaks:
        return None
    return [max(peaks[r]) if peaks.get(r) else None for r in range(world)]
