"""PipeMesh runtime vs Megatron's stock interleaved schedule on CPU (gloo), 2 and 4 ranks.

For the same weights and data, losses and every parameter gradient must match the stock schedule
(max relative difference <= 1e-6) and a single-rank reference, for depth-first, breadth-first and
elastic group lists, with and without Megatron DDP / overlapped gradient reduction, and for
forward-only evaluation.
"""
import pytest

from tests import megatron_harness as h

TOL = 1e-6


def _flat(losses):
    return [value for pair in losses for value in pair]


def _check(results, reference=None):
    merged = {name: h.merge_rank_results([r[name] for r in results]) for name in results[0]}
    stock = merged.pop("stock")
    assert stock["losses"], "the last stage reported no losses"
    for name, got in merged.items():
        assert _flat(got["losses"]) == pytest.approx(_flat(stock["losses"]), rel=TOL, abs=0), name
        if stock["grads"]:
            diffs = h.compare_grads(got["grads"], stock["grads"])
            assert max(diffs.values()) <= TOL, (name, max(diffs.items(), key=lambda kv: kv[1]))
    if reference is not None:
        assert _flat(stock["losses"]) == pytest.approx(_flat(reference["losses"]), rel=1e-5)
        diffs = h.compare_grads(stock["grads"], reference["grads"])
        assert max(diffs.values()) <= 1e-5, max(diffs.items(), key=lambda kv: kv[1])
    return merged


@pytest.fixture(scope="module")
def reference_pp2():
    return h.run_worker("tests.runtime.workers:single_rank_reference", nproc=1,
                        kwargs={"num_layers": 4, "microbatches": 8})[0]


def test_pp2_vp2_matches_stock_and_single_rank(reference_pp2):
    groups = {"depth-first": None, "breadth-first": [[8], [8]], "elastic": [[6, 2], [4, 4]],
              "elastic-2": [[4, 4], [2, 6]], "uniform-4": [[4, 4], [4, 4]]}
    results = h.run_worker("tests.runtime.workers:stock_vs_pipemesh", nproc=2,
                           kwargs={"pp": 2, "vp": 2, "microbatches": 8, "groups": groups})
    merged = _check(results, reference_pp2)
    # Different group lists are different plans, and every rank agreed on each.
    digests = {name: {r[name]["digest"] for r in results} for name in groups}
    assert all(len(d) == 1 for d in digests.values())
    assert len({d.pop() for d in digests.values()}) == len(groups)
    assert set(merged) == set(groups)


def test_pp4_vp2_matches_stock():
    groups = {"depth-first": None, "breadth-first": [[12], [12]], "elastic": [[8, 4], [6, 6]]}
    results = h.run_worker("tests.runtime.workers:stock_vs_pipemesh", nproc=4, timeout=180,
                           kwargs={"pp": 4, "vp": 2, "microbatches": 12, "groups": groups})
    _check(results)


def test_pp2_dp2_overlap_grad_reduce_matches_stock():
    groups = {"depth-first": None, "elastic": [[6, 2], [4, 4]]}
    results = h.run_worker("tests.runtime.workers:stock_vs_pipemesh", nproc=4, timeout=180,
                           kwargs={"pp": 2, "vp": 2, "dp": 2, "microbatches": 8, "groups": groups,
                                   "ddp": True, "overlap_grad_reduce": True})
    _check(results)


def test_pp2_ddp_without_overlap_matches_stock():
    results = h.run_worker("tests.runtime.workers:stock_vs_pipemesh", nproc=2,
                           kwargs={"pp": 2, "vp": 2, "microbatches": 8, "groups": {"elastic": [[6, 2], [4, 4]]},
                                   "ddp": True})
    _check(results)


def test_forward_only_evaluation_matches_stock():
    results = h.run_worker("tests.runtime.workers:stock_vs_pipemesh", nproc=2,
                           kwargs={"pp": 2, "vp": 2, "microbatches": 8, "forward_only": True,
                                   "groups": {"elastic": [[6, 2], [4, 4]], "breadth-first": [[8], [8]]}})
    _check(results)
