"""gpu_check_lib/megatron_path.py: the check fails when host placement hands Megatron's fused-wgrad backward a copy
of a saved Parameter."""
from __future__ import annotations

from .child import run_child


def test_megatron_path_check_fails_when_saved_parameters_reach_the_backward_as_copies():
    """The defect the GPU path had with host placement: default saved-tensor hooks around a forward hand
    Megatron's fused-wgrad backward a copy of each saved weight, and DDP's overlap hook asserts on the missing
    param.grad. Injected here around every forward, the megatron_path check must fail and say so."""
    proc = run_child("""
        import torch
        from gpu_check_lib import common, megatron_path
        from megatron_pipemesh.runtime import executor
        device = common.setup(cpu_only=True)
        forward_step = executor._Run._forward_step
        def copying(self, *args, **kwargs):
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach(), lambda t: t):
                return forward_step(self, *args, **kwargs)
        executor._Run._forward_step = copying
        result = megatron_path.check_megatron_path(device, "gloo", timeout_s=10.0)
        print("status", result["status"])
        print("errors", [run["errors"] for run in result["runs"].values()])
    """, timeout=400)
    assert "status fail" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "param.grad being None is not safe when overlap_grad_reduce is True" in proc.stdout, proc.stdout[-2000:]
