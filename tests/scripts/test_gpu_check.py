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
    Megatron's default path on gloo, meter vs model within 10%, recompute switches), the GPU-only checks are
    skipped with "skipped: needs CUDA", and the printed JSON is the file."""
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
    # The checks that would catch the GPU path's defects are named; the CUDA-only ones say so, never pass.
    for name in ("executor_delayed_copies", "executor_no_caching", "host_link", "timing"):
        assert checks[name]["status"] == "skip" and checks[name]["reason"].startswith("skipped: needs CUDA"), name
    megatron = checks["megatron_path"]
    assert megatron["status"] == "pass" and megatron["backend"] == "gloo" and megatron["dtype"] == "bf16"
    assert megatron["cuda_only_parts"].startswith("skipped: needs CUDA")
    runs = megatron["runs"]
    assert runs["host_zero"]["sharding"] == ["optim_grads_params", "optim_grads"]
    assert runs["host_zero"]["overlap_param_gather_with_optimizer_step"] and runs["host"]["host_placed"] > 0
    assert megatron["zero3_host_moves_activations_only"] and megatron["first_iteration_max_rel_loss_diff"] == 0.0
    assert checks["meter"]["temporaries_excluded"].startswith("skipped: needs CUDA")
    assert summary["seconds"] < 480


def test_bench_is_skipped_unless_asked(tmp_path):
    """Without --bench the 8-rank benchmark does not run (it could take the whole budget); --only runs one check."""
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu-only", "--only", "bench,recompute", "--out",
                           str(tmp_path / "summary.json")], cwd=str(REPO), env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    checks = json.loads(proc.stdout)["checks"]
    assert set(checks) == {"bench", "recompute"} and checks["bench"]["reason"] == "--bench skip"


def test_megatron_path_check_fails_when_saved_parameters_reach_the_backward_as_copies():
    """The defect the GPU path had with host placement: default saved-tensor hooks around a forward hand
    Megatron's fused-wgrad backward a copy of each saved weight, and DDP's overlap hook asserts on the missing
    param.grad. Injected here around every forward, the megatron_path check must fail and say so."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO / 'scripts')!r})
        import gpu_check, torch
        from megatron_pipemesh.runtime import executor
        device = gpu_check.setup(cpu_only=True)
        forward_step = executor._Run._forward_step
        def copying(self, *args, **kwargs):
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach(), lambda t: t):
                return forward_step(self, *args, **kwargs)
        executor._Run._forward_step = copying
        result = gpu_check.check_megatron_path(device, "gloo", timeout_s=10.0)
        print("status", result["status"])
        print("errors", [run["errors"] for run in result["runs"].values()])
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(REPO), env=_env(), capture_output=True, text=True,
                          timeout=400)
    assert "status fail" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "param.grad being None is not safe when overlap_grad_reduce is True" in proc.stdout, proc.stdout[-2000:]


def test_no_caching_check_runs_the_host_check_in_a_child(tmp_path):
    """The child process of executor_no_caching (here on CPU, where the variable changes nothing) runs
    executor_host alone and its record comes back with the environment it ran under."""
    code = textwrap.dedent(f"""
        import sys, time, json
        from pathlib import Path
        sys.path.insert(0, {str(REPO / 'scripts')!r})
        import gpu_check
        result = gpu_check.check_no_caching(Path({str(tmp_path)!r}), time.monotonic() + 300)
        print("result", json.dumps({{"status": result["status"], "env": result.get("env"),
                                     "host_placed": result.get("host_placed")}}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(REPO), env=_env(), capture_output=True, text=True,
                          timeout=400)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("result ")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(line[len("result "):])
    assert result["status"] == "pass" and result["env"] == "PYTORCH_NO_CUDA_MEMORY_CACHING=1"
    assert all(n > 0 for n in result["host_placed"])


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
