"""gpu_check_lib/meter_offload.py: the meter under host placement is compared with the plan's prediction, and the
comparison fails when the device keeps counting what host placement moved out."""
from __future__ import annotations


from .child import printed, run_child



def test_meter_under_host_placement_meets_the_plan_on_every_rank():
    """Every placement kind on both ranks, the ranks taking turns: losses and gradients as the whole model's, each
    rank's measured device and host peaks within the tolerance of the simulator's, the pinned blocks as planned."""
    proc = run_child("""
        import json
        from gpu_check_lib import common, meter_offload
        device = common.setup(cpu_only=True)
        result = meter_offload.check_meter_offload(device)
        print("result", json.dumps({k: v for k, v in result.items() if k != "run"}, default=str))
        print("run", json.dumps({k: result["run"].get(k) for k in ("status", "max_rel_grad_diff", "host_placed")}))
    """, timeout=300)
    result = printed(proc)
    assert result["status"] == "pass" and result["meter"] == "saved-tensors", result
    assert len(result["ranks"]) == 2
    for rank in result["ranks"]:
        assert rank["predicted_host_peak"] > 0 and rank["measured_host_peak"] > 0
        for ratio in (rank["device_ratio"], rank["host_ratio"]):
            assert abs(ratio - 1) <= result["tolerance"], rank


def test_meter_offload_check_fails_when_offloaded_bytes_stay_counted_on_the_device():
    """A meter that is never told what OFFLOAD moved (the bytes stay device bytes, as for tensors an offload copies
    but cannot free) measures a device peak above the plan's: the check must fail on the device peak."""
    proc = run_child("""
        import json
        from gpu_check_lib import common, meter_offload
        from megatron_pipemesh.runtime import memory
        device = common.setup(cpu_only=True)
        for meter in (memory.SavedTensorMeter, memory.AllocatorMeter):
            meter.offloaded = lambda self, key, storages: None
        result = meter_offload.check_meter_offload(device)
        print("result", json.dumps({k: v for k, v in result.items() if k != "run"}, default=str))
    """, timeout=300)
    result = printed(proc)
    assert result["status"] == "fail" and not result["peaks_within_tolerance"], result
    assert all(rank["device_ratio"] > 1 + result["tolerance"] for rank in result["ranks"]), result
