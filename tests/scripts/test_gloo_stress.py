"""scripts/gloo_stress.py (the reproducer of torch's gloo heap corruption, docs/cpu.md item 14) runs on 4 CPU ranks
with the worker threads it is given; a short run, not the stress itself (that takes minutes and may crash)."""
from __future__ import annotations

import re

from tests import megatron_harness as h

from .helpers import REPO


def test_gloo_stress_runs_its_overlapped_step_on_one_worker_thread():
    cp = h.run_torchrun([str(REPO / "scripts" / "gloo_stress.py"), "--iterations", "20", "--threads", "1"], nproc=4,
                        timeout=120)
    assert cp.returncode == 0, h.failure_excerpt(cp.stdout, 3000)
    # (the ranks share one pipe, so their lines may run together)
    assert sorted(re.findall(r"rank (\d): 20 iterations, no fault", cp.stdout)) == ["0", "1", "2", "3"]
