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


def test_ranks_taking_turns_never_compute_at_once_and_keep_the_results():
    """With ``one_at_a_time`` no two thread-ranks are ever inside a forward or backward step together (what lets the
    CUDA meter read the device's allocator counters as one rank's), and losses and gradients stay the whole model's."""
    proc = run_child("""
        import threading, time
        from gpu_check_lib import common, executor
        from megatron_pipemesh.runtime import executor as runtime
        device = common.setup(cpu_only=True)
        inside, overlaps, steps = set(), [], [0]
        lock = threading.Lock()
        def watched(method):
            def call(*args, **kwargs):
                name = threading.current_thread().name
                if not name.startswith("pipemesh-rank"):  # the whole-model reference run
                    return method(*args, **kwargs)
                with lock:
                    if inside:
                        overlaps.append((name, sorted(inside)))
                    inside.add(name)
                    steps[0] += 1
                try:
                    time.sleep(0.002)  # a chance for another rank to run, were it allowed to
                    return method(*args, **kwargs)
                finally:
                    with lock:
                        inside.discard(name)
            return call
        from megatron.core.pipeline_parallel import schedules
        runtime._Run._forward = watched(runtime._Run._forward)
        schedules.backward_step = watched(schedules.backward_step)
        result = executor.run_pipeline(device, "nccl", pp=2, microbatches=4, backward_groups=(2, 2),
                                       forward_groups=(4,), one_at_a_time=True)
        print("status", result["status"], "steps", steps[0], "overlaps", len(overlaps))
    """, timeout=300)
    assert "status pass steps 32 overlaps 0" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
