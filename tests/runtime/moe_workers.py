"""Worker functions of tests/runtime/test_moe.py, run on every rank through tests/megatron_harness.py."""
from __future__ import annotations

from typing import Dict, List, Optional

from tests import megatron_harness as h
from tests.runtime.workers import make_pipemesh


def moe_stock_vs_pipemesh(pp: int, vp: int, ep: int, microbatches: int, groups: Dict[str, Optional[List[List[int]]]],
                          num_experts: int = 4, overlap_grad_reduce: bool = True):
    """A tiny mixture-of-experts GPT (top-2 of ``num_experts``, expert parallel ``ep``, Megatron DDP with its expert
    buffers reduced over the expert data-parallel group): the stock schedule, then PipeMesh with each named group
    pair, on the same weights and data (each data-parallel replica its own)."""
    h.init_parallel(pp=pp, vp=vp, ep=ep)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    spec = h.TinyGPT(num_layers=pp * vp, num_experts=num_experts)
    model = h.build_model(spec, wrap_ddp=True, overlap_grad_reduce=overlap_grad_reduce)
    results = {"stock": h.run_schedule(get_forward_backward_func(), model, spec, microbatches)}
    for name, pair in groups.items():
        schedule = make_pipemesh(*(pair or (None, None)))
        results[name] = h.run_schedule(schedule, model, spec, microbatches)
    return results
