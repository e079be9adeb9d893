"""Cost-model terms of issue 9 / 12: layer specs (TE/flash, GQA, SwiGLU), embedding in the data-parallel
volume, the optimizer step, and the recomputation knapsack (the shared links: test_topology.py,
test_link_costs.py)."""
import dataclasses

import pytest

from megatron_pipemesh.planning.costs import (ClusterSpec, ModelSpec, OpCosts, ScheduleCosts, analytic_costs)
from megatron_pipemesh.planning.memory import ActivationShape, activation_bytes, layer_activation_bytes
from megatron_pipemesh.planning.planner import fit_with_recompute
from megatron_pipemesh.planning.simulator import simulate
from megatron_pipemesh.schedule.config import ScheduleConfig
from megatron_pipemesh.schedule.ops import Op, OpKind

S, B, H, A = 2048, 1, 4096, 32
GPT7B = ModelSpec(32, H, A, S, 1)


def _shape(**kw):
    base = dict(dtype_bytes=2, norm_stat_bytes=4, dropout_mask_bytes=1, hidden_dropout=0.1, attention_dropout=0.1)
    return ActivationShape(S, B, H, A, 50304, **{**base, **kw})


def test_te_flash_attention_keeps_no_score_terms():
    """TE/flash attention: no a*s*s terms (linear in s), only the fp32 log-sum-exp; several times less than local."""
    te, local = _shape(layer_spec="te"), _shape()
    double = dataclasses.replace(te, seq_length=2 * S)
    assert layer_activation_bytes(double, "none") == pytest.approx(2 * layer_activation_bytes(te, "none"))
    lse = A * S * B * 4
    assert layer_activation_bytes(te, "none") - layer_activation_bytes(te, "selective") == pytest.approx(lse)
    ratio = layer_activation_bytes(local, "none") / layer_activation_bytes(te, "none")
    assert ratio > 2.0, ratio  # 4.3x here: fp32 softmax, its bf16 copy and the dropout mask per score
    # With TE the norms are fused into the linears: recomputing 'layernorm' frees nothing.
    assert layer_activation_bytes(te, "selective:layernorm") == layer_activation_bytes(te, "none")
    assert activation_bytes(te, 1) == activation_bytes(dataclasses.replace(te, attention_mask=False), 1)


def test_gqa_and_swiglu_terms():
    """GQA shrinks the k/v storage (TE); the local spec saves repeated k/v instead; SwiGLU keeps 3f (fused) or 5f."""
    kv = H * 8 // A
    te_mha, te_gqa = _shape(layer_spec="te"), _shape(layer_spec="te", num_query_groups=8)
    assert layer_activation_bytes(te_mha, "none") - layer_activation_bytes(te_gqa, "none") == pytest.approx(2 * S * B * (H - kv) * 2)
    # Local spec: q is copied by a reshape and k, v repeated to a heads: 3h saved as with MHA (measured);
    # recomputing core_attn keeps the q copy and the (h + 2kv) q/k/v storage.
    local_gqa, local_mha = _shape(num_query_groups=8), _shape()
    assert layer_activation_bytes(local_gqa, "none") == pytest.approx(layer_activation_bytes(local_mha, "none"))
    assert layer_activation_bytes(local_mha, "selective") - layer_activation_bytes(local_gqa, "selective") == pytest.approx(
        S * B * (H - 2 * kv) * 2)
    f = 4 * H
    gelu = layer_activation_bytes(_shape(layer_spec="te"), "none")
    assert layer_activation_bytes(_shape(layer_spec="te", swiglu=True), "none") - gelu == pytest.approx(f * S * B * 2)
    fused = layer_activation_bytes(_shape(swiglu=True, bias_activation_fusion=True), "none")
    assert layer_activation_bytes(_shape(swiglu=True), "none") - fused == pytest.approx(2 * f * S * B * 2)
    with pytest.raises(ValueError, match="num-query-groups"):
        _shape(num_query_groups=5)


def test_flash_model_reaches_the_cost_model():
    """analytic_costs uses the layer spec: TE activations are over 2x smaller than the local spec's."""
    config = ScheduleConfig.depth_first(4, 2, 8)
    local = analytic_costs(GPT7B, ClusterSpec(), config).activation_bytes["none"]
    te = analytic_costs(dataclasses.replace(GPT7B, layer_spec="te"), ClusterSpec(), config).activation_bytes["none"]
    assert local / te > 2.0


def test_embedding_and_output_layer_in_the_data_parallel_volume():
    """Stage 0's and the last stage's gradient reduction carry the embedding / output layer; the
    total equals every parameter's reduction."""
    model = ModelSpec(8, 1024, 16, 1024, 1)
    cluster = ClusterSpec(dp=4, distributed_optimizer=False)
    config = ScheduleConfig.depth_first(2, 2, 4)
    costs = analytic_costs(model, cluster, config)
    adapter = ScheduleCosts(config, costs)
    reduce = {(r, c): adapter.data_parallel(r, Op(OpKind.GRAD_SYNC, c)) for r in range(2) for c in range(2)}
    assert reduce[(0, 0)] > reduce[(1, 0)] and reduce[(1, 1)] > reduce[(1, 0)]
    per_param = 2 * 3 / 4 * model.grad_bytes * 8 / (cluster.dp_gbps * 1e9)
    params = model.num_layers * model.layer_params() + model.embedding_params() + model.vocab_size * model.hidden_size
    assert sum(reduce.values()) == pytest.approx(params * per_param)


def test_optimizer_step_ends_the_iteration():
    """Each rank's optimizer step follows its last reduction; the iteration ends with the slowest."""
    model = ModelSpec(8, 1024, 16, 1024, 1)
    config = ScheduleConfig.depth_first(2, 2, 8)
    with_step = analytic_costs(model, ClusterSpec(dp=2), config)
    without = dataclasses.replace(with_step, optimizer_s=())
    assert all(s > 0 for s in with_step.optimizer_s)
    base = simulate(config, without)
    stepped = simulate(config, with_step)
    ends = base.timeline.rank_end
    assert stepped.iteration_s == pytest.approx(max(e + s for e, s in zip(ends, with_step.optimizer_s)))
    assert stepped.iteration_s > base.iteration_s


def test_knapsack_takes_most_bytes_per_second_first():
    """Where full recomputation frees more bytes per second than selective, the knapsack uses full
    directly (cheapest-first would have recomputed selectively everywhere first) and costs less time."""
    config = ScheduleConfig.depth_first(2, 2, 8)
    costs = OpCosts(forward_s=1.0, backward_s=2.0, p2p_s=0.0,
                    activation_bytes={"none": 100.0, "selective": 90.0, "full": 10.0},
                    recompute_s={"none": 0.0, "selective": 0.5, "full": 1.0}, static_bytes=(0.0, 0.0))
    peak = max(r.peak_memory_bytes for r in simulate(config, costs).ranks)
    plan = fit_with_recompute(config, costs, budget_bytes=peak - 150)
    assert plan.fits and set(plan.placement.values()) == {"full"}
    # Selective would need 15 chunk-micro-batches per rank (10 bytes each) to cover 150 bytes.
    assert len(plan.placement) < 15


def test_host_level_keeps_none_bytes_and_copies_them_over_the_host_link():
    """'host' parses, holds the 'none' bytes (stage extras included), recomputes nothing, and one copy
    moves those bytes at ClusterSpec.host_link_gbps."""
    from megatron_pipemesh.planning.memory import parse_level, transient_bytes

    assert parse_level("host") == ("host", frozenset(), 0)
    shape = ActivationShape(2048, 1, 2048, 16, 50257)
    assert activation_bytes(shape, 3, "host", last_stage=True) == activation_bytes(shape, 3, "none", last_stage=True)
    assert transient_bytes(shape, 3, "host") == 0.0
    model, config = ModelSpec(num_layers=8, hidden_size=1024, num_attention_heads=8, seq_length=1024), ScheduleConfig.depth_first(2, 2, 4)
    costs = analytic_costs(model, ClusterSpec(host_link_gbps=100.0), config)
    plan = {(0, 0, 0): "host", (1, 1, 0): "host"}
    adapter = ScheduleCosts(config, costs, plan)
    for rank, chunk in ((0, 0), (1, 1)):  # the first stage and the last stage, with their extras
        forward, backward = Op(OpKind.FORWARD, chunk, 0), Op(OpKind.BACKWARD, chunk, 0)
        whole = ScheduleCosts(config, costs).activation(rank, forward)
        assert adapter.activation(rank, forward) == whole > costs.activation_bytes["none"]
        assert adapter.host_copy(rank, Op(OpKind.OFFLOAD, chunk, 0)) == pytest.approx(whole * 8 / 100e9)
        assert adapter.compute(rank, backward) == ScheduleCosts(config, costs).compute(rank, backward)


def test_gloo_reduce_scatter_costs_an_all_reduce():
    """With the distributed optimizer on gloo the gradients' reduce-scatter is priced as an all-reduce (gloo
    all-reduces the whole buffer and keeps a shard); the parameter gather is the same as on NCCL."""
    model, config = ModelSpec(8, 1024, 16, 1024, 1), ScheduleConfig.depth_first(2, 2, 4)
    nccl = analytic_costs(model, ClusterSpec(dp=4), config)
    gloo = analytic_costs(model, ClusterSpec(dp=4, collectives="gloo"), config)
    allreduce = analytic_costs(model, ClusterSpec(dp=4, distributed_optimizer=False), config)
    assert gloo.dp_reduce_s == pytest.approx(2 * nccl.dp_reduce_s) == pytest.approx(allreduce.dp_reduce_s)
    assert gloo.dp_gather_s == pytest.approx(nccl.dp_gather_s) and gloo.dp_gather_s > 0
    assert gloo.first_stage_dp_s > nccl.first_stage_dp_s
    with pytest.raises(ValueError, match="collectives 'mpi' is not one of nccl, gloo"):
        ClusterSpec(collectives="mpi")


def test_without_a_pipeline_a_tied_output_layer_is_the_embedding():
    """PP = 1 with tied embeddings (Megatron's default): the one rank holds and reduces the word embedding once, the
    output layer being that very weight; untied, the output layer is a weight of its own."""
    from megatron_pipemesh.planning.clusters import flat_cluster

    model = ModelSpec(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=128, vocab_size=1024)
    cluster = flat_cluster(tp=1, dp=2, device_tflops=10.0, dp_gbps=1.0, p2p_gbps=1.0, distributed_optimizer=False)
    config = ScheduleConfig.depth_first(1, 1, 2)
    tied = analytic_costs(model, cluster, config)
    untied = analytic_costs(dataclasses.replace(model, tied_embeddings=False), cluster, config)
    own = (model.num_layers * model.layer_params() + model.embedding_params()) * 18
    assert tied.static_bytes == (own,)
    assert untied.static_bytes == (own + model.vocab_size * model.hidden_size * 18,)
    assert tied.last_stage_dp_s == 0.0 < untied.last_stage_dp_s and tied.embedding_allreduce_s == 0.0


# Context parallelism, FP8 and untied embeddings --------------------------------------------------------------

LLAMA = ModelSpec(num_layers=16, hidden_size=2048, num_attention_heads=16, seq_length=16384, micro_batch_size=1,
                  vocab_size=128256, ffn_hidden_size=5632, layer_spec="te", num_query_groups=4, swiglu=True,
                  position_embedding="rope", linear_bias=False, normalization="RMSNorm", tied_embeddings=False,
                  hidden_dropout=0.0, attention_dropout=0.0)


def _cp_cluster(cp: int, comm: str = "p2p", intra: float = 100.0) -> ClusterSpec:
    return ClusterSpec(tp=1, dp=8 // cp, cp=cp, cp_comm=comm, device_tflops=989.0, mfu=0.45, devices_per_node=8,
                       nic_gbps=100.0, intra_node_gbps=intra, dp_gbps=100.0, p2p_gbps=100.0)


def test_a_cp_2_layout_prices_the_ring_exchange_by_hand():
    """CP 2 inside a node (100 Gbit/s per GPU): each rank computes half the tokens and half the attention; the ring's
    one step passes a slice's keys and values (2 x s/2 x b x kv x 2 bytes) beside the attention of the slice in hand,
    so a layer's forward waits max(0, transfer - attention/2); the backward passes keys, values and their gradients
    beside twice the attention."""
    config = ScheduleConfig.depth_first(1, 1, 8)
    flat, ring = analytic_costs(LLAMA, _cp_cluster(1), config), analytic_costs(LLAMA, _cp_cluster(2), config)
    rate = 989e12 * 0.45
    s, b, h, kv = 16384, 1, 2048, 2048 * 4 // 16
    attention = 4 * b * s * s * h / 2 / rate  # per rank
    step = 2 * (s / 2) * b * kv * 2 / (100e9 / 8) + 30e-6
    exposed = max(step - attention / 2, 0.0)
    assert exposed > 0  # the slow link: the transfer outlasts the attention
    assert ring.tp_forward_s == pytest.approx(16 * exposed)
    assert ring.tp_backward_s == pytest.approx(16 * max(2 * step - attention, 0.0))
    # compute: half of everything per rank, the exchange on top
    assert ring.forward_s - ring.tp_forward_s == pytest.approx((flat.forward_s - flat.tp_forward_s) / 2)
    assert ring.last_stage_extra_s == pytest.approx(flat.last_stage_extra_s / 2)
    # memory: a half-length slice per rank
    assert ring.activation_bytes["none"] == pytest.approx(flat.activation_bytes["none"] / 2)
    # gradients reduced over DP x CP = 8 ranks either way; the distributed optimizer shards over the same 8
    assert ring.static_bytes == flat.static_bytes
    # NVLink: the transfer hides under the attention
    fast = analytic_costs(LLAMA, _cp_cluster(2, intra=3600.0), config)
    assert fast.tp_forward_s == 0.0


@pytest.mark.parametrize("comm", ["a2a", "allgather"])
def test_cp_all_to_all_and_all_gather_are_exposed(comm):
    config = ScheduleConfig.depth_first(1, 1, 8)
    costs = analytic_costs(LLAMA, _cp_cluster(2, comm), config)
    s, b, h, kv, rate = 16384, 1, 2048, 512, 100e9 / 8
    if comm == "a2a":
        per_layer = 0.5 * (s / 2) * b * (2 * h + 2 * kv) * 2 / rate + 60e-6
    else:
        per_layer = 0.5 * s * b * 2 * kv * 2 / rate + 30e-6
    assert costs.tp_forward_s == pytest.approx(16 * per_layer)
    assert costs.tp_backward_s == pytest.approx(16 * per_layer)
    if comm == "allgather":  # every slice's keys and values saved
        p2p = analytic_costs(LLAMA, _cp_cluster(2), config)
        assert costs.activation_bytes["none"] - p2p.activation_bytes["none"] == pytest.approx(
            16 * (s / 2) * b * 2 * kv * 2)


def test_fp8_runs_the_gemms_at_the_fp8_rate_and_keeps_linear_inputs_in_a_byte():
    config = ScheduleConfig.depth_first(2, 1, 8)
    cluster = dataclasses.replace(_cp_cluster(1), fp8_tflops=1979.0)
    bf16 = analytic_costs(LLAMA, cluster, config)
    fp8 = analytic_costs(dataclasses.replace(LLAMA, fp8=True), cluster, config)
    s, h, f = 16384, 2048, 5632
    attention = 4 * s * s * h / (989e12 * 0.45)
    gemms = (LLAMA.layer_forward_flops() - 4 * s * s * h)
    assert bf16.forward_s == pytest.approx(8 * (gemms / (989e12 * 0.45) + attention))
    assert fp8.forward_s == pytest.approx(8 * (gemms / (1979e12 * 0.45) + attention))
    # the two norm outputs, the context and the fc2 input: one byte instead of two
    assert bf16.activation_bytes["none"] - fp8.activation_bytes["none"] == pytest.approx(8 * s * (3 * h + f))
    # Transformer Engine's FP8 weight and its transpose: two bytes more per layer parameter
    assert fp8.static_bytes[0] - bf16.static_bytes[0] == pytest.approx(2 * 8 * LLAMA.layer_params())


def test_untied_embeddings_have_no_embedding_all_reduce_and_their_own_output_layer():
    config = ScheduleConfig.depth_first(2, 1, 8)
    cluster = ClusterSpec(dp=1, devices_per_node=1, nic_gbps=0.1)
    tied = analytic_costs(dataclasses.replace(LLAMA, tied_embeddings=True), cluster, config)
    untied = analytic_costs(LLAMA, cluster, config)
    assert tied.embedding_allreduce_s > 0 and untied.embedding_allreduce_s == 0.0
    assert untied.static_bytes == tied.static_bytes  # the last stage holds an output layer either way (PP > 1)
    flat = ScheduleConfig.depth_first(1, 1, 8)  # without a pipeline only the untied one has a second matrix
    extra = analytic_costs(LLAMA, cluster, flat).static_bytes[0] - analytic_costs(
        dataclasses.replace(LLAMA, tied_embeddings=True), cluster, flat).static_bytes[0]
    assert extra == pytest.approx(128256 * 2048 * 18)
    # RMSNorm: a weight per norm, no bias
    assert LLAMA.layer_params() == dataclasses.replace(LLAMA, normalization="LayerNorm").layer_params() - 2 * 2048


def test_the_expert_dispatch_by_hand_inside_a_node_and_across_nics():
    """EP 8 at TP 1: a rank sends (EP - 1)/EP of its s x b x k hidden states to its peers, to dispatch and again to
    combine. Inside one node of 8 GPUs (NVLink 3600 Gbit/s) the intra-node link carries it; with nodes of 4 GPUs half
    of the peers are on another node and the node's four GPUs share its NIC."""
    from megatron_pipemesh.planning.costs import ep_crosses_nic, ep_exchange_s
    from megatron_pipemesh.planning.specs import MoeSpec

    model = dataclasses.replace(LLAMA, seq_length=4096, moe=MoeSpec(num_experts=8, topk=2))
    s, h, k = 4096, 2048, 2
    per_peer = s * k * h * 2 / 8  # bytes to each EP peer
    inside = ClusterSpec(tp=1, dp=8, ep=8, devices_per_node=8, nic_gbps=100.0, intra_node_gbps=3600.0)
    one = 7 * per_peer / (3600e9 / 8) + 60e-6
    assert ep_exchange_s(model, inside) == pytest.approx((2 * one, 2 * one))
    assert not ep_crosses_nic(inside)
    across = dataclasses.replace(inside, devices_per_node=4)
    one = max(3 * per_peer / (3600e9 / 8), 4 * per_peer * 4 / (100e9 / 8)) + 60e-6
    assert ep_exchange_s(model, across) == pytest.approx((2 * one, 2 * one)) and ep_crosses_nic(across)
    # every second layer a MoE layer: half the dispatch per layer on average; EP 1: none
    half = dataclasses.replace(model, moe=MoeSpec(num_experts=8, topk=2, pattern=(1, 0) * 8))
    assert ep_exchange_s(half, across)[0] == pytest.approx(one)
    assert ep_exchange_s(model, dataclasses.replace(inside, ep=1)) == (0.0, 0.0)
    # the experts' weights split over EP; their gradients reduced over the expert data-parallel group (8 / 8 = 1)
    config, plain = ScheduleConfig.depth_first(1, 1, 8), dataclasses.replace(inside, distributed_optimizer=False)
    spread, whole = analytic_costs(model, plain, config), analytic_costs(model, dataclasses.replace(plain, ep=1), config)
    assert whole.static_bytes[0] - spread.static_bytes[0] == pytest.approx(
        16 * model.expert_layer_params() * (1 - 1 / 8) * 18)
