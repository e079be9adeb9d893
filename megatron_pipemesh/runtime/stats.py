"""Per-op timers of one executed iteration, read by benchmarks and the planner's calibration.

On CPU an op's times are host wall-clock (``perf_counter``), which is when the work happens. On
CUDA the host only launches kernels, so :class:`OpClock` also records CUDA events around each op on
the current stream and the op's ``wait_s``/``compute_s`` become GPU times. The events are read
lazily (:meth:`RuntimeStats.resolve`, called by every reader), so timing adds no host
synchronisation to the iteration itself.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch


@dataclass
class OpRecord:
    step: int
    op: str
    start_s: float
    """Host wall-clock start relative to the iteration start."""
    wait_s: float
    """Time spent waiting for the op's received input (compute ops) before computing: host time on CPU,
    GPU time (the stream waiting for the transfer) on CUDA."""
    compute_s: float
    """Time spent in forward_step / backward_step (0 for communication ops): host time on CPU, GPU time
    on CUDA."""
    events: Optional[Tuple[Any, Any, Any]] = None
    """CUDA events (start, input ready, end) until :meth:`RuntimeStats.resolve` reads them; None on CPU."""


class OpClock:
    """Times one op: host ``perf_counter`` always, plus CUDA events on a CUDA device."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"

    def mark(self) -> Tuple[float, Any]:
        """(host time, CUDA event recorded on the current stream or None)."""
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        return time.perf_counter(), event


@dataclass
class RuntimeStats:
    """What one rank did in one call of the schedule."""

    rank: int
    pipeline_rank: int
    plan_digest: str
    forward_only: bool
    records: List[OpRecord] = field(default_factory=list)
    total_s: float = 0.0
    send_drain_s: float = 0.0
    """Waiting for the last sends to complete at the end."""
    dp_sync_s: float = 0.0
    """Time inside finalize_model_grads (waiting for data-parallel reductions)."""
    timed_waits: bool = True
    """Whether the waits (pipeline, data-parallel) were timed; False for a metered stock schedule, whose
    internals are Megatron's."""
    memory_source: str = ""
    """How memory was measured ('saved-tensors' on CPU, 'cuda-allocator' on CUDA); empty when not measured
    (``PipeMeshOptions.measure_memory``)."""
    peak_activation_bytes: int = 0
    """Peak device-resident bytes of activations held for backwards (plus runtime-held chunk outputs) during
    the call; activations offloaded to host memory (host placement) do not count while they are there."""
    saved_bytes: Dict[Tuple[int, int], int] = field(default_factory=dict)
    """Bytes each (chunk, micro-batch) forward kept for its backward."""
    output_bytes: Dict[Tuple[int, int], int] = field(default_factory=dict)
    """Bytes of each (chunk, micro-batch) output the runtime held beyond its saved tensors (CPU meter)."""
    peak_host_bytes: int = 0
    """Peak bytes of activations in host memory (host placement; measured with or without the meter)."""
    peak_block_bytes: int = 0
    """Peak bytes of the host blocks holding them (the real, rounded, pinned memory; the planner's
    ``peak_pinned_bytes``)."""
    offloaded_bytes: Dict[Tuple[int, int], int] = field(default_factory=dict)
    """Bytes each host-placed (chunk, micro-batch) moved to host memory (OFFLOAD)."""
    time_source: str = "host"
    """'host' (perf_counter) or 'cuda-events' (GPU times of compute ops)."""

    def resolve(self) -> "RuntimeStats":
        """Turn recorded CUDA events into seconds (waits for the last one); a no-op on CPU."""
        pending = [r for r in self.records if r.events is not None]
        if pending:
            pending[-1].events[2].synchronize()
            for record in pending:
                start, ready, end = record.events
                record.wait_s = start.elapsed_time(ready) / 1e3
                record.compute_s = ready.elapsed_time(end) / 1e3
                record.events = None
            self.time_source = "cuda-events"
        return self

    @property
    def forward_s(self) -> float:
        return sum(r.compute_s for r in self.resolve().records if r.op.startswith("F"))

    @property
    def backward_s(self) -> float:
        return sum(r.compute_s for r in self.resolve().records if r.op.startswith("B"))

    @property
    def recv_wait_s(self) -> float:
        return sum(r.wait_s for r in self.resolve().records)

    def summary(self) -> Dict[str, float]:
        return {"total_s": self.total_s, "forward_s": self.forward_s, "backward_s": self.backward_s,
                "recv_wait_s": self.recv_wait_s, "send_drain_s": self.send_drain_s, "dp_sync_s": self.dp_sync_s,
                "peak_activation_bytes": float(self.peak_activation_bytes),
                "peak_host_bytes": float(self.peak_host_bytes),
                "max_saved_bytes": float(max(self.saved_bytes.values(), default=0))}
