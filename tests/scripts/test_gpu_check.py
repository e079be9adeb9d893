"""scripts/gpu_check.sh --cpu-only: its checks pass here and print a JSON summary naming them (each check's own
failure modes: tests/scripts/gpu_check_lib/)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from .helpers import REPO


def _env():
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("OUT", None)
    return env


def _check_names():
    """``CHECKS`` of scripts/gpu_check.py, read from its source (importing it would set up its checks' package)."""
    import ast

    tree = ast.parse((REPO / "scripts" / "gpu_check.py").read_text())
    assigned = next(node for node in tree.body if isinstance(node, ast.Assign)
                    and getattr(node.targets[0], "id", None) == "CHECKS")
    return ast.literal_eval(assigned.value)


def test_cpu_only_mode_passes_and_prints_its_summary(tmp_path):
    """Every CPU check passes (executor for every rank role under both wait policies, with host placement too,
    Megatron's default path on gloo, ZeRO-2 with several backward groups, meter vs model within 10%, also under host
    placement against the plan, recompute switches), the GPU-only checks are skipped with "skipped: needs CUDA", and
    the printed JSON is the file."""
    out = tmp_path / "summary.json"
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu-only", "--bench", "skip", "--out", str(out)],
                          cwd=str(REPO), env=_env(), capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert json.loads(proc.stdout) == summary and summary["no_failures"] and summary["mode"] == "cpu-only"
    checks = summary["checks"]
    assert set(checks) == set(_check_names()) and len(checks) >= 15  # on CPU every check reports, run or skipped
    # Passed, skipped and failed are listed apart; a skip checked nothing and is never counted as a pass.
    skipped = summary["skipped"]
    assert summary["failed"] == [] and set(summary["passed"]) | set(skipped) == set(checks)
    assert not set(summary["passed"]) & set(skipped) and not summary["all_passed"] and summary["complete"]
    assert summary["counts"] == {"passed": len(summary["passed"]), "skipped": len(skipped), "failed": 0, "not_run": 0,
                                 "total": len(checks)}
    assert all(skipped[name] == checks[name]["reason"] for name in skipped)
    assert f"{len(summary['passed'])} passed, {len(skipped)} skipped (not passed), 0 failed" in proc.stderr
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
    # The checks the second reading of the GPU path asked for: the last stage's last chunk host-placed (Megatron's
    # own output layer), the meter under host placement held to the plan, ZeRO-2 with several backward groups.
    assert runs["host"]["host_placed_last_stage"] > 0 and megatron["last_stage_host_placed"]
    offload = checks["meter_offload"]
    assert offload["status"] == "pass" and offload["peaks_within_tolerance"] and len(offload["ranks"]) == 2
    zero2 = checks["zero2_backward_groups"]
    assert zero2["status"] == "pass" and zero2["sharding"] == ["optim_grads", "optim_grads"]
    assert len(zero2["backward_groups"]) > 2 and zero2["reduces_as_planned"] and zero2["reduce_scatters_waited"]
    late = zero2["late_reduce_scatters"]  # every reduce-scatter completed late, and was waited for
    assert late["launched"] == late["waited"] > 0
    # The third reading's checks: a plan with host_blocks allocates no pinned block late, the profile measures
    # every piece (its allocator-against-meter part needs CUDA).
    blocks = checks["host_blocks"]
    assert blocks["status"] == "pass" and blocks["no_late_allocation"] and blocks["pool_reserved_as_planned"]
    assert all(r["late_allocations"] == 0 and r["pool_bytes"] > 0 for r in blocks["ranks"])
    assert zero2["first_iteration_rel_grad_norm_diff"] <= 1e-5 and zero2["first_iteration_max_rel_loss_diff"] == 0.0
    for rank in zero2["ranks"]:
        assert rank["reduce_ops"] == rank["planned_reduce_ops"] == 18 and 0 < rank["reduce_waits"] <= rank["reduce_ops"]
    assert offload["meter"] == "saved-tensors"
    for rank in offload["ranks"]:
        assert rank["predicted_host_peak"] > 0 and rank["measured_host_peak"] > 0
        assert all(abs(ratio - 1) <= offload["tolerance"] for ratio in (rank["device_ratio"], rank["host_ratio"])), rank
    profile = checks["profile"]
    assert profile["status"] == "pass" and profile["unmeasured"] == [] and profile["micro_batch_sizes"] == [1, 2]
    assert profile["kept_bytes_against_meter"].startswith("skipped: needs CUDA")
    assert summary["seconds"] < 480


def test_bench_is_skipped_unless_asked(tmp_path):
    """Without --bench the 8-rank benchmark does not run (it could take the whole budget); --only runs one check."""
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu-only", "--only", "bench,recompute", "--out",
                           str(tmp_path / "summary.json")], cwd=str(REPO), env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    checks = json.loads(proc.stdout)["checks"]
    assert set(checks) == {"bench", "recompute"} and checks["bench"]["reason"] == "--bench skip"


def test_only_names_the_checks_when_given_an_unknown_one(tmp_path):
    """A misspelt --only name is refused (exit 2) with the list of checks, not a run that checks nothing."""
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu-only", "--only", "meter,meter_ofload", "--out",
                           str(tmp_path / "summary.json")], cwd=str(REPO), env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "no check named meter_ofload" in proc.stderr and "meter_offload" in proc.stderr.split("the checks are")[1]
    assert not (tmp_path / "summary.json").exists()


def test_the_summary_is_written_after_every_check_and_a_stopped_run_keeps_it(tmp_path):
    """The summary file is rewritten as each check starts and ends: a run stopped while a check hangs (the shell's
    timeout sends SIGTERM) leaves the checks done so far, names the one it stopped in, and exits 124."""
    import signal
    import time

    out = tmp_path / "summary.json"
    code = ("import sys, time; sys.path.insert(0, 'scripts'); import gpu_check; "
            "gpu_check.check_recompute = lambda device: time.sleep(600); "
            f"sys.exit(gpu_check.main(['--cpu-only', '--only', 'meter,recompute,timing', '--out', {str(out)!r}]))")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=str(REPO), env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if out.exists() and json.loads(out.read_text()).get("running") == "recompute":
                break
            time.sleep(0.5)
        summary = json.loads(out.read_text())
        assert summary["running"] == "recompute" and summary["passed"] == ["meter"] and not summary["complete"]
        assert summary["not_run"] == ["recompute", "timing"] and summary["counts"]["not_run"] == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 124
    finally:
        proc.kill()
    summary = json.loads(out.read_text())
    assert summary["interrupted"].endswith("during recompute") and summary["passed"] == ["meter"]
    assert not summary["no_failures"] and not summary["all_passed"]
