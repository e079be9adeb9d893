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


def test_megatron_path_check_host_places_the_last_stage_where_megatron_s_own_output_layer_is():
    """With Transformer Engine, chunk 0's linears are TE's, which reach ``main_grad`` through a weakref and so survive
    a copied weight; Megatron's own fused-wgrad output layer sits in the last stage's last chunk. Injected only there
    (host placement moves that layer's saved weight like an activation, so its backward gets a copy), the defect goes
    unseen when only chunk 0 is host-placed, and the check as it is must fail on it."""
    proc = run_child("""
        from gpu_check_lib import common, megatron_path
        from megatron_pipemesh.runtime import offload
        device = common.setup(cpu_only=True)
        output_weights = []
        build = megatron_path.build_megatron_rank
        def building(device, backend, rank, *args, **kwargs):
            state = build(device, backend, rank, *args, **kwargs)
            if rank == 0:
                output_weights.clear()  # this run's model only
            output_weights.extend(p for chunk in state.chunks for name, p in chunk.named_parameters()
                                  if name.endswith("output_layer.weight"))
            return state
        megatron_path.build_megatron_rank = building
        movable = offload.ActivationOffloader._movable
        def moving_output_weight(self, tensor, keep):
            # (DDP's parameters are views of one buffer: matched by address and shape, not storage)
            if any(tensor.data_ptr() == w.data_ptr() and tensor.shape == w.shape for w in output_weights):
                return offload._storage_ptr(tensor)
            return movable(self, tensor, keep)
        offload.ActivationOffloader._movable = moving_output_weight
        placement = megatron_path.host_placement
        megatron_path.host_placement = lambda pp, vpp, m: {k: v for k, v in placement(pp, vpp, m).items() if k[1] == 0}
        chunk0 = megatron_path.check_megatron_path(device, "gloo", timeout_s=10.0)
        print("chunk 0 only: errors", [run["errors"] for run in chunk0["runs"].values()], len(chunk0["runs"]))
        megatron_path.host_placement = placement
        result = megatron_path.check_megatron_path(device, "gloo", timeout_s=10.0)
        print("status", result["status"])
        print("errors", [run["errors"] for run in result["runs"].values()])
    """, timeout=400)
    assert "chunk 0 only: errors [{}, {}, {}] 3" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "status fail" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "param.grad being None is not safe when overlap_grad_reduce is True" in proc.stdout, proc.stdout[-2000:]
