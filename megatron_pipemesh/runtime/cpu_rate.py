"""This process's achieved CPU matmul rate: the device rate of CPU ranks, and of ``pipemesh plan --megatron-args``
on a machine without a named GPU."""
from __future__ import annotations

import functools
import time


@functools.lru_cache(maxsize=1)
def measured_cpu_tflops(size: int = 512, repeats: int = 8) -> float:
    """Achieved fp32 matmul rate of this process's CPU threads (TFLOP/s), measured once per process."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    start = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    return 2 * size ** 3 * repeats / (time.perf_counter() - start) / 1e12
