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
    """Every schedule's losses and gradients equal the stock schedule's on every data-parallel replica;
    after the reduction all replicas hold the same gradients; the stock run equals ``reference`` (one
    rank running all replicas' micro-batches) when given. Returns {name: [merged result per replica]}."""
    merged = {name: h.merge_replicas([r[name] for r in results]) for name in results[0]}
    stock = merged.pop("stock")
    assert all(replica["losses"] for replica in stock), "a last stage reported no losses"
    if len(stock) > 1:  # the replicas really saw different data
        assert _flat(stock[0]["losses"]) != pytest.approx(_flat(stock[1]["losses"]), rel=1e-3)
    for name, replicas in [("stock", stock)] + list(merged.items()):
        for k, replica in enumerate(replicas):
            if k and stock[0]["grads"]:
                diffs = h.compare_grads(replica["grads"], replicas[0]["grads"])
                assert max(diffs.values()) <= TOL, (name, f"replica {k} vs 0", max(diffs.items(), key=lambda kv: kv[1]))
            if name == "stock":
                continue
            assert _flat(replica["losses"]) == pytest.approx(_flat(stock[k]["losses"]), rel=TOL, abs=0), (name, k)
            if stock[k]["grads"]:
                diffs = h.compare_grads(replica["grads"], stock[k]["grads"])
                assert max(diffs.values()) <= TOL, (name, k, max(diffs.items(), key=lambda kv: kv[1]))
    if reference is not None:
        every_replica = [loss for replica in stock for loss in _flat(replica["losses"])]
        assert every_replica == pytest.approx(_flat(reference["losses"]), rel=1e-5)
        diffs = h.compare_grads(stock[0]["grads"], reference["grads"])
        assert max(diffs.values()) <= 1e-5, max(diffs.items(), key=lambda kv: kv[1])
    return merged


@pytest.fixture(scope="module")
def reference_pp2():
    return h.run_worker("tests.runtime.workers:single_rank_reference", nproc=1,
                        kwargs={"num_layers": 4, "microbatches": 8})[0]


def test_pp2_vp2_matches_stock_and_single_rank(reference_pp2):
    """PP=2, VP=2: every group list matches stock (which matches one rank) and is its own plan on all ranks."""
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
    """PP=4, VP=2, m=12: depth-first, breadth-first and elastic groups match the stock schedule."""
    groups = {"depth-first": None, "breadth-first": [[12], [12]], "elastic": [[8, 4], [6, 6]]}
    results = h.run_worker("tests.runtime.workers:stock_vs_pipemesh", nproc=4, timeout=180,
                           kwargs={"pp": 4, "vp": 2, "microbatches": 12, "groups": groups})
    _check(results)


def test_pp2_dp2_overlap_grad_reduce_matches_stock():
    """PP=2 x DP=2 with overlapped gradient reduction, different data on each replica: every replica's
    losses and reduced gradients equal the stock schedule's, and the stock gradients equal one rank
    running both replicas' micro-batches (so an early, partial or missing reduction fails)."""
    groups = {"depth-first": None, "elastic": [[6, 2], [4, 4]]}
    results = h.run_worker("tests.runtime.workers:stock_vs_pipemesh", nproc=4, timeout=180,
                           kwargs={"pp": 2, "vp": 2, "dp": 2, "microbatches": 8, "groups": groups,
                                   "ddp": True, "overlap_grad_reduce": True})
    reference = h.run_worker("tests.runtime.workers:single_rank_reference", nproc=1,
                             kwargs={"num_layers": 4, "microbatches": 8, "replicas": 2})[0]
    merged = _check(results, reference)
    assert all(len(replicas) == 2 for replicas in merged.values())


def test_pp2_ddp_without_overlap_matches_stock():
    """With Megatron DDP and no overlapped reduction, elastic groups match the stock schedule."""
    results = h.run_worker("tests.runtime.workers:stock_vs_pipemesh", nproc=2,
                           kwargs={"pp": 2, "vp": 2, "microbatches": 8, "groups": {"elastic": [[6, 2], [4, 4]]},
                                   "ddp": True})
    _check(results)


def test_forward_only_evaluation_matches_stock():
    """Forward-only evaluation under PipeMesh gives the stock schedule's losses."""
    results = h.run_worker("tests.runtime.workers:stock_vs_pipemesh", nproc=2,
                           kwargs={"pp": 2, "vp": 2, "microbatches": 8, "forward_only": True,
                                   "groups": {"elastic": [[6, 2], [4, 4]], "breadth-first": [[8], [8]]}})
    _check(results)
