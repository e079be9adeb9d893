"""The traffic the simulator prices on its links: fair sharing of a NIC, tensor-parallel collectives, the tied
embedding's all-reduce and pipeline links inside a server. Each case changes the simulated iteration (or a
transfer) by the amount its model says, so each fails without it."""
import dataclasses

import pytest

from megatron_pipemesh.planning.costs import ClusterSpec, ModelSpec, OpCosts, ScheduleCosts, analytic_costs
from megatron_pipemesh.planning.simulator import simulate
from megatron_pipemesh.planning.topology import GBIT, topology
from megatron_pipemesh.schedule.config import ScheduleConfig
from megatron_pipemesh.schedule.ops import Op, OpKind

MODEL = ModelSpec(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=1024)
ACT_BYTES = 1024 * 1024 * 2  # s * b * h in bf16


def test_a_send_next_to_a_reduction_shares_the_nic_fairly():
    """1F1B, p = 2, m = 2, F = 1, B = 2, a send 0.5 s and a reduction 3 s alone, one NIC per rank. Rank 1's
    last gradient send and its reduction start together at 7.5 on its egress: half each, so the send takes 1 s,
    rank 0's last backward starts at 8.5 instead of 8, and its reduction ends at 13.5 instead of 13 (rank 1's
    ends at 11: 0.5 s of work in the shared second, 2.5 alone)."""
    config = ScheduleConfig.depth_first(2, 1, 2)
    nic = topology(ClusterSpec(tp=1, dp=2, devices_per_node=1, nic_gbps=8), 2)
    costs = OpCosts(forward_s=1.0, backward_s=2.0, p2p_s=0.5, dp_reduce_s=3.0, static_bytes=(0.0, 0.0), network=nic)
    alone = simulate(config, dataclasses.replace(costs, network=None))
    shared = simulate(config, costs)
    assert alone.iteration_s == 13.0
    assert shared.iteration_s == pytest.approx(13.5)
    send = [c for c in shared.timeline.comms if c.lane == "p2p" and c.src == 1 and c.start == 7.5]
    assert len(send) == 1 and send[0].end == pytest.approx(8.5)
    reduce1 = next(c for c in shared.timeline.comms if c.lane == "dp" and c.src == 1)
    assert (reduce1.start, reduce1.end) == (7.5, pytest.approx(11.0))


def test_a_lone_transfer_gets_the_whole_nic():
    """One GPU per VM: a pipeline send and a ring are priced at the NIC's whole rate (no static split between
    them); they share only while both run."""
    cluster = ClusterSpec(tp=1, dp=4, devices_per_node=1, nic_gbps=6.25, dp_gbps=6.25, p2p_gbps=6.25)
    config = ScheduleConfig.depth_first(4, 1, 4)
    costs = analytic_costs(MODEL, cluster, config)
    assert ScheduleCosts(config, costs).transfer(1, 2, Op(OpKind.FORWARD, 0, 0))[0] == pytest.approx(ACT_BYTES / (6.25 * GBIT))
    grads = 4 * MODEL.layer_params() / 4 * MODEL.grad_bytes  # one chunk of one layer per rank at p = 4
    assert costs.dp_reduce_s == pytest.approx(3 / 4 * grads / (6.25 * GBIT))


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_collectives_lengthen_every_forward_and_backward(sequence_parallel):
    """TP2, p = 2 (one TP group per node), m = 4, 1F1B: the last rank (it has the output layer) runs back to
    back, so the iteration is F(stage 0) + 2 transfers + 4 (F + B)(stage 1) + B(stage 0) + the embedding's
    all-reduce. Per layer (2 per stage) two all-reduces of s*b*h forward and two backward, the embedding's one
    forward on stage 0, the output layer's input gradient's one backward on stage 1 (with SP an all-gather and
    a reduce-scatter in place of each all-reduce, half of one each way for the embedding and the output
    layer): 45 all-reduces' time on the intra-node link, exposed, against a free intra-node link."""
    cluster = ClusterSpec(tp=2, dp=1, devices_per_node=2, nic_gbps=50, intra_node_gbps=100, optimizer_step=False,
                          sequence_parallel=sequence_parallel)
    free = dataclasses.replace(cluster, intra_node_gbps=1e12)
    config = ScheduleConfig.depth_first(2, 1, 4)
    unit = 2 * (2 - 1) / 2 * ACT_BYTES / (100 * GBIT)
    costs = analytic_costs(MODEL, cluster, config)
    assert costs.tp_forward_s == costs.tp_backward_s == pytest.approx(2 * 2 * unit)
    slower = simulate(config, costs).iteration_s - simulate(config, analytic_costs(MODEL, free, config)).iteration_s
    assert slower == pytest.approx(45 * unit, rel=1e-6)
    # Full recomputation repeats the forward's collectives.
    assert costs.recompute_s["full"] == pytest.approx(costs.forward_s)


def test_tied_embedding_all_reduce_follows_the_backward():
    """p = 2, no data parallelism: after the last backward, stage 0 and the last stage all-reduce the word
    embedding's fp32 gradient (vocab x h each way, two ring steps' latency) over their NICs; the learned position
    table stays on stage 0 and adds nothing. Untied (--untie-embeddings-and-output-weights): no all-reduce."""
    cluster = ClusterSpec(tp=1, dp=1, devices_per_node=1, nic_gbps=8, optimizer_step=False)
    config = ScheduleConfig.depth_first(2, 1, 4)
    tied = simulate(config, analytic_costs(MODEL, cluster, config))
    untied = simulate(config, analytic_costs(dataclasses.replace(MODEL, tied_embeddings=False), cluster, config))
    expected = MODEL.vocab_size * MODEL.hidden_size * 4 / (8 * GBIT) + 2 * cluster.latency_us * 1e-6
    assert tied.iteration_s - untied.iteration_s == pytest.approx(expected)
    rope = analytic_costs(dataclasses.replace(MODEL, position_embedding="rope"), cluster, config)
    assert rope.embedding_allreduce_s == analytic_costs(MODEL, cluster, config).embedding_allreduce_s
    lanes = [(c.src, c.dst) for c in tied.timeline.comms if c.lane == "embedding"]
    assert sorted(lanes) == [(0, 1), (1, 0)]


def test_pipeline_links_inside_a_server_run_at_the_intra_node_rate():
    """TP1 DP4 PP4 on 8-GPU servers: link 0->1 stays in the server (100 Gbit/s), link 1->2 leaves it (its 4
    devices share the 50 Gbit/s NIC); the simulated sends of the forward phase take exactly that (1F1B: no
    gather or reduction runs then)."""
    cluster = ClusterSpec(tp=1, dp=4, devices_per_node=8, nic_gbps=50, intra_node_gbps=100, dp_gbps=6.25, p2p_gbps=6.25)
    config = ScheduleConfig.depth_first(4, 1, 4)
    costs = analytic_costs(MODEL, cluster, config)
    adapter = ScheduleCosts(config, costs)
    inside, across = ACT_BYTES / (100 * GBIT), ACT_BYTES / (12.5 * GBIT)
    assert adapter.transfer(0, 1, Op(OpKind.FORWARD, 0, 0))[0] == pytest.approx(inside)
    assert adapter.transfer(1, 2, Op(OpKind.FORWARD, 0, 0))[0] == pytest.approx(across)
    result = simulate(config, costs)
    first = {(c.src, c.dst): c.end - c.start - costs.latency_s for c in result.timeline.comms
             if c.lane == "p2p" and c.op == Op(OpKind.FORWARD, 0, 0)}
    assert first[0, 1] == pytest.approx(inside) and first[1, 2] == pytest.approx(across)
