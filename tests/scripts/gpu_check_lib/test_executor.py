"""gpu_check_lib/executor.py: the executor checks compare against the whole model, and the no-caching check runs the
host check in a child process."""
from __future__ import annotations

import json

from .child import run_child


def test_no_caching_check_runs_the_host_check_in_a_child(tmp_path):
    """The child process of executor_no_caching (here on CPU, where the variable changes nothing) runs
    executor_host alone and its record comes back with the environment it ran under."""
    proc = run_child(f"""
        import time, json
        from pathlib import Path
        from gpu_check_lib import executor
        result = executor.check_no_caching(Path({str(tmp_path)!r}), time.monotonic() + 300)
        print("result", json.dumps({{"status": result["status"], "env": result.get("env"),
                                     "host_placed": result.get("host_placed")}}))
    """, timeout=400)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("result ")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(line[len("result "):])
    assert result["status"] == "pass" and result["env"] == "PYTORCH_NO_CUDA_MEMORY_CACHING=1"
    assert all(n > 0 for n in result["host_placed"])


def test_executor_check_fails_when_a_transfer_corrupts_data():
    """The executor check compares against the whole model: a loopback that alters received activations fails it."""
    proc = run_child("""
        import torch
        from gpu_check_lib import common, executor
        from megatron_pipemesh.runtime.loopback import LoopbackWorld
        device = common.setup(cpu_only=True)
        post = LoopbackWorld._post
        def corrupting(self, kind, tensor, key):
            if kind == "send" and key[0][0] == "F":  # activations arrive 0.1% off
                tensor = tensor * 1.001
            return post(self, kind, tensor, key)
        LoopbackWorld._post = corrupting
        print("status", executor.run_pipeline(device, "nccl")["status"])
    """, timeout=300)
    assert "status fail" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
