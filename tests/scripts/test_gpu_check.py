"""scripts/gpu_check.sh --cpu-only: its checks pass here, print a JSON summary, and can fail."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from .helpers import REPO


def _env():
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("OUT", None)
    return env


def test_cpu_only_mode_passes_and_prints_its_summary(tmp_path):
    """Every CPU check passes (executor for every rank role under both wait policies, with host placement too,
    meter vs model within 10%, recompute switches), the GPU-only timing and host link are skipped with a reason,
    and the printed JSON is the file."""
    out = tmp_path / "summary.json"
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu-only", "--bench", "skip", "--out", str(out)],
                          cwd=str(REPO), env=_env(), capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert json.loads(proc.stdout) == summary and summary["passed"] and summary["mode"] == "cpu-only"
    checks = summary["checks"]
    for name in ("executor_nccl", "executor_gloo", "executor_host", "meter", "recompute"):
        assert checks[name]["status"] == "pass", (name, checks[name])
    host = checks["executor_host"]
    assert all(n > 0 for n in host["host_placed"]) and all(b > 0 for b in host["offloaded_bytes"])
    assert checks["host_link"]["status"] == "skip" and "GPU" in checks["host_link"]["reason"]
    assert checks["executor_nccl"]["timed_waits"] == 0 < checks["executor_nccl"]["waits"]
    assert checks["executor_gloo"]["timed_waits"] == checks["executor_gloo"]["waits"] > 0
    assert checks["timing"]["status"] == "skip" and "GPU" in checks["timing"]["reason"]
    assert checks["bench"]["status"] == "skip"


def test_executor_check_fails_when_a_transfer_corrupts_data():
    """The executor check compares against the whole model: a loopback that alters received activations fails it."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO / 'scripts')!r})
        import gpu_check, torch
        from megatron_pipemesh.runtime.loopback import LoopbackWorld
        device = gpu_check.setup(cpu_only=True)
        post = LoopbackWorld._post
        def corrupting(self, kind, tensor, key):
            if kind == "send" and key[0][0] == "F":  # activations arrive 0.1% off
                tensor = tensor * 1.001
            return post(self, kind, tensor, key)
        LoopbackWorld._post = corrupting
        print("status", gpu_check.run_pipeline(device, "nccl")["status"])
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(REPO), env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert "status fail" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
