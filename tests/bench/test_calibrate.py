"""bench/calibrate.py on recorded numbers: the shared token bucket's data-parallel accounting keeps the
simulator within 15% of the measured PP=2 x DP=2 ``--quick`` rows of ``--network shared``; the per-rank
network's accounting."""
import pytest

from megatron_pipemesh.bench.calibrate import (MeasuredCompute, allreduce_s, embedding_allreduce_s,
                                               predict_iteration_ms, shared_bucket_allreduce_s)
from megatron_pipemesh.bench.runner import ModelSetup, ParallelConfig, bench_gpt
from megatron_pipemesh.schedule.config import ScheduleConfig

QUICK_MODEL = ModelSetup(bench_gpt(hidden_size=384, num_attention_heads=8, seq_length=64, micro_batch_size=1, layers=1), microbatches=4, vpp=4)
RATE = 400e6 / 8  # tc 400 Mbit/s, link share 0.5 (two stages' rings reduce at once)

# Repeat 0 of `pipemesh bench --quick --repeats 3 ...` (docs/benchmarks.md, 06:43 UTC): per global rank
# forward+backward compute ms and idle ms, and the median iteration ms. The log table kept only the
# sum of forward and backward: split 1:2 (1:3 with full recomputation, whose backward replays the forward).
RECORDED = [
    ("1f1b", ScheduleConfig.depth_first(2, 1, 4), [3529, 3545, 3817, 3813], [3144, 3152, 2863, 2886], 8155, 2.0),
    ("depth-first V4 g2", ScheduleConfig.uniform(2, 4, 4, 2), [4519, 4640, 3739, 3722], [1764, 1657, 2548, 2573],
     6987, 2.0),
    ("breadth-first V4 g4, full", ScheduleConfig.uniform(2, 4, 4, 4), [6197, 6148, 5969, 5979],
     [1808, 1856, 2035, 2026], 9385, 3.0),
]


def _predict(sched, compute, idle, iteration_ms, backward_share, link_share):
    stage = [(compute[0] + compute[1]) / 2, (compute[2] + compute[3]) / 2]  # global ranks 2s, 2s+1 = stage s
    forward_backward = max(c + i for c, i in zip(compute, idle))
    measured = MeasuredCompute([s / (1 + backward_share) for s in stage],
                               [s * backward_share / (1 + backward_share) for s in stage], iteration_ms - forward_backward)
    return predict_iteration_ms(QUICK_MODEL, ParallelConfig(2, 2), sched, measured, RATE, 0.0, link_share,
                                per_rank=False)


def test_shared_bucket_allreduce():
    """A ring all-reduce through one bucket moves 2(d-1) x bytes; concurrent groups add up; one rank moves none."""
    assert shared_bucket_allreduce_s(1e6, 2, 1e6) == pytest.approx(2.0)
    assert shared_bucket_allreduce_s(1e6, 4, 1e6, groups=2) == pytest.approx(12.0)
    assert shared_bucket_allreduce_s(1e6, 1, 1e6) == 0.0
    assert embedding_allreduce_s(QUICK_MODEL, RATE, dp=2, per_rank=False) == pytest.approx(2 * 384 * 384 * 4 * 2 / RATE)
    assert embedding_allreduce_s(QUICK_MODEL, None, dp=2) == 0.0


def test_per_rank_allreduce():
    """With a NIC per rank each rank of a ring sends 2(d-1)/d x bytes through its own NIC; rings of other stages
    (groups) use other NICs, so they add nothing."""
    assert allreduce_s(1e6, 2, 1e6) == pytest.approx(1.0)
    assert allreduce_s(1e6, 4, 1e6, groups=2) == pytest.approx(1.5)
    assert allreduce_s(1e6, 1, 1e6) == 0.0
    assert allreduce_s(1e6, 4, 1e6, groups=2, per_rank=False) == shared_bucket_allreduce_s(1e6, 4, 1e6, groups=2)
    assert embedding_allreduce_s(QUICK_MODEL, RATE, dp=2) == pytest.approx(384 * 384 * 4 / RATE)


@pytest.mark.parametrize("name,sched,compute,idle,iteration_ms,backward_share", RECORDED)
def test_recorded_quick_rows_within_15_percent(name, sched, compute, idle, iteration_ms, backward_share):
    """The data-parallel accounting of a switched network (each rank its own link) under-predicting the bench."""
    predicted = _predict(sched, compute, idle, iteration_ms, backward_share, 0.5)["iteration_ms"]
    assert abs(predicted - iteration_ms) / iteration_ms <= 0.15, (name, predicted, iteration_ms)


def test_per_rank_link_accounting_misses_the_depth_first_row():
    """The recorded rows can tell the models apart: d ranks on d links (the old formula) is > 15% off."""
    name, sched, compute, idle, iteration_ms, share = RECORDED[1]
    # For d = 2 the per-link formula 2(d-1)/d x bytes / (rate x 0.5) equals the bucket's at link share 1.
    predicted = _predict(sched, compute, idle, iteration_ms, share, 1.0)["iteration_ms"]
    assert (predicted - iteration_ms) / iteration_ms < -0.15


def test_recorded_token_bucket_probe_matches_the_shared_bucket_model():
    """Measured with gloo in a namespace whose loopback is a 400 Mbit/s tbf (burst 256 KiB), 4 ranks, 7.1 MB
    (one --quick chunk's fp32 gradients): one 2-rank ring alone took 0.277-0.299 s, two rings at once
    0.416-0.547 s. A switched network (each rank its own link) would give 0.142 s for the ring alone."""
    nbytes = 7096320
    assert shared_bucket_allreduce_s(nbytes, 2, RATE) == pytest.approx(0.288, rel=0.05)
    both = shared_bucket_allreduce_s(nbytes, 2, RATE, groups=2)  # = one ring at link share 0.5
    assert 0.416 <= both <= 0.547 * 1.1


def test_distributed_optimizer_on_gloo_reduces_with_a_whole_all_reduce():
    """--sharding rows: gloo's reduce-scatter costs the all-reduce of the chunk's gradients, the parameter gather
    half of it (measured on the per-rank network: 8 MB over 2 ranks, 0.84 s each, the gather 0.42-0.60 s)."""
    from megatron_pipemesh.bench.calibrate import measured_costs

    compute = MeasuredCompute([100.0, 100.0], [200.0, 200.0], 0.0)
    sched = ScheduleConfig.uniform(2, 4, 4, 2)
    plain = measured_costs(QUICK_MODEL, ParallelConfig(2, 2), sched, compute, RATE)
    zero1 = measured_costs(QUICK_MODEL, ParallelConfig(2, 2), sched, compute, RATE, distributed_optimizer=True)
    assert zero1.dp_reduce_s == pytest.approx(plain.dp_reduce_s) and plain.dp_reduce_s > 0
    assert zero1.dp_gather_s == pytest.approx(plain.dp_reduce_s / 2) and plain.dp_gather_s == 0.0


def test_per_rank_network_shares_each_nic_in_the_simulator():
    """On the per-rank network the calibration's costs carry the product's topology (every rank its own node, its
    NIC shared by its pipeline sends, ring and the embedding all-reduce, as --nic-queue fair shares it), the
    embedding / output parameters in the first / last stage's reductions and the tied embedding's all-reduce; a
    prediction with the NIC shared is never shorter than the same costs with every transfer on its own link."""
    from dataclasses import replace

    from megatron_pipemesh.bench.calibrate import measured_costs, network_cluster
    from megatron_pipemesh.planning.simulator import simulate

    cluster = network_cluster(2, 0.25, True)
    assert cluster.nic_gbps == 0.25 and cluster.devices_per_node == 1
    assert network_cluster(2, 0.25, False).nic_gbps is None
    compute = MeasuredCompute([100.0, 100.0], [200.0, 200.0], 0.0)
    sched = ScheduleConfig.uniform(2, 4, 4, 2)
    costs = measured_costs(QUICK_MODEL, ParallelConfig(2, 2), sched, compute, RATE)
    assert costs.network is not None and costs.embedding_allreduce_s == pytest.approx(384 * 384 * 4 / RATE)
    assert costs.first_stage_dp_s == pytest.approx(allreduce_s((384 + 64) * 384 * 4, 2, RATE))
    assert costs.last_stage_dp_s == pytest.approx(allreduce_s(384 * 384 * 4, 2, RATE))
    assert measured_costs(QUICK_MODEL, ParallelConfig(2, 2), sched, compute, RATE, per_rank=False).network is None
    shared = simulate(sched, costs).iteration_s
    assert shared >= simulate(sched, replace(costs, network=None)).iteration_s - 1e-9
