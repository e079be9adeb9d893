"""planning/specs.py: the parameters of a (MoE) GPT equal those of Megatron's built model, and the weights and
optimizer state per rank those of megatron-core's own theoretical_memory_usage for the same command."""
import copy
import dataclasses

import pytest

from megatron_pipemesh.planning.costs import ClusterSpec, analytic_costs
from megatron_pipemesh.planning.specs import ModelSpec, MoeSpec
from megatron_pipemesh.schedule.config import ScheduleConfig
from tests import megatron_harness as h


SHAPES = ["dense", "moe", "moe-every-2nd-shared-gated", "moe-bias-layernorm"]


def _shape(shape: str):
    """(TransformerConfig fields, our MoeSpec) of one test shape."""
    config = dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, vocab_size=256,
                  seq_length=32, num_query_groups=2, gated_linear_unit=True, normalization="RMSNorm",
                  add_bias_linear=False)
    moe = None
    if shape != "dense":
        config.update(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48)
        moe = MoeSpec(num_experts=4, topk=2, ffn_hidden_size=48)
    if shape == "moe-every-2nd-shared-gated":  # (Megatron's shared experts take no biases)
        config.update(moe_layer_freq=[1, 0, 1, 0], moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True)
        moe = dataclasses.replace(moe, pattern=(1, 0, 1, 0), shared_ffn=32, shared_gate=True)
    if shape == "moe-bias-layernorm":
        config.update(add_bias_linear=True, normalization="LayerNorm")
    return config, moe


@pytest.fixture(scope="module")
def built():
    """Shape -> the parameters of Megatron's built model (every shape built in one worker: its start-up is most of
    the time)."""
    return h.run_worker("tests.planning.spec_workers:built_parameters", nproc=1, timeout=240,
                        kwargs={"configs": {shape: _shape(shape)[0] for shape in SHAPES}, "untie": True})[0]


@pytest.mark.parametrize("shape", SHAPES)
def test_parameter_counts_equal_megatrons_built_model(shape, built):
    config, moe = _shape(shape)
    model = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=256,
                      ffn_hidden_size=96, num_query_groups=2, swiglu=True, position_embedding="learned_absolute",
                      normalization=config["normalization"], linear_bias=config["add_bias_linear"],
                      tied_embeddings=False, moe=moe)
    ours = 4 * model.layer_params() + model.embedding_params() + model.vocab_size * 64 + model.norm_params()
    assert ours == pytest.approx(built[shape], abs=0.5)


def test_weights_and_optimizer_per_rank_match_megatrons_theoretical_memory():
    """A Mixtral-8x7B-shaped command on 64 GPUs (TP 2, PP 4, EP 8, the distributed optimizer): the first stage's
    weights, gradients and optimizer state within 1% of megatron-core's compute_weight_and_optimizer_memory."""
    from megatron_pipemesh.integration.megatron_command import read_command

    command = ("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention --num-query-groups "
               "8 --ffn-hidden-size 14336 --swiglu --normalization RMSNorm --position-embedding-type rope "
               "--untie-embeddings-and-output-weights --disable-bias-linear --seq-length 4096 --max-position-embeddings 4096 "
               "--num-experts 8 "
               "--moe-router-topk 2 --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 4 "
               "--expert-model-parallel-size 8 --micro-batch-size 1 --global-batch-size 256 --bf16 "
               "--use-distributed-optimizer --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 "
               "--train-iters 10 --lr 1e-4")
    user = read_command(command, world_size=64)  # first: it prepares megatron's import
    from megatron.training.theoretical_memory_usage import compute_weight_and_optimizer_memory

    args = copy.copy(user.args)
    args.padded_vocab_size = user.model.vocab_size
    theoretical = compute_weight_and_optimizer_memory(args)
    cluster = ClusterSpec(tp=2, dp=8, ep=8, distributed_optimizer=True, sequence_parallel=True)
    costs = analytic_costs(user.model, cluster, ScheduleConfig.depth_first(4, 1, user.microbatches))
    assert costs.static_bytes[0] == pytest.approx(theoretical, rel=0.01)
    assert user.model.moe.num_experts == 8 and user.ep == 8 and user.etp == 2
