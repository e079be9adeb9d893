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


def _measure_tiny(monkeypatch, built):
    """measure_compute of TINY (sizes 1 and 2), every model it builds recorded (weak references) in ``built``."""
    import weakref

    from megatron_pipemesh.integration import profile_pieces
    from megatron_pipemesh.integration.profile import ProfileSettings, command_args

    real = profile_pieces.gpt

    def recording(*args, **kwargs):
        model, config = real(*args, **kwargs)
        built.append(weakref.ref(model))
        return model, config

    monkeypatch.setattr(profile_pieces, "gpt", recording)
    args, planned, _ = command_args(TINY.split(), False)
    notes = []
    points = profile_pieces.measure_compute(args, planned.model, "local", ProfileSettings(warmup=1, repeats=1, max_seconds=0.0), False,
                                            lambda line: None, notes)
    return points, notes


def test_the_step_overhead_chunks_are_built_once_the_layer_models_are_gone(one_rank, monkeypatch):
    """The four one-layer chunks the step overhead times (two with the embedding, two with the output layer, each
    with fp32 main_grads) are built after the layer models and the embedding-and-output model of the pieces are
    freed: with a large vocabulary both sets at once ran rank 0 out of memory after everything else was measured."""
    import gc

    from megatron_pipemesh.integration import profile_pieces

    built, alive = [], []
    real = profile_pieces.one_layer_chunks

    def chunks(args, build):
        gc.collect()
        alive.append(sum(ref() is not None for ref in built))
        return real(args, build)

    monkeypatch.setattr(profile_pieces, "one_layer_chunks", chunks)
    points, notes = _measure_tiny(monkeypatch, built)
    assert len(built) >= 4 + 1 + 1 and alive == [0]  # levels + ends before, none of them alive at the chunks
    assert [p.micro_batch_size for p in points] == [1, 2] and all(p.step_forward_s for p in points)


def test_a_step_overhead_out_of_memory_keeps_the_points_and_says_so(one_rank, monkeypatch):
    """Where the chunks of every kind do not fit the device, the measured points stay (the schedule step priced at
    0) and a note says why, instead of the profile failing after everything else was measured."""
    import torch

    from megatron_pipemesh.integration import profile_steps

    def no_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB")

    monkeypatch.setattr(profile_steps, "measure_step_overhead", no_memory)
    points, notes = _measure_tiny(monkeypatch, [])
    assert [p.micro_batch_size for p in points] == [1, 2] and not any(p.step_forward_s for p in points)
    assert any(note.startswith("the schedule step beyond the pieces was not measured: out of device memory")
               and "plans price it at 0" in note for note in notes)


def test_a_moe_commands_layers_average_its_moe_and_dense_layers_as_the_cost_model_does():
    """Per level, forward, backward (round by round) and kept bytes are the MoE layer's share of the MoE layer's
    and the rest the dense layer's; a level whose dense layer was not timed keeps the MoE layer's."""
    from megatron_pipemesh.integration.profile_pieces import DENSE, Timed, _mixed

    times = {"none": Timed((4.0, 8.0), (8.0, 4.0), 100, True), "none" + DENSE: Timed((2.0, 4.0), (4.0, 2.0), 60, False),
             "full": Timed((1.0,), (2.0,), 10, True)}
    mixed = _mixed(times, 0.25)
    assert mixed == {"none": Timed((2.5, 5.0), (5.0, 2.5), 70.0, False), "full": times["full"]}


def test_a_levels_extra_is_its_timed_recomputation_else_the_rounds_difference():
    """A level whose backward's forwards were timed: its extra is those samples, not the ~25-50 ms totals' difference
    (whose noise would be most of it); without them (nothing timed, or all 0) the same round's difference."""
    from megatron_pipemesh.integration.profile_pieces import Timed

    none = Timed((10.0, 11.0), (20.0, 19.0), 0.0, True)
    timed = Timed((10.5, 10.0), (24.0, 26.0), 0.0, True, (3.1, 3.0))
    assert timed.recompute_extra(none) == (3.1, 3.0)
    for recomputed in ((), (0.0, 0.0)):
        untimed = Timed((10.5, 10.0), (24.0, 26.0), 0.0, True, recomputed)
        assert untimed.recompute_extra(none) == (4.5, 6.0)
