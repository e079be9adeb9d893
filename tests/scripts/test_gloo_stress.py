"""scripts/gloo_stress.py (the reproducer of torch's gloo heap corruption, docs/cpu.md item 14) runs on 4 CPU ranks
with the worker threads it is given; a short run, not the stress itself (that takes minutes and may crash)."""
from __future__ import annotations

from tests import megatron_harness as h

from .helpers import REPO


def test_gloo_stress_runs_its_overlapped_step_on_one_worker_thread():
    cp = h.run_torchrun([str(REPO / "scripts" / "gloo_stress.py"), "--iterations", "20", "--threads", "1"], nproc=4,
                        timeout=120)
    assert cp.returncode == 0, h.failure_excerpt(cp.stdout, 3000)
    assert sorted(line.split(":")[0] for line in cp.stdout.splitlines() if "20 iterations, no fault" in line) == [
        f"rank {r}" for r in range(4)]
