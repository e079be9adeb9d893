"""CPU layer item 11: Megatron's distributed optimizer on CPU (gloo).

* ``DistributedOptimizer.__init__`` sees CUDA tensor type names for CPU tensors, and only there;
* nothing is patched when CUDA is available;
* on 2 data-parallel ranks it trains exactly like plain Adam and holds half the optimizer state.
"""
import pytest

from tests import megatron_harness as h
from tests.integration.test_cpu_compat import _run


def test_cuda_type_names_only_inside_distributed_optimizer():
    """Inside the scoped mode CPU tensors report torch.cuda.* names; outside and for conversions nothing changes."""
    res = _run("""
        import json, torch
        from megatron_pipemesh.integration.cpu_compat import apply_cpu_compat, _CudaTypeNameMode
        assert apply_cpu_compat()
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
        p = torch.nn.Parameter(torch.zeros(4))
        with _CudaTypeNameMode():
            inside = [p.type(), p.view(-1)[1:3].type(), torch.zeros(1, dtype=torch.bfloat16).type(),
                      torch.zeros(1, dtype=torch.float16).type(), str(p.type(torch.float64).dtype)]
        print(json.dumps({"inside": inside, "outside": p.type(),
                          "wrapped": hasattr(DistributedOptimizer.__init__, "__wrapped__")}))
    """)
    assert res == {"inside": ["torch.cuda.FloatTensor", "torch.cuda.FloatTensor", "torch.cuda.BFloat16Tensor",
                              "torch.cuda.HalfTensor", "torch.float64"],
                   "outside": "torch.FloatTensor", "wrapped": True}


def test_distributed_optimizer_untouched_when_cuda_available():
    """With CUDA, apply_cpu_compat leaves DistributedOptimizer as upstream wrote it."""
    res = _run("""
        import json, torch
        torch.cuda.is_available = lambda: True
        from megatron_pipemesh.integration.bootstrap import prepare_megatron_import
        from megatron_pipemesh.integration.cpu_compat import apply_cpu_compat
        prepare_megatron_import()
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
        before = DistributedOptimizer.__init__
        print(json.dumps({"ret": apply_cpu_compat(), "same": DistributedOptimizer.__init__ is before}))
    """)
    assert res == {"ret": False, "same": True}


def test_distributed_optimizer_trains_like_adam_with_sharded_state():
    """DP=2: same losses and grad norms as plain Adam over 3 steps; optimizer state split in two, params/grads whole."""
    runs = {"adam": {"schedule": "stock", "distopt": False}, "distopt": {"schedule": "stock", "distopt": True}}
    results = h.run_worker("tests.runtime.param_sync_workers:train_runs", nproc=2, timeout=180,
                           kwargs={"runs": runs, "pp": 1, "vp": None, "dp": 2, "microbatches": 4, "num_layers": 2})
    for rank in results:
        assert rank["distopt"]["grad_norms"] == pytest.approx(rank["adam"]["grad_norms"], rel=1e-6)
        flat = [[v for it in run for pair in it for v in pair] for run in (rank["distopt"]["losses"], rank["adam"]["losses"])]
        assert flat[0] == pytest.approx(flat[1], rel=1e-6)
        sharded, whole = rank["distopt"]["bytes"], rank["adam"]["bytes"]
        for kind in ("params", "grads"):  # full copies on every rank (buffers padded to the DP size)
            assert whole[kind] <= sharded[kind] <= 1.01 * whole[kind]
        assert 0.49 * whole["optimizer"] <= sharded["optimizer"] <= 0.51 * whole["optimizer"]
    assert results[0]["adam"]["losses"] != results[1]["adam"]["losses"], "each replica must see its own data"
    total = sum(rank["distopt"]["bytes"]["optimizer"] for rank in results)
    assert abs(total - results[0]["adam"]["bytes"]["optimizer"]) <= 0.01 * total
