"""The plan's reload lookahead reaches the lowering the runtime runs and the plan line's digest."""
import json
from types import SimpleNamespace

import pytest

from megatron_pipemesh.integration.auto_plan import load_plan
from megatron_pipemesh.integration.report import megatron_syncs
from megatron_pipemesh.schedule import ScheduleConfig, lower
from megatron_pipemesh.schedule.plan import RunPlan

CONFIG = ScheduleConfig(2, 2, 8, (6, 2), (4, 4))
PLAN = {(0, 0, 0): "host", (1, 1, 2): "host", (0, 1, 3): "full"}


def _plan_file(tmp_path, **extra):
    path = tmp_path / "plan.json"
    entries = [{"rank": r, "chunk": c, "microbatch": j, "level": level} for (r, c, j), level in PLAN.items()]
    path.write_text(json.dumps({"pp": 2, "vpp": 2, "microbatches": 8, "forward_groups": [6, 2],
                                "backward_groups": [4, 4], "recompute": entries, **extra}))
    return str(path)


def test_plan_file_carries_reload_lookahead(tmp_path):
    """A saved plan's reload_lookahead is used (a plan simulated with 5 and lowered with 2 would not hold)."""
    resolved = load_plan(_plan_file(tmp_path, reload_lookahead=5), 2, 2, 8)
    assert resolved.reload_lookahead == 5
    assert load_plan(_plan_file(tmp_path), 2, 2, 8).reload_lookahead == 2  # older plan files: the default
    with pytest.raises(ValueError, match="reload_lookahead 0 must be an integer >= 1"):
        load_plan(_plan_file(tmp_path, reload_lookahead=0), 2, 2, 8)


def test_runtime_and_start_up_lowering_use_it():
    """The runtime's lowering and the start-up digest both lower with the plan's lookahead (one rule)."""
    plan = RunPlan(CONFIG, PLAN, reload_lookahead=5)
    assert plan.lowering(param_sync=False, grad_sync=False).reload_lookahead == 5
    assert RunPlan(CONFIG, PLAN).lowering(param_sync=False, grad_sync=False).reload_lookahead == 2
    args = SimpleNamespace()
    five = lower(CONFIG, plan.lowering(**megatron_syncs(args)))
    two = lower(CONFIG, RunPlan(CONFIG, PLAN).lowering(**megatron_syncs(args)))
    assert five.digest() != two.digest()
    program = five.programs[0]
    between = program[program.index(next(op for op in program if str(op) == "RELOAD0.0")):program.index(
        next(op for op in program if str(op) == "B0.0"))]
    assert sum(op.kind.is_compute for op in between) == 5
