"""`integration/profile.py`: how a profile measures what each piece keeps for the backward (the end-to-end runs are in
tests/cli/test_profile.py)."""
import pytest

from megatron_pipemesh.schedule.levers import BASIC_LEVERS


class FakeCudaAllocator:
    """A stand-in of the CUDA caching allocator's ``memory_allocated`` on CPU: the bytes of every storage an op
    made while inside (a dispatch mode sees every op of the forward and backward) that is still alive."""

    def __init__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        allocator = self
        self.live = {}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                allocator._saw(out)
                return out

        self.mode = Mode()
        self.torch = torch

    def _saw(self, out) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._pytree import tree_flatten

        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, self.torch.Tensor) and tensor.device.type == "cpu":
                ref = StorageWeakRef(tensor.untyped_storage())
                known = self.live.get(ref.cdata)
                if known is None or known[0].expired():
                    self.live[ref.cdata] = (ref, tensor.untyped_storage().nbytes())

    def memory_allocated(self) -> int:
        return sum(nbytes for ref, nbytes in self.live.values() if not ref.expired())


def _layer_pieces(args, levels):
    """The profile's layer models (one per recompute level) and its embedding + output model, with main_grads."""
    from megatron_pipemesh.integration import profile

    settings = profile.ProfileSettings(warmup=1, repeats=1)
    layers = {str(level): profile._gpt(profile._level_args(args, str(level)), "local", settings, False, False, False)
              for level in levels}
    ends = profile._gpt(profile._level_args(args, "none"), "local", settings, False, True, True)
    excluded = [t for model, _ in layers.values() for t in profile._with_main_grads(model)]
    excluded += profile._with_main_grads(ends[0])
    return settings, layers, ends[0], ends[1].params_dtype, excluded


def test_bytes_kept_read_from_the_allocator_agree_with_the_saved_tensor_meter(megatron, monkeypatch):
    """On CUDA the kept bytes are the allocator's count across the metered forward less its output. Nothing the
    previous call left (its output and graph, a layer's input clone and that clone's gradient) may be freed inside
    that window, or each layer reads about three activations low, full recomputation and the embedding clamp to 0
    and the output layer reads two activations low. With the allocator's counters faked on CPU, every piece's
    reading is the saved-tensor meter's within 5% (the meter counts what autograd saves; the allocator also the
    forward's other kept bytes, none here beyond a few small vectors)."""
    import torch

    from megatron_pipemesh.integration import profile

    settings, layers, ends, dtype, excluded = _layer_pieces(megatron, BASIC_LEVERS)
    timer = profile._Timer(False)
    cpu = torch.device("cpu")

    mask = profile._attention_mask(megatron, cpu)

    def point():
        return profile._point(2, megatron.seq_length, megatron.hidden_size, megatron.padded_vocab_size, layers,
                              ends, dtype, cpu, timer, settings, excluded, lambda line: None, mask)

    metered = point()
    fake = FakeCudaAllocator()
    monkeypatch.setattr(profile, "_allocated_bytes", fake.memory_allocated)
    with fake.mode:
        allocated = point()
    activation = 2 * megatron.seq_length * megatron.hidden_size * 4
    assert metered.embedding_activation_bytes > 0 and metered.layer_activation_bytes["full"] >= activation
    # The meter also counts the attention mask that full recomputation saves with the layer's input: a tensor of
    # every call, made before the window, which the allocator rightly does not count (s x s bool).
    mask = megatron.seq_length ** 2
    for level in map(str, BASIC_LEVERS):
        assert allocated.layer_activation_bytes[level] == pytest.approx(
            metered.layer_activation_bytes[level] - (mask if level == "full" else 0), rel=0.05), level
    assert allocated.embedding_activation_bytes == pytest.approx(metered.embedding_activation_bytes, rel=0.05)
    assert allocated.output_activation_bytes == pytest.approx(metered.output_activation_bytes, rel=0.05)


def test_bytes_of_an_output_are_summed_over_whatever_the_forward_returns():
    """Without CUDA there is no allocator reading (the meter counts); the output's bytes, taken off the allocator's
    count on CUDA, are summed over whatever the forward returns."""
    import torch

    from megatron_pipemesh.integration.profile import _allocated_bytes, _tensor_bytes

    if not torch.cuda.is_available():
        assert _allocated_bytes() is None
    x = torch.zeros(3, 4)
    assert _tensor_bytes(x) == 48
    assert _tensor_bytes((x, [x.double()], {"a": x[:1]}, None)) == 48 + 96 + 16


def test_the_optimizer_is_measured_as_the_command_builds_it(one_rank, monkeypatch):
    """--use-distributed-optimizer: the step timed is the distributed optimizer's (not a plain optimizer standing in
    for it), over groups of this rank alone, so that its shard is every parameter and it gathers nothing."""
    from megatron.core import optimizer as mcore_optimizer

    from megatron_pipemesh.integration import profile
    from tests.integration.conftest import TINY, profile_args_of

    built = []
    real = mcore_optimizer.get_megatron_optimizer

    def spy(config, chunks, **kwargs):
        built.append((config, kwargs.get("pg_collection")))
        return real(config, chunks, **kwargs)

    monkeypatch.setattr(mcore_optimizer, "get_megatron_optimizer", spy)
    args = profile_args_of(TINY.split() + ["--use-distributed-optimizer"])
    seconds = profile._optimizer_s_per_param(args, "local", profile.ProfileSettings(warmup=1, repeats=1), False)
    (config, groups), = built
    assert seconds > 0 and config.use_distributed_optimizer
    assert groups is not None and groups.dp.size() == 1


def test_an_optimizer_megatron_refuses_here_stops_the_profile_before_it_measures(monkeypatch):
    """--use-precision-aware-optimizer needs the distributed optimizer (the command has it) and Transformer Engine's
    FusedAdam (this machine has none): the profile says so before measuring anything, instead of every rank
    failing in the optimizer after rank 0 measured everything else."""
    from megatron_pipemesh.integration import profile
    from megatron_pipemesh.integration.megatron_command import CommandError
    from tests.integration.conftest import TINY

    lines = []
    with pytest.raises(CommandError, match="--use-precision-aware-optimizer requires FusedAdam from TransformerEngine"):
        profile.measure_profile(TINY.split() + ["--use-distributed-optimizer", "--use-precision-aware-optimizer"],
                                profile.ProfileSettings(warmup=1, repeats=1), progress=lines.append)
    assert lines == []


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

    from megatron_pipemesh.integration import profile
    from tests.integration.conftest import TINY, profile_args_of

    args = profile_args_of(TINY.split() + ([flag] if flag else []))
    settings, layers, ends, dtype, excluded = _layer_pieces(args, BASIC_LEVERS[:1])
    seen = []
    model = layers["none"][0]
    model.register_forward_pre_hook(lambda module, positional, named: seen.append(named.get("attention_mask")),
                                    with_kwargs=True)
    squares = _SquareFloats(args.seq_length)
    cpu = torch.device("cpu")
    with squares.mode:  # (Megatron's own causal mask, where it makes one, is Megatron's: not counted)
        mask = profile._attention_mask(args, cpu)
    profile._point(1, args.seq_length, args.hidden_size, args.padded_vocab_size, layers, ends, dtype, cpu,
                   profile._Timer(False), settings, excluded, lambda line: None, mask)
    assert squares.found == [] and seen
    if flag:
        assert all(m is None for m in seen)
    else:
        assert all(m.dtype == torch.bool and tuple(m.shape) == (1, 1, args.seq_length, args.seq_length)
                   for m in seen)
        assert bool(seen[0][0, 0, 0, 1]) and not bool(seen[0][0, 0, 1, 0])  # the future is masked
