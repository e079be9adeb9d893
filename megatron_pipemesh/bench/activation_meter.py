"""Peak activation memory of every rank of a benchmark run, stock schedules included.

The bench's rank entry (:mod:`.rank`) calls :func:`install_from_env` once the training entry point prepared
the process; with ``PIPEMESH_BENCH_ACTIVATION_METER=1`` in the environment, the forward-backward function
Megatron's ``train()`` obtains (stock 1F1B, stock interleaved or PipeMesh alike) is wrapped so that each
training call runs under one meter of :mod:`megatron_pipemesh.runtime.memory`, by the runtime's own call
metering (:func:`megatron_pipemesh.runtime.call_meter.metering`, which also serves the product's
``--pipemesh-measure-memory`` under the stock schedule):

* CPU: :class:`~megatron_pipemesh.runtime.memory.SavedTensorMeter` around the *whole* call (forwards
  and backwards, so that a recomputation's re-saved tensors count while its backward holds them).
  Every storage autograd saves counts from its save until the last saved alias of it dies (the graph
  node that held it was freed by its backward); parameters and buffers never count;
* CUDA: :class:`~megatron_pipemesh.runtime.memory.AllocatorMeter`: the same activation bytes from the
  allocator's counters at Megatron's op boundaries (each ``forward_step`` to the ``backward_step`` of its output,
  :func:`~megatron_pipemesh.runtime.call_meter.op_boundaries`): the temporaries of an op do not count, and the
  allocator's own peak counters are never reset.

Each rank prints one line per training iteration, parsed by :func:`parse_activation_peaks`::

    [pipemesh-bench] activation peak: rank 3 iteration 2 bytes 12582912 meter saved-tensors

Evaluation (``forward_only``) calls are not measured. The same wrapper measures every schedule, so
the numbers compare like with like.

Model state (``pipemesh bench --sharding``: every chunk a Megatron DDP chunk under the distributed
optimizer): the line also carries ``state S total T``. The rank's weights + gradients + optimizer state
are counted as the mixed-sharding runtime counts them (:func:`model_state_probe`: whole buffers of a
ZeRO-1 chunk, buffers + shard tensors + accumulators of a ZeRO-2/3 chunk, the optimizers' state) and
sampled (:func:`state_and_activation_meter`) at every saved tensor, every unpack of one, and after each
step of the mixed-sharding runtime (:func:`install_state_sampling`: program start, before every op,
every GATHER / RELEASE / REDUCE; needed because a host-placed chunk-micro-batch's tensors never reach
the bench's hooks). S is the least model state held while the schedule ran (for ZeRO-2/3 chunks:
outside their groups); T the peak of model state + activations, at least S + the activation peak: it
also holds gathered ZeRO-3 weights and ZeRO-2/3 gradient buffers while their groups run, and the whole
buffers the optimizer step uses (the state sampled before the call). On CUDA S is the state before the
call and T what the allocator held when the call began plus the activation peak (the same quantity, without
temporaries).
"""
from __future__ import annotations

import contextlib
import functools
import os
import re
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

ENV_VAR = "PIPEMESH_BENCH_ACTIVATION_METER"
"""Set to 1 to measure (the bench sets it for every run)."""
LINE_RE = re.compile(r"\[pipemesh-bench\] activation peak: rank (\d+) iteration (\d+) bytes (\d+) meter ([\w-]+)"
                     r"(?: state (\d+) total (\d+))?")


def enabled(environ=None) -> bool:
    return (environ if environ is not None else os.environ).get(ENV_VAR, "") not in ("", "0")


def model_state_probe(chunks: Sequence) -> Optional[Callable[[], int]]:
    """A function returning the bytes of weights + gradients + optimizer state the rank holds now, as the
    mixed-sharding runtime counts them (:mod:`megatron_pipemesh.runtime.sharding`); None unless every chunk
    is a Megatron DDP chunk under the distributed optimizer. The optimizer state is read once: it only
    changes in the step, between calls."""
    if not chunks or not all(getattr(getattr(c, "ddp_config", None), "use_distributed_optimizer", False) for c in chunks):
        return None
    from ..runtime.sharding import optimizer_state_bytes, whole_chunk_bytes

    optimizer = optimizer_state_bytes()

    def probe() -> int:
        held = 0
        for chunk in chunks:
            state = getattr(chunk, "_pipemesh_sharding", None)  # ZeRO-2/3 chunk (made on the first call)
            held += state.held_bytes() if state is not None else whole_chunk_bytes(chunk)
        return held + optimizer

    return probe


def state_and_activation_meter(parameters: Iterable, probe: Callable[[], int]):
    """A :class:`~megatron_pipemesh.runtime.memory.SavedTensorMeter` that also samples ``probe`` (model state)
    whenever activations grow (a save) and whenever a backward reads them (an unpack: a chunk's gathered
    weights and gradient buffer are back before its backward runs, with its activations still held)."""
    from ..runtime.memory import SavedTensorMeter

    class StateAndActivationMeter(SavedTensorMeter):
        def __init__(self):
            super().__init__(parameters)
            self.peak_total_bytes = 0
            """Peak of model state + activations over the samples."""
            self.least_state_bytes: Optional[int] = None
            """Least model state over the samples."""

        def sample(self) -> None:
            state = probe()
            self.least_state_bytes = state if self.least_state_bytes is None else min(self.least_state_bytes, state)
            self.peak_total_bytes = max(self.peak_total_bytes, state + self.live_bytes)

        def _add(self, key, ptr, nbytes) -> bool:
            added = super()._add(key, ptr, nbytes)
            if added:
                self.sample()
            return added

        @contextlib.contextmanager
        def record(self, key, inner=None):
            inner_pack, inner_unpack = inner or (None, None)

            def unpack(packed):
                self.sample()
                return inner_unpack(packed) if inner_unpack else packed

            with super().record(key, inner=(inner_pack, unpack)):
                yield

    return StateAndActivationMeter()


_SAMPLER: Dict[str, Callable[[], None]] = {}
"""The running call's ``sample`` (set while a training call runs under a state-and-activation meter)."""


def _sample_running_meter() -> None:
    sample = _SAMPLER.get("current")
    if sample is not None:
        sample()


def install_state_sampling() -> None:
    """Sample the running meter after each step of :class:`megatron_pipemesh.runtime.sharding.ProgramSharding`
    (where ZeRO-2/3 buffers are freed and brought back), so the joint peak sees them whatever the activations do:
    the runtime's step observer (:func:`~megatron_pipemesh.runtime.sharding.add_step_observer`; idempotent)."""
    from ..runtime.sharding import add_step_observer

    add_step_observer(_sample_running_meter)


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

        from ..runtime.call_meter import chunks_device, metering, model_chunks
        from ..runtime.memory import make_memory_meter, model_tensors

        chunks = model_chunks(kwargs.get("model"))
        device = chunks_device(chunks)
        device = torch.device("cpu") if device is None else device
        excluded = list(model_tensors(chunks))
        probe = model_state_probe(chunks)
        before = probe() if probe is not None else None  # whole buffers + optimizer state: what the step holds
        if probe is not None and device.type == "cpu":
            meter = state_and_activation_meter(excluded, probe)
        else:
            meter = make_memory_meter(device, excluded)
        if hasattr(meter, "sample"):
            _SAMPLER["current"] = meter.sample
        try:
            # Ambient: host placement reports to it what left the device (the saved-tensor meter also needs the
            # host-placed saves handed to it).
            with metering(meter, ambient=True):
                result = func(*args, **kwargs)
        finally:
            _SAMPLER.pop("current", None)
        state["iteration"] += 1
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        memory = ""
        if before is not None:
            if hasattr(meter, "peak_total_bytes"):
                least = meter.least_state_bytes if meter.least_state_bytes is not None else before
                total = max(before, meter.peak_total_bytes)
            else:  # CUDA: what the allocator held at the call's start (the state) plus the activation peak
                least, total = before, meter.baseline + meter.peak_bytes
            memory = f" state {int(least)} total {int(total)}"
        report(f"[pipemesh-bench] activation peak: rank {rank} iteration {state['iteration']} "
               f"bytes {int(meter.peak_bytes)} meter {meter.kind}{memory}")
        return result

    measured._pipemesh_activation_meter = True
    return measured


def install() -> None:
    """Wrap the forward-backward function ``megatron.training.training`` hands to ``train_step``, and sample model
    state after each step of the mixed-sharding runtime (:func:`install_state_sampling`)."""
    from megatron.training import training

    getter = training.get_forward_backward_func
    if getattr(getter, "_pipemesh_activation_meter", False):
        return

    @functools.wraps(getter)
    def get_forward_backward_func(*args, **kwargs):
        return measure_forward_backward(getter(*args, **kwargs), functools.partial(print, flush=True))

    get_forward_backward_func._pipemesh_activation_meter = True
    training.get_forward_backward_func = get_forward_backward_func
    install_state_sampling()


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


def parse_memory(text: str) -> Dict[int, List[Tuple[int, int]]]:
    """Rank -> (model state, peak of model state + activations) of each measured iteration that reported them."""
    out: Dict[int, List[Tuple[int, int]]] = {}
    for match in LINE_RE.finditer(text):
        if match.group(5) is not None:
            out.setdefault(int(match.group(1)), []).append((int(match.group(5)), int(match.group(6))))
    return out


def memory_per_rank(text: str, world: int) -> Tuple[Optional[List[Optional[int]]], Optional[List[Optional[int]]]]:
    """(model state, peak of state + activations) of each rank 0..world-1, each the largest over the run's
    iterations (the optimizer state exists from the first step on); (None, None) when no rank reported them."""
    memory = parse_memory(text)
    if not memory:
        return None, None
    state = [max(s for s, _ in memory[r]) if memory.get(r) else None for r in range(world)]
    total = [max(t for _, t in memory[r]) if memory.get(r) else None for r in range(world)]
    return state, total


def peak_per_rank(text: str, world: int) -> Optional[List[Optional[int]]]:
    """Largest peak of each rank 0..world-1 over the run (None for a rank that reported nothing;
    None overall when no rank reported)."""
    peaks = parse_activation_peaks(text)
    if not peaks:
        return None
    return [max(peaks[r]) if peaks.get(r) else None for r in range(world)]
