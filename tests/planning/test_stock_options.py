"""planning/stock_options.py: stock Megatron's option set and its exact flags."""
import pytest

from megatron_pipemesh.planning.costs import ClusterSpec, ModelSpec
from megatron_pipemesh.planning.stock_options import (StockOffload, StockRecompute, StockSetting, group_sizes,
                                                      recompute_options, schedule_options)

MODEL = ModelSpec(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=1024)
CLUSTER = ClusterSpec(dp=4, device_tflops=125, dp_gbps=10, p2p_gbps=10)


def test_group_sizes_follow_megatrons_rule():
    """g ranges over [p, m] and the last group (m mod g) is empty or at least p, as schedules.py demands."""
    assert group_sizes(4, 10) == [5, 6, 10]
    assert group_sizes(2, 8) == [2, 3, 4, 5, 6, 8]  # 8 mod 7 = 1 < p
    assert all(g >= 4 and (12 % g == 0 or 12 % g >= 4) for g in group_sizes(4, 12))


def test_schedule_options_every_v_dividing_layers_per_rank():
    """1F1B plus interleaved for every V >= 2 dividing the layers per rank, each with every group size."""
    options = schedule_options(2, 12, 4)  # 6 layers per rank: V in 2, 3, 6
    assert (1, None) in options
    assert sorted({v for v, _ in options}) == [1, 2, 3, 6]
    assert [g for v, g in options if v == 3] == group_sizes(2, 4)
    with pytest.raises(ValueError, match="multiple of --pipeline-model-parallel-size"):
        schedule_options(3, 8, 4)


def test_recompute_options_and_flags():
    """Every module set (no layernorm with TE), block and uniform for every k, with Megatron's exact flags."""
    local = recompute_options(3)
    assert len(local) == 1 + 7 + 3 + 3
    assert len(recompute_options(3, "te")) == 1 + 3 + 3 + 3
    assert StockRecompute().flags() == []
    assert StockRecompute("selective").flags() == ["--recompute-granularity", "selective"]
    assert StockRecompute("selective", ("core_attn", "mlp")).flags() == [
        "--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp"]
    assert StockRecompute("full", method="block", num_layers=2).flags() == [
        "--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"]
    setting = StockSetting(4, 2, 16, 8, StockRecompute("selective"), grad_reduce_in_bf16=True)
    assert setting.flags() == ["--pipeline-model-parallel-size", "4", "--num-virtual-stages-per-pipeline-rank", "2",
                               "--microbatch-group-size-per-virtual-pipeline-stage", "8",
                               "--recompute-granularity", "selective", "--grad-reduce-in-bf16"]
    assert StockSetting(4, 1, 16).flags() == ["--pipeline-model-parallel-size", "4"]
    with pytest.raises(ValueError, match="recompute-method"):
        StockRecompute("full")
    with pytest.raises(ValueError, match="recompute-modules"):
        StockRecompute("selective", ("moe_act",))


def test_offload_flags_and_refusals():
    """Megatron's exact offloading flags; full recomputation and non-TE layer specs are refused by name."""
    from megatron_pipemesh.planning.memory import offloadable_layer_bytes
    from megatron_pipemesh.planning.costs import activation_shape

    setting = StockSetting(2, 2, 8, 4, StockRecompute("selective", ("mlp",)), offload=StockOffload(0.5))
    assert setting.flags()[-6:] == ["--offload-modules", "qkv_linear", "core_attn", "attn_proj",
                                    "--activation-offload-fraction", "0.5"]
    assert StockOffload().flags() == ["--fine-grained-activation-offloading", "--offload-modules", "qkv_linear",
                                      "core_attn", "attn_proj"]
    with pytest.raises(ValueError, match="recompute-granularity full"):
        StockSetting(2, 2, 8, 4, StockRecompute("full", method="block", num_layers=1), offload=StockOffload())
    with pytest.raises(ValueError, match="activation-offload-fraction"):
        StockOffload(0.0)
    with pytest.raises(ValueError, match="transformer_engine"):
        offloadable_layer_bytes(activation_shape(MODEL, CLUSTER))
