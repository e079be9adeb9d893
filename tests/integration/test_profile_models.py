"""`integration/profile_models.py`: Megatron's models of the command as one process builds them for the profile."""
import pytest

from tests.integration.conftest import TINY, layer_pieces, profile_args_of


@pytest.mark.parametrize("flag, dtype", [("--bf16", "bfloat16"), ("--fp16", "float16")])
def test_a_16_bit_command_is_measured_in_16_bits_as_float16module_casts_it(one_rank, flag, dtype):
    """Megatron's Float16Module casts the whole model in training; built from the config alone the local spec's
    norms stayed fp32 and the first layer's fp32 output met a 16-bit weight (the profile of any --bf16 command with
    the local spec failed). Every parameter is 16-bit and the pieces run at both ends."""
    import torch

    from megatron_pipemesh.integration.profile_pieces import attention_mask, point
    from megatron_pipemesh.integration.profile_timing import Timer

    args = profile_args_of(TINY.split() + [flag])
    settings, layers, ends, params_dtype, exclude = layer_pieces(args, ["none"])
    wanted = getattr(torch, dtype)
    assert params_dtype == wanted
    assert {p.dtype for model, _ in layers.values() for p in model.parameters()} == {wanted}
    assert {p.dtype for p in ends.parameters()} == {wanted}
    cpu = torch.device("cpu")
    found = point(1, args.seq_length, args.hidden_size, args.padded_vocab_size, layers, ends, params_dtype, cpu,
                  Timer(False), settings, exclude, lambda line: None, attention_mask(args, cpu))
    assert found.layer_activation_bytes["none"] > 0 and found.output_forward_s > 0


def test_a_moe_commands_layer_is_a_moe_layer_and_its_dense_layer_is_not(one_rank):
    """level_args of a MoE command builds one MoE layer (whatever --moe-layer-freq says of the first), with
    ``dense`` the command's dense layer; both with every expert on the one rank (EP 1)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_pipemesh.integration.profile import ProfileSettings
    from megatron_pipemesh.integration.profile_models import gpt, level_args

    args = profile_args_of(TINY.split() + ["--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq",
                                           "[0,1]", "--expert-model-parallel-size", "2", "--disable-bias-linear"])
    assert args.expert_model_parallel_size == 1
    settings = ProfileSettings(warmup=1, repeats=1)

    def mlps(dense):
        model, _ = gpt(level_args(args, "none", dense), "local", settings, False, False, False)
        return [type(layer.mlp) for layer in model.decoder.layers]

    assert mlps(False) == [MoELayer]
    assert len(mlps(True)) == 1 and mlps(True)[0] is not MoELayer
