"""Unit tests of the saved-tensor meter (runtime/memory.py); plain torch, no processes."""
import gc
import weakref

import torch

from megatron_pipemesh.runtime.memory import AllocatorMeter, SavedTensorMeter, make_memory_meter


def _bytes(t):
    return t.untyped_storage().nbytes()


def test_same_storage_saved_twice_counts_once():
    """A storage saved several times (and its views) counts once."""
    x = torch.randn(64, 32, requires_grad=True)
    meter = SavedTensorMeter()
    with meter.record("a"):
        y = x.exp()          # saves its output y
        z = (y * y).sum()    # saves y twice more
        w = y[:8].sin()      # a view of y's storage
    assert meter.saved_bytes["a"] == _bytes(y)
    assert meter.live_bytes == meter.peak_bytes == _bytes(y)
    (z + w.sum()).backward()


def test_parameters_and_their_views_are_not_activations():
    """Registered parameters and their views do not count; inputs saved for weight gradients do."""
    linear = torch.nn.Linear(32, 16)
    x = torch.randn(8, 32)  # an input without grad is still saved by the weight's backward
    meter = SavedTensorMeter(linear.parameters())
    with meter.record("a"):
        y = linear(x)
        v = (x @ linear.weight.t()).relu()   # a view of the weight, saved by matmul
        p = linear.bias * linear.bias         # the Parameter object itself, saved twice
    # Only x (saved for the weight gradient) and the relu output count.
    assert meter.saved_bytes["a"] == _bytes(x) + _bytes(v)
    (y.sum() + v.sum() + p.sum()).backward()


def test_parameter_objects_excluded_without_being_registered():
    """Parameter objects never count, even when not registered."""
    weight = torch.nn.Parameter(torch.randn(16, 16))
    meter = SavedTensorMeter()
    with meter.record("a"):
        out = (weight * weight).sum()
    assert meter.saved_bytes["a"] == 0
    out.backward()


def test_release_frees_key_and_keeps_peak():
    """Releasing a key frees its bytes while the peak is kept."""
    x = torch.randn(128, requires_grad=True)
    meter = SavedTensorMeter()
    with meter.record((0, 0)):
        a = x.exp()
    with meter.record((0, 1)):
        b = x.sigmoid()
    assert meter.live_bytes == 2 * 512 and meter.live_keys() == ((0, 0), (0, 1))
    a.sum().backward()
    meter.release((0, 0))
    assert meter.live_bytes == 512
    b.sum().backward()
    meter.release((0, 1))
    assert meter.live_bytes == 0 and meter.peak_bytes == 2 * 512
    assert meter.saved_bytes == {(0, 0): 512, (0, 1): 512}


def test_storage_shared_by_two_keys_is_live_once():
    """A storage saved under two keys is live once, until both keys are released."""
    x = torch.randn(256, requires_grad=True)
    h = x * 1.0  # one storage, saved by both keys
    meter = SavedTensorMeter()
    with meter.record("a"):
        a = h * h
    with meter.record("b"):
        b = h.sin()
    assert meter.saved_bytes == {"a": 1024, "b": 1024}
    assert meter.live_bytes == 1024
    meter.release("a")
    assert meter.live_bytes == 1024
    meter.release("b")
    assert meter.live_bytes == 0
    (a.sum() + b.sum()).backward()


def test_saved_tensors_of_a_dropped_graph_stop_counting():
    """Tensors saved by a graph dropped during the forward stop counting."""
    x = torch.randn(1000, requires_grad=True)
    meter = SavedTensorMeter()
    with meter.record("a"):
        y = x.exp().sum()
        del y  # the graph (and what it saved) is gone before the forward ends
        z = x.sin()
    assert meter.saved_bytes["a"] == _bytes(x)  # sin saves its input x; exp's output is gone
    assert meter.live_bytes == meter.peak_bytes == _bytes(x)
    z.sum().backward()


def test_meter_does_not_keep_memory_alive_or_change_gradients():
    """The meter keeps no tensor alive (no reference cycle) and leaves gradients unchanged."""
    torch.manual_seed(0)
    x = torch.randn(64, 64, requires_grad=True)

    def run(meter):
        x.grad = None
        with meter.record("a") if meter else torch.enable_grad():
            y = x.exp()      # saved output: hooks that returned it would make a reference cycle
            out = (y.tanh() * y).sum()
        ref = weakref.ref(y)
        out.backward()
        del y, out
        return x.grad.clone(), ref

    gc.disable()
    try:
        plain, _ = run(None)
        measured, ref = run(SavedTensorMeter())
        assert ref() is None  # freed by reference counting alone
    finally:
        gc.enable()
    assert torch.equal(plain, measured)


def test_track_and_untrack_runtime_held_outputs():
    """Tracked outputs are live until untracked or released, and the peak keeps them."""
    x = torch.randn(100, requires_grad=True)
    meter = SavedTensorMeter()
    with meter.record("a"):
        out = x * 2.0  # saves nothing (x is a leaf multiplied by a constant)
    meter.track("a", out)
    assert meter.live_bytes == 400 and meter.tracked_bytes == {"a": 400}
    meter.untrack("a")
    assert meter.live_bytes == 0 and meter.peak_bytes == 400
    meter.track("a", x.exp())
    meter.release("a")
    assert meter.live_bytes == 0


def test_make_memory_meter_picks_by_device():
    """make_memory_meter: saved-tensor meter on CPU (and CUDA names without CUDA), allocator meter on CUDA."""
    assert isinstance(make_memory_meter(torch.device("cpu")), SavedTensorMeter)
    if torch.cuda.is_available():
        meter = make_memory_meter(torch.device("cuda", 0))
        assert isinstance(meter, AllocatorMeter)
        meter.begin()
        with meter.record("a"):
            keep = torch.empty(1 << 20, device="cuda")
        assert meter.saved_bytes["a"] >= keep.numel() * 4
    else:  # a CUDA device named without CUDA falls back instead of crashing
        assert isinstance(make_memory_meter(torch.device("cuda")), SavedTensorMeter)
