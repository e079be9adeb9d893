"""gpu_check_lib/meter_offload.py: the meter under host placement is compared with the plan's prediction, and the
comparison fails when the device keeps counting what host placement moved out. The check passing, with the same
facts: tests/scripts/test_gpu_check.py."""
from __future__ import annotations


from .child import printed, run_child


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
