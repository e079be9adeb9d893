"""CUDA-event op times as the executor records them against synchronised wall time (``timing``)."""
from __future__ import annotations

import time


def check_timing(device, repeats: int = 20):
    """CUDA-event times of a compute op (as the executor records them) against synchronised wall time."""
    if device.type != "cuda":
        return {"status": "skip", "reason": "skipped: needs CUDA (CUDA events need a GPU; on CPU the executor times "
                                            "with perf_counter)"}
    import torch

    from megatron_pipemesh.runtime.stats import OpClock, OpRecord, RuntimeStats

    a = torch.randn((4096, 4096), device=device) / 64  # keeps repeated products finite
    clock, stats = OpClock(device), RuntimeStats(0, 0, "check", False)
    (a @ a).sum().item()  # cuBLAS start-up outside the measured window
    wall_start = time.perf_counter()
    launch = 0.0
    for step in range(repeats):
        start, start_event = clock.mark()
        ready, ready_event = clock.mark()
        b = a
        for _ in range(4):
            b = b @ a
        end, end_event = clock.mark()
        launch += end - ready
        stats.records.append(OpRecord(step, f"F0.{step}", start, ready - start, end - ready,
                                      (start_event, ready_event, end_event)))
    torch.cuda.synchronize(device)
    wall = time.perf_counter() - wall_start
    gpu = stats.resolve().forward_s
    ratio = gpu / wall if wall else 0.0
    return {"status": "pass" if 0.85 <= ratio <= 1.02 else "fail", "event_s": gpu, "wall_s": wall,
            "event_over_wall": ratio, "host_launch_s": launch, "time_source": stats.time_source}


