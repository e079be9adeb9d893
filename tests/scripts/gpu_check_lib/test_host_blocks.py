"""gpu_check_lib/host_blocks.py: a plan with host placement reserves its pool before the first call and allocates no
block late; a plan whose blocks are too small for what the forwards save fails the check. The check passing, with the
same facts: tests/scripts/test_gpu_check.py."""
from __future__ import annotations

import textwrap

from .child import printed, run_child

_RUN = """
    import json
    from gpu_check_lib import common, host_blocks
    device = common.setup(cpu_only=True)
    result = host_blocks.check_host_blocks(device)
    print("result", json.dumps({k: v for k, v in result.items() if k != "run"}, default=str))
"""


def test_blocks_smaller_than_the_forwards_save_fail_the_check():
    """A plan whose blocks are half the size (the activation model priced the chunk-micro-batches low) makes every
    OFFLOAD allocate a block of its own inside the iteration: the check must fail on it."""
    proc = run_child(textwrap.dedent("""
        from gpu_check_lib import host_blocks
        planned = host_blocks.planned_blocks
        host_blocks.planned_blocks = lambda *a, **k: {key: size // 2 for key, size in planned(*a, **k).items()}
    """) + textwrap.dedent(_RUN), timeout=300)
    result = printed(proc)
    assert result["status"] == "fail" and not result["no_late_allocation"], result
    assert any(r["late_allocations"] > 0 for r in result["ranks"])
