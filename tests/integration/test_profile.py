"""`integration/profile.py`: how a profile measures what each op keeps for the backward (the end-to-end runs are in
tests/cli/test_profile.py)."""


def test_bytes_kept_come_from_the_allocator_on_cuda_and_the_meter_on_cpu():
    """Without CUDA there is no allocator reading (the meter counts); the output's bytes, taken off the allocator's
    count on CUDA, are summed over whatever the forward returns."""
    import torch

    from megatron_pipemesh.integration.profile import _allocated_bytes, _tensor_bytes

    if not torch.cuda.is_available():
        assert _allocated_bytes() is None
    x = torch.zeros(3, 4)
    assert _tensor_bytes(x) == 48
    assert _tensor_bytes((x, [x.double()], {"a": x[:1]}, None)) == 48 + 96 + 16
