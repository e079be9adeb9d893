"""Worker for tests/runtime/test_recompute_modules.py: per-op ``--recompute-modules`` sets."""
from __future__ import annotations

from tests import megatron_harness as h
from tests.runtime.workers import make_pipemesh

MODULE_LEVELS = ("none", "selective:core_attn+mlp", "selective:mlp", "selective", "full")


def module_set_runs(pp: int = 2, vp: int = 2, microbatches: int = 8):
    """PipeMesh (groups 6 2 / 4 4) without a plan, then with a plan cycling through the module-set
    levels per (rank, chunk, micro-batch), on a model without linear biases (the mlp level needs
    --disable-bias-linear in megatron-core 0.19.2). Returns losses, grads, saved bytes per
    chunk-micro-batch and the layer switches after the runs."""
    h.init_parallel(pp=pp, vp=vp)
    spec = h.TinyGPT(num_layers=pp * vp)
    config = h.make_config(spec, add_bias_linear=False)
    model = h.build_model(spec, config=config)
    keys = [(r, c, j) for r in range(pp) for c in range(vp) for j in range(microbatches)]
    plan = {(r, c, j): MODULE_LEVELS[(r + 2 * c + j) % len(MODULE_LEVELS)] for r, c, j in keys}
    out = {}
    for name, recompute in (("plain", None), ("modules", plan)):
        schedule = make_pipemesh((6, 2), (4, 4), recompute=recompute, measure_memory=True)
        result = h.run_schedule(schedule, model, spec, microbatches)
        result.update(saved=dict(schedule.last_stats.saved_bytes), plan=recompute)
        out[name] = result
    layers = [m for chunk in model for m in chunk.modules() if hasattr(m, "recompute_mlp")]
    out["switches"] = [(m.recompute_mlp, m.recompute_input_layernorm, m.recompute_pre_mlp_layernorm) for m in layers]
    return out
