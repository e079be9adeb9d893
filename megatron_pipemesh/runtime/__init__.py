"""Runtime: executes lowered PipeMesh programs inside Megatron (the only layer touching processes/devices)."""
from .executor import PipeMeshOptions, PipeMeshRuntimeError, PipeMeshSchedule
from .memory import make_memory_meter
from .recompute import recompute_scope
from .stats import RuntimeStats

__all__ = ["PipeMeshOptions", "PipeMeshRuntimeError", "PipeMeshSchedule", "RuntimeStats", "make_memory_meter",
           "recompute_scope"]
