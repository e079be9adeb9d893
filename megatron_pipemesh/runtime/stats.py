"""Per-op timers of one executed iteration, read by benchmarks and the planner's calibration."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple


@dataclass
class OpRecord:
    step: int
    op: str
    start_s: float
    """Wall-clock start relative to the iteration start."""
    wait_s: float
    """Time spent waiting for the op's received input (compute ops) before computing."""
    compute_s: float
    """Time spent in forward_step / backward_step (0 for communication ops)."""


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
    """Peak bytes of activations held for backwards (plus runtime-held chunk outputs) during the call."""
    saved_bytes: Dict[Tuple[int, int], int] = field(default_factory=dict)
    """Bytes each (chunk, micro-batch) forward kept for its backward."""
    output_bytes: Dict[Tuple[int, int], int] = field(default_factory=dict)
    """Bytes of each (chunk, micro-batch) output the runtime held beyond its saved tensors (CPU meter)."""

    @property
    def forward_s(self) -> float:
        return sum(r.compute_s for r in self.records if r.op.startswith("F"))

    @property
    def backward_s(self) -> float:
        return sum(r.compute_s for r in self.records if r.op.startswith("B"))

    @property
    def recv_wait_s(self) -> float:
        return sum(r.wait_s for r in self.records)

    def summary(self) -> Dict[str, float]:
        return {"total_s": self.total_s, "forward_s": self.forward_s, "backward_s": self.backward_s,
                "recv_wait_s": self.recv_wait_s, "send_drain_s": self.send_drain_s, "dp_sync_s": self.dp_sync_s,
                "peak_activation_bytes": float(self.peak_activation_bytes),
                "max_saved_bytes": float(max(self.saved_bytes.values(), default=0))}
