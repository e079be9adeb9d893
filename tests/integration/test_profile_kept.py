"""`integration/profile_kept.py`: what each piece keeps for its backward, from the CUDA allocator's counters (faked
here) and from the saved-tensor meter."""
import pytest

from megatron_pipemesh.schedule.levers import BASIC_LEVERS
from tests.integration.conftest import layer_pieces


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


def test_bytes_kept_read_from_the_allocator_agree_with_the_saved_tensor_meter(megatron, monkeypatch):
    """On CUDA the kept bytes are the allocator's count across the metered forward less its output. Nothing the
    previous call left (its output and graph, a layer's input clone and that clone's gradient) may be freed inside
    that window, or each layer reads about three activations low, full recomputation and the embedding clamp to 0
    and the output layer reads two activations low. With the allocator's counters faked on CPU, every piece's
    reading is the saved-tensor meter's within 5% (the meter counts what autograd saves; the allocator also the
    forward's other kept bytes, none here beyond a few small vectors)."""
    import torch

    from megatron_pipemesh.integration import profile_kept
    from megatron_pipemesh.integration.profile_pieces import attention_mask, point
    from megatron_pipemesh.integration.profile_timing import Timer

    settings, layers, ends, dtype, exclude = layer_pieces(megatron, BASIC_LEVERS)
    cpu = torch.device("cpu")
    mask = attention_mask(megatron, cpu)

    def measured():
        return point(2, megatron.seq_length, megatron.hidden_size, megatron.padded_vocab_size, layers, ends, dtype,
                     cpu, Timer(False), settings, exclude, lambda line: None, mask)

    metered = measured()
    fake = FakeCudaAllocator()
    monkeypatch.setattr(profile_kept, "allocated_bytes", fake.memory_allocated)
    with fake.mode:
        allocated = measured()
    activation = 2 * megatron.seq_length * megatron.hidden_size * 4
    assert metered.embedding_activation_bytes > 0 and metered.layer_activation_bytes["full"] >= activation
    # The meter also counts the attention mask that full recomputation saves with the layer's input: a tensor of
    # every call, made before the window, which the allocator rightly does not count (s x s bool).
    mask_bytes = megatron.seq_length ** 2
    for level in map(str, BASIC_LEVERS):
        assert allocated.layer_activation_bytes[level] == pytest.approx(
            metered.layer_activation_bytes[level] - (mask_bytes if level == "full" else 0), rel=0.05), level
    assert allocated.embedding_activation_bytes == pytest.approx(metered.embedding_activation_bytes, rel=0.05)
    assert allocated.output_activation_bytes == pytest.approx(metered.output_activation_bytes, rel=0.05)


def test_bytes_of_an_output_are_summed_over_whatever_the_forward_returns():
    """Without CUDA there is no allocator reading (the meter counts); the output's bytes, taken off the allocator's
    count on CUDA, are summed over whatever the forward returns."""
    import torch

    from megatron_pipemesh.integration.profile_kept import allocated_bytes, tensor_bytes

    if not torch.cuda.is_available():
        assert allocated_bytes() is None
    x = torch.zeros(3, 4)
    assert tensor_bytes(x) == 48
    assert tensor_bytes((x, [x.double()], {"a": x[:1]}, None)) == 48 + 96 + 16
