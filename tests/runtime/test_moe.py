"""PipeMesh schedules a mixture-of-experts GPT with expert parallelism on CPU (gloo's all-to-all with uneven
splits): on every rank the losses and every gradient, the experts' included (reduced over the expert data-parallel
group by Megatron's DDP, at the points PipeMesh's schedule places), equal the stock schedule's."""
import pytest

from tests import megatron_harness as h

TOL = 1e-6


def _flat(losses):
    return [value for pair in losses for value in pair]


@pytest.fixture(scope="module")
def pp2_dp2_ep2():
    """PP = 2 x DP = 2 on 4 ranks, the two data-parallel replicas also the two expert-parallel ranks (two experts
    each), V = 2, 8 micro-batches."""
    groups = {"depth-first": None, "elastic": [[6, 2], [4, 4]], "breadth-first": [[8], [8]]}
    return h.run_worker("tests.runtime.moe_workers:moe_stock_vs_pipemesh", nproc=4, timeout=240,
                        kwargs={"pp": 2, "vp": 2, "ep": 2, "microbatches": 8, "groups": groups})


def test_every_rank_matches_the_stock_schedule(pp2_dp2_ep2):
    for rank in pp2_dp2_ep2:
        stock = rank["stock"]
        assert stock["grads"] and all(g is not None for g in stock["grads"].values())
        for name in ("depth-first", "elastic", "breadth-first"):
            got = rank[name]
            assert _flat(got["losses"]) == pytest.approx(_flat(stock["losses"]), rel=TOL, abs=0), (name, stock["rank"])
            diffs = h.compare_grads(got["grads"], stock["grads"])
            assert max(diffs.values()) <= TOL, (name, stock["rank"], max(diffs.items(), key=lambda kv: kv[1]))


def test_the_replicas_saw_their_own_data_and_hold_their_own_experts(pp2_dp2_ep2):
    replicas = h.merge_replicas([rank["stock"] for rank in pp2_dp2_ep2])
    assert len(replicas) == 2 and all(r["losses"] for r in replicas)
    assert _flat(replicas[0]["losses"]) != pytest.approx(_flat(replicas[1]["losses"]), rel=1e-3)
    experts = [{name for name in r["grads"] if ".local_experts." in name} for r in replicas]
    assert experts[0] and experts[1] and not experts[0] & experts[1]  # each expert-parallel rank its own experts
    dense = [{k: v for k, v in r["grads"].items() if ".local_experts." not in k} for r in replicas]
    diffs = h.compare_grads(dense[1], dense[0])  # the dense gradients were reduced over the replicas
    assert max(diffs.values()) <= TOL
    routers = [name for name in dense[0] if name.endswith("router.weight")]
    assert routers  # the router is a dense parameter of every MoE layer
