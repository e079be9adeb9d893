"""Per chunk-micro-batch ``--recompute-modules`` sets in the PipeMesh runtime (runtime/recompute.py):
'selective:<m1>+<m2>' levels mixed with none / selective / full across ops keep losses and
gradients equal to the run without recomputation (CPU, gloo, PP=2, VP=2, m=8), save fewer bytes
where they recompute, and restore Megatron's layer switches; the two megatron-core 0.19.2 defects
are refused with a clear error before any work."""
import types

import pytest
import torch

from megatron_pipemesh.runtime import PipeMeshSchedule
from megatron_pipemesh.schedule.plan import RunPlan
from tests import megatron_harness as h

TOL = 1e-6


@pytest.fixture(scope="module")
def runs():
    return h.run_worker("tests.runtime.module_set_workers:module_set_runs", nproc=2)


def test_module_set_levels_leave_losses_and_grads_unchanged(runs):
    """A module-set level that changes numerics (wrong switch, or recomputation with another RNG state)."""
    plain, got = (h.merge_rank_results([r[name] for r in runs]) for name in ("plain", "modules"))
    flat = lambda losses: [v for pair in losses for v in pair]  # noqa: E731
    assert plain["losses"] and flat(got["losses"]) == pytest.approx(flat(plain["losses"]), rel=TOL, abs=0)
    diffs = h.compare_grads(got["grads"], plain["grads"])
    assert max(diffs.values()) <= TOL, max(diffs.items(), key=lambda kv: kv[1])


def test_module_sets_save_less_and_switches_are_restored(runs):
    """A level that is not applied (saved bytes unchanged), or switches left on after the scope."""
    for r in runs:
        plan, saved, pp_rank = r["modules"]["plan"], r["modules"]["saved"], r["modules"]["pp_rank"]
        by_level = {}
        for (rank, c, j), level in plan.items():
            if rank == pp_rank:
                by_level.setdefault((c, level), set()).add(saved[(c, j)])
        assert all(len(v) == 1 for v in by_level.values()), by_level  # same shapes: one value per level
        for chunk in range(2):
            none = by_level[(chunk, "none")].pop()
            assert by_level[(chunk, "selective:mlp")].pop() < none
            assert by_level[(chunk, "selective:core_attn+mlp")].pop() < by_level[(chunk, "selective")].pop() < none
        assert r["switches"] and not any(any(s) for s in r["switches"])


def _fake_chunk(layer=None, **config):
    base = dict(fp8=None, fp4=None, enable_cuda_graph=False, cuda_graph_impl="none", cpu_offloading=False,
                recompute_granularity=None, recompute_modules=None, recompute_method=None, recompute_num_layers=None)
    base.update(config)
    module = torch.nn.Module()
    module.config = types.SimpleNamespace(**base)
    if layer is not None:
        module.layer = layer
    return module


def test_module_set_levels_checked_and_defects_refused():
    """Bad module-set names accepted, or the layernorm (no TE) / biased-mlp defects reaching the backward."""
    from megatron_pipemesh.integration.bootstrap import prepare_megatron_import

    prepare_megatron_import()
    from megatron_pipemesh.runtime.recompute import parse_runtime_level, recompute_scope

    assert parse_runtime_level("selective:core_attn+mlp") == ("selective", frozenset({"core_attn", "mlp"}))
    PipeMeshSchedule(RunPlan(placement={(0, 0, 0): "selective:mlp", (0, 0, 1): "selective:layernorm+mlp"}))
    for bad in ("selective:attn", "block:2", "selective:"):
        with pytest.raises(ValueError, match="unknown level"):
            PipeMeshSchedule(RunPlan(placement={(0, 0, 0): bad}))
    with pytest.raises(NotImplementedError, match="Transformer Engine.*random.py:740"):
        with recompute_scope(_fake_chunk(), "selective:core_attn+layernorm"):
            pass
    layer = torch.nn.Module()
    layer.recompute_mlp = layer.recompute_input_layernorm = layer.recompute_pre_mlp_layernorm = False
    layer.mlp = torch.nn.Module()
    layer.mlp.linear_fc2 = torch.nn.Linear(2, 2)
    layer.mlp.linear_fc2.skip_bias_add = True
    with pytest.raises(NotImplementedError, match="disable-bias-linear"):
        with recompute_scope(_fake_chunk(layer), "selective:mlp"):
            pass
    with recompute_scope(_fake_chunk(layer), "selective"):  # the bias only matters to the mlp module
        pass
