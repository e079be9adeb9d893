"""The measured re-planner's micro-benchmarks (runtime/profiler.py) on two CPU ranks (gloo, PP=2)."""
from tests import megatron_harness as h

BOUND = 1 << 22  # elements: 16 MiB in fp32 (runtime/profiler.py ALLREDUCE_SAMPLE_NUMEL)
CHUNK_PARAMS = 4 * BOUND  # 64 MiB in fp32: what a whole-chunk buffer would cost


def test_transfer_runs_on_the_link_groups_and_the_allreduce_buffer_is_bounded():
    """The pipeline transfer is timed where the runtime sends: each rank receives on the link from the previous rank
    and sends on the link to the next one (never on Megatron's pipeline group, never batched); the data-parallel
    all-reduce allocates at most BOUND elements mid-training, not the chunk's parameters, and its
    time is scaled to the chunk."""
    results = h.run_worker("tests.runtime.profiler_workers:measured_costs", nproc=2,
                           kwargs={"chunk_params": CHUNK_PARAMS})
    for got in results:
        rank, seen = got["rank"], got["seen"]
        assert seen["batched"] == [], seen
        assert set(seen["isend"]) == {f"link F {rank}->{1 - rank}"}
        assert set(seen["irecv"]) == {f"link F {1 - rank}->{rank}"}
        assert len(seen["isend"]) == len(seen["irecv"]) == 6  # a warm-up and five timed repeats
        assert seen["all_reduce"] and max(seen["all_reduce"]) <= BOUND, seen["all_reduce"]
        assert got["costs"]["p2p_s"] > 0 and got["costs"]["dp_reduce_s"] > 0
