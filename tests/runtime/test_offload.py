"""Unit tests of the host-placement mechanism (runtime/offload.py) on CPU; plain torch, no processes."""
import pytest
import torch

from megatron_pipemesh.runtime.memory import SavedTensorMeter
from megatron_pipemesh.runtime.offload import ActivationOffloader, HostBufferPool, OffloadError


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
    """After the first iteration no host buffer is allocated again (one block per chunk-micro-batch)."""
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
    assert allocations[0] == 2 and allocations == [2, 2, 2]


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


class _FusedWgrad(torch.autograd.Function):
    """Megatron's gradient-accumulation fusion in miniature: saves the weight Parameter and, in the backward,
    accumulates its gradient into ``weight.main_grad`` (and returns none), as ``LinearWithGradAccumulation...``
    and Transformer Engine's linears do."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        _FusedWgrad.seen = weight
        weight.main_grad += grad.t() @ x  # AttributeError on anything but the Parameter
        return grad @ weight, None


def test_saved_parameter_reaches_the_backward_as_itself():
    """A Parameter saved by a host-placed forward comes back to the backward as the same object with its
    attributes (``main_grad``), through OFFLOAD and RELOAD, and is never copied to the host; the activation
    does travel and the gradient is right. (Under default saved-tensor hooks autograd hands the backward a new
    plain tensor instead: the offloader hooks only the saved tensors it moves, found in the output's graph.)"""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(8, 4))
    weight.main_grad = torch.zeros(8, 4)
    x = torch.randn(5, 4, requires_grad=True)
    offloader = ActivationOffloader(torch.device("cpu"))
    offloader.begin([weight])
    offloader.hooks("a")  # the executor's capture of a host-placed key: no default hooks around the forward
    out = _FusedWgrad.apply(x * 2, weight)
    assert offloader.offload("a", keep=(out,), roots=(out,)) == 5 * 4 * 4  # x * 2 only
    offloader.reload("a")
    offloader.wait("a")
    (out * out).sum().backward()
    assert _FusedWgrad.seen is weight and isinstance(_FusedWgrad.seen, torch.nn.Parameter)
    assert torch.allclose(weight.main_grad, (2 * out).t() @ (x.detach() * 2))


def test_parameter_storage_reallocated_after_begin_stays_on_the_device():
    """A ZeRO-3 chunk's parameter buffer is freed and re-allocated (a new address) after ``begin`` by the
    sharding runtime: a saved view of it (here ``weight.t()``, which a matmul saves) must still not be copied."""
    buffer = torch.arange(32, dtype=torch.float32)
    weight = torch.nn.Parameter(buffer[:32].view(8, 4))
    offloader = ActivationOffloader(torch.device("cpu"))
    offloader.begin([weight])
    storage = weight.untyped_storage()
    address = storage.data_ptr()
    storage.resize_(0)                 # RELEASE at the program's start
    storage.resize_(32 * 4)            # GATHER: the same storage at a new address
    weight.data.copy_(torch.arange(32, dtype=torch.float32).view(8, 4))
    x = torch.randn(5, 4, requires_grad=True)
    offloader.hooks("a")
    loss = (torch.mm(x, weight.t()) ** 2).sum()
    print("parameter buffer address before/after the re-allocation", address, storage.data_ptr())
    moved = offloader.offload("a", keep=(loss,), roots=(loss,))
    offloader.reload("a")
    loss.backward()
    assert moved == 5 * 4 * 4 + 5 * 8 * 4  # x and the product, never the 128-byte parameter buffer


def test_host_blocks_are_counted_at_the_size_the_pinned_allocator_takes():
    """Torch's caching host allocator rounds every pinned block up to a power of two: the pool asks for exactly that
    size (so its count is the real pinned memory), serves any request of the class from it, and the offloader
    packs a key's storages into one such block and counts it. (Pinning needs CUDA; the size policy is the same.)"""
    pool = HostBufferPool(pin=False)
    block, event = pool.acquire(3000)
    assert block.numel() == 4096 and event is None and pool.allocated_bytes == 4096
    pool.release(block, "copy done")
    again, event = pool.acquire(2500)  # the same class: the same block, with the event of its last reader
    assert again is block and event == "copy done" and (pool.allocations, pool.allocated_bytes) == (1, 4096)
    pool.acquire(4097)
    assert pool.allocated_bytes == 4096 + 8192

    linear, x = _layer()
    offloader = ActivationOffloader(torch.device("cpu"))
    offloader.begin(linear.parameters())
    with torch.autograd.graph.saved_tensors_hooks(*offloader.hooks("a")):
        loss = _forward(linear, x)
    assert offloader.offload("a") == 3 * 16 * 32 * 4  # 6144 bytes of activations ...
    assert offloader.block_bytes == offloader.peak_block_bytes == offloader.pool.allocated_bytes == 8192  # ... in 8 KiB
    offloader.reload("a")
    loss.backward()
    assert offloader.block_bytes == 0 and offloader.peak_block_bytes == 8192


def test_a_reserved_pool_allocates_nothing_inside_offload():
    """The blocks a program needs, allocated up front (the executor does it at the schedule's start), serve every
    OFFLOAD: no allocation happens inside one, in the first call or later; a reservation is idempotent."""
    linear, x = _layer()
    offloader = ActivationOffloader(torch.device("cpu"))
    assert offloader.reserve({8192: 2}) == 2 * 8192 and offloader.reserve({8192: 2}) == 0
    for _ in range(2):
        offloader.begin(linear.parameters())
        losses = []
        for key in range(2):
            with torch.autograd.graph.saved_tensors_hooks(*offloader.hooks(key)):
                losses.append(_forward(linear, x))
            offloader.offload(key)  # 6144 bytes each: the 8 KiB class
        for key in range(2):
            offloader.reload(key)
            losses[key].backward()
            offloader.release(key)
    assert (offloader.pool.allocations, offloader.pool.late_allocations) == (2, 0)


def test_a_block_priced_too_large_still_serves_and_one_priced_too_small_is_counted():
    """A key smaller than its reserved block takes the block (no new allocation); one larger than every free block
    is allocated inside the OFFLOAD and counted, so the executor can say the plan under-priced it."""
    pool = HostBufferPool(pin=False)
    pool.reserve({8192: 1})
    block, _ = pool.acquire(3000)  # class 4096: served by the free 8 KiB block
    assert block.numel() == 8192 and (pool.allocations, pool.late_allocations) == (1, 0)
    pool.release(block)
    pool.acquire(9000)
    assert (pool.allocations, pool.late_allocations, pool.allocated_bytes) == (2, 1, 8192 + 16384)


def test_a_failing_pinned_allocation_names_the_sizes(monkeypatch):
    """The pool's allocation failing (no pinnable memory left) is an error naming the block and the pool's size."""
    pool = HostBufferPool(pin=False)
    pool.reserve({4096: 1})

    def empty(*args, **kwargs):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(torch, "empty", empty)
    with pytest.raises(OffloadError, match=r"host block of 0\.0 MiB .* holds 0\.00 GiB in 1 blocks.*out of memory"):
        pool.reserve({4096: 2})
