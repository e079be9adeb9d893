"""`integration/profile_pieces.py`: the compute pieces the profile measures and what they are given."""
import pytest

from megatron_pipemesh.schedule.levers import BASIC_LEVERS
from tests.integration.conftest import TINY, layer_pieces, profile_args_of


class _SquareFloats:
    """Records every s x s floating-point tensor an op makes while inside (what a mask built through fp32 makes)."""

    def __init__(self, s: int):
        from torch.utils._python_dispatch import TorchDispatchMode

        found = self.found = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if getattr(out, "shape", None) == (s, s) and out.is_floating_point():
                    found.append(str(func))
                return out

        self.mode = Mode()


@pytest.mark.parametrize("flag", [None, "--no-create-attention-mask-in-dataloader"])
def test_the_layers_get_the_mask_the_commands_loader_makes_and_nothing_bigger(one_rank, flag):
    """With the loader's mask (Megatron's default) the layers get a boolean 1 x 1 x s x s mask made without an s x s
    float on the way (through fp32 ``tril`` a 128k sequence took 128 GiB of device memory and left the profile
    with no point); with --no-create-attention-mask-in-dataloader they get none, as in training (Megatron's
    attention masks causally itself). The pieces see what the measurement passes."""
    import torch

    from megatron_pipemesh.integration.profile_pieces import attention_mask, point
    from megatron_pipemesh.integration.profile_timing import Timer

    args = profile_args_of(TINY.split() + ([flag] if flag else []))
    settings, layers, ends, dtype, exclude = layer_pieces(args, BASIC_LEVERS[:1])
    seen = []
    model = layers["none"][0]
    model.register_forward_pre_hook(lambda module, positional, named: seen.append(named.get("attention_mask")),
                                    with_kwargs=True)
    squares = _SquareFloats(args.seq_length)
    cpu = torch.device("cpu")
    with squares.mode:  # (Megatron's own causal mask, where it makes one, is Megatron's: not counted)
        mask = attention_mask(args, cpu)
    point(1, args.seq_length, args.hidden_size, args.padded_vocab_size, layers, ends, dtype, cpu, Timer(False),
          settings, exclude, lambda line: None, mask)
    assert squares.found == [] and seen
    if flag:
        assert all(m is None for m in seen)
    else:
        assert all(m.dtype == torch.bool and tuple(m.shape) == (1, 1, args.seq_length, args.seq_length)
                   for m in seen)
        assert bool(seen[0][0, 0, 0, 1]) and not bool(seen[0][0, 0, 1, 0])  # the future is masked
