"""Pipeline-aware recomputation in the PipeMesh runtime (CPU, gloo, PP=2, VP=2, m=8, groups 6 2 / 4 4).

A recompute plan mixing 'none', 'selective' and 'full' across ranks, chunks and micro-batches must
leave losses and every gradient equal to the run without recomputation (max relative difference
<= 1e-6), lower the measured activation peak, order a chunk's saved bytes none > selective > full,
and restore Megatron's recompute switches afterwards. One torchrun launch runs every case.
"""
import pytest
import torch

from megatron_pipemesh.runtime import PipeMeshSchedule
from megatron_pipemesh.schedule.plan import RunPlan
from tests import megatron_harness as h

TOL = 1e-6
RUNS = ["plain", "measured", "mixed", "full"]


@pytest.fixture(scope="module")
def runs():
    return h.run_worker("tests.runtime.workers:recompute_runs", nproc=2, kwargs={"runs": RUNS})


def _flat(losses):
    return [value for pair in losses for value in pair]


def _merged(runs, name):
    return h.merge_rank_results([r[name] for r in runs])


@pytest.mark.parametrize("name", RUNS[1:])
def test_recompute_and_meter_leave_losses_and_grads_unchanged(runs, name):
    """Each recompute plan and the meter leave losses and gradients equal to the plain run's."""
    plain, got = _merged(runs, "plain"), _merged(runs, name)
    assert plain["losses"]
    assert _flat(got["losses"]) == pytest.approx(_flat(plain["losses"]), rel=TOL, abs=0)
    diffs = h.compare_grads(got["grads"], plain["grads"])
    assert max(diffs.values()) <= TOL, max(diffs.items(), key=lambda kv: kv[1])


def test_mixed_plan_mixes_every_level_on_every_rank_and_chunk(runs):
    """The 'mixed' test plan holds all three levels on every rank and chunk."""
    plan = runs[0]["mixed"]["plan"]
    for rank in range(2):
        for chunk in range(2):
            levels = {plan.get((rank, chunk, j), "none") for j in range(8)}
            assert levels == {"none", "selective", "full"}, (rank, chunk, levels)


def test_recompute_lowers_measured_peak(runs):
    """The measured peak falls from none to mixed to full; without the meter nothing is measured."""
    for r in runs:
        assert r["measured"]["source"] == "saved-tensors"
        none, mixed, full = r["measured"]["peak"], r["mixed"]["peak"], r["full"]["peak"]
        assert none > mixed > full > 0, (r["mixed"]["rank"], none, mixed, full)
        assert r["measured"]["summary"]["peak_activation_bytes"] == none
        assert r["plain"]["peak"] == 0 and r["plain"]["saved"] == {}


def test_saved_bytes_order_none_selective_full_per_chunk(runs):
    """Per chunk, saved bytes fall none > selective > full; unplanned micro-batches save what a plain run saves."""
    for r in runs:
        plan, saved = r["mixed"]["plan"], r["mixed"]["saved"]
        assert len(saved) == 16
        for chunk in range(2):
            by_level = {}
            for j in range(8):
                by_level.setdefault(plan.get((r["mixed"]["pp_rank"], chunk, j), "none"), set()).add(saved[(chunk, j)])
            # Every micro-batch of a chunk has the same shape: one value per level.
            assert all(len(v) == 1 for v in by_level.values()), by_level
            none, selective, full = (by_level[level].pop() for level in ("none", "selective", "full"))
            assert none > selective > full > 0, (r["mixed"]["rank"], chunk, none, selective, full)
            keep = [j for j in range(8) if (r["mixed"]["pp_rank"], chunk, j) not in plan]
            assert saved[(chunk, keep[0])] == r["measured"]["saved"][(chunk, keep[0])]  # 'none' both times


def test_recompute_switches_restored(runs):
    """After the runs the model's recompute settings are back to their originals."""
    for r in runs:
        restored = r["restored"]
        assert restored["granularity"] is None and restored["method"] is None and restored["num_layers"] is None
        assert restored["attention"] and not any(restored["attention"])


def test_plan_levels_checked_up_front():
    """Unknown levels and malformed keys in a recompute plan are rejected when the schedule is built."""
    with pytest.raises(ValueError, match="unknown level 'partial'"):
        PipeMeshSchedule(RunPlan(placement={(0, 0, 0): "partial"}))
    with pytest.raises(ValueError, match="not \\(pipeline rank, chunk, micro-batch\\)"):
        PipeMeshSchedule(RunPlan(placement={(0, 0): "full"}))


def test_unsupported_configurations_raise_clearly():
    """Unknown levels, FP8/FP4 and CUDA graphs raise clear errors; a global --recompute-modules set no longer does."""
    import types

    from megatron_pipemesh.integration.bootstrap import prepare_megatron_import

    prepare_megatron_import()
    from megatron_pipemesh.runtime.recompute import recompute_scope

    def chunk(**config):
        base = dict(fp8=None, fp4=None, enable_cuda_graph=False, cuda_graph_impl="none", cpu_offloading=False,
                    recompute_granularity=None, recompute_modules=None, recompute_method=None,
                    recompute_num_layers=None)
        base.update(config)
        module = torch.nn.Module()
        module.config = types.SimpleNamespace(**base)
        wrapper = torch.nn.Module()
        wrapper.module = module  # like DDP / Float16Module
        return wrapper

    with pytest.raises(ValueError, match="unknown recompute level"):
        with recompute_scope(chunk(), "some"):
            pass
    with pytest.raises(NotImplementedError, match="FP8/FP4"):
        with recompute_scope(chunk(fp8="e4m3"), "selective"):
            pass
    with pytest.raises(NotImplementedError, match="CUDA graphs"):
        with recompute_scope(chunk(cuda_graph_impl="local"), "full"):
            pass
    # A global --recompute-modules set is overridden per op and restored (module-set levels manage every switch).
    with recompute_scope(chunk(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]), "none"):
        pass
