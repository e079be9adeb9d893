"""Pure schedule layer (no torch.distributed): config -> compute programs -> lowered programs -> validation."""
from .config import ScheduleConfig, ScheduleConfigError, check_groups, uniform_groups
from .lower import LoweredSchedule, LoweringOptions, lower
from .ops import B, F, Op, OpKind, format_ops, parse_op
from .order import backward_sequence, compute_program, compute_programs, forward_sequence, warmup
from .timeline import DeadlockError, ScheduleError, execute
from .validate import validate

__all__ = [
    "B", "DeadlockError", "F", "LoweredSchedule", "LoweringOptions", "Op", "OpKind", "ScheduleConfig",
    "ScheduleConfigError", "ScheduleError", "backward_sequence", "check_groups", "compute_program",
    "compute_programs", "execute", "format_ops", "forward_sequence", "lower", "parse_op",
    "uniform_groups", "validate", "warmup",
]
