"""Unit tests of the host-placement mechanism (runtime/offload.py) on CPU; plain torch, no processes."""
import pytest
import torch

from megatron_pipemesh.runtime.memory import SavedTensorMeter
from megatron_pipemesh.runtime.offload import ActivationOffloader, OffloadError


def _layer():
    torch.manual_seed(0)
    return torch.nn.Linear(32, 32), torch.randn(16, 32)


def _forward(linear, x):
    h = linear(x).relu()                        # saves x (weight grad) and h (relu output)
    view = h[:, :4]                              # a view of h's storage, saved again by the product
    return (h.exp() * h).sum() + (view * view).sum()


def _grads(linear):
    return [p.grad.clone() for p in linear.parameters()]


def test_offload_reload_gives_same_grads_and_moves_each_storage_once():
    """Saved tensors go to host and back (views deduplicated, parameters stay) with identical gradients."""
    linear, x = _layer()
    _forward(linear, x).backward()
    reference = _grads(linear)
    linear.zero_grad()
    offloader, meter = ActivationOffloader(torch.device("cpu")), SavedTensorMeter(linear.parameters())
    offloader.begin(linear.parameters(), meter)
    with meter.record("a", inner=offloader.hooks("a")):
        loss = _forward(linear, x)
    saved = meter.saved_bytes["a"]
    assert saved == 3 * 16 * 32 * 4  # x, h, exp(h): the view and the weight add nothing
    assert offloader.offload("a") == saved
    assert meter.live_bytes == 0 and meter.host_bytes == offloader.host_bytes == saved
    assert offloader.reload("a") == saved
    assert meter.live_bytes == saved and meter.host_bytes == 0
    offloader.wait("a")
    loss.backward()
    offloader.release("a")
    meter.release("a")
    assert all(torch.equal(a, b) for a, b in zip(reference, _grads(linear)))
    assert meter.peak_host_bytes == offloader.peak_host_bytes == saved and meter.live_bytes == 0


def test_kept_tensors_stay_on_the_device():
    """Tensors the caller keeps (the chunk input) are not copied."""
    linear, x = _layer()
    offloader = ActivationOffloader(torch.device("cpu"))
    offloader.begin(linear.parameters())
    with torch.autograd.graph.saved_tensors_hooks(*offloader.hooks("a")):
        loss = _forward(linear, x)
    assert offloader.offload("a", keep=(x, None)) == 2 * 16 * 32 * 4
    offloader.reload("a")
    loss.backward()


def test_pool_reuses_host_buffers_across_iterations():
    """After the first iteration no host buffer is allocated again."""
    linear, x = _layer()
    offloader = ActivationOffloader(torch.device("cpu"))
    allocations = []
    for _ in range(3):
        offloader.begin(linear.parameters())
        losses = []
        for key in range(2):
            with torch.autograd.graph.saved_tensors_hooks(*offloader.hooks(key)):
                losses.append(_forward(linear, x))
            offloader.offload(key)
        for key in range(2):
            offloader.reload(key)
            losses[key].backward()
            offloader.release(key)
        allocations.append(offloader.pool.allocations)
    assert allocations[0] == 6 and allocations == [6, 6, 6]


def test_wrong_order_and_unknown_keys_raise():
    """Reload before offload, unknown keys, double capture and a backward on host tensors raise clearly."""
    linear, x = _layer()
    offloader = ActivationOffloader(torch.device("cpu"))
    offloader.begin(linear.parameters())
    with pytest.raises(OffloadError, match="no captured activations"):
        offloader.offload((0, 3))
    with torch.autograd.graph.saved_tensors_hooks(*offloader.hooks("a")):
        loss = _forward(linear, x)
    with pytest.raises(OffloadError, match="already captured"):
        offloader.hooks("a")
    with pytest.raises(OffloadError, match="state 'device', expected 'host'"):
        offloader.reload("a")
    offloader.offload("a")
    with pytest.raises(OffloadError, match="still in host memory"):
        loss.backward()
    with pytest.raises(OffloadError, match="state 'host', expected 'reloaded'"):
        offloader.wait("a")
    offloader.clear()
    assert offloader.host_bytes == 0


def test_swapped_input_leaves_with_its_storage_and_comes_back():
    """A swapped tensor (the chunk input) is emptied while offloaded and restored as the same leaf; its grad is right."""
    linear, x = _layer()
    x.requires_grad_(True)
    _forward(linear, x).backward()
    reference = x.grad.clone()
    x.grad = None
    offloader = ActivationOffloader(torch.device("cpu"))
    offloader.begin(linear.parameters())
    with torch.autograd.graph.saved_tensors_hooks(*offloader.hooks("a")):
        loss = _forward(linear, x)
    assert offloader.offload("a", swap=(x,)) == 3 * 16 * 32 * 4
    assert x.numel() == 0  # its storage left with the saved tensors
    offloader.reload("a")
    assert x.shape == (16, 32)
    loss.backward()
    assert torch.equal(x.grad, reference)
