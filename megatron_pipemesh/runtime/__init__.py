"""Runtime: executes lowered PipeMesh programs inside Megatron (the only layer touching processes/devices)."""
from .executor import PipeMeshOptions, PipeMeshRuntimeError, PipeMeshSchedule
from .stats import RuntimeStats

__all__ = ["PipeMeshOptions", "PipeMeshRuntimeError", "PipeMeshSchedule", "RuntimeStats"]
