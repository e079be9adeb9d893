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


# The CUDA meter, against a stand-in of the caching allocator's counters -------------------------------------
class Copy:
    """A side-stream copy's completion event."""

    def __init__(self):
        self.done = False


class FakeCudaAllocator:
    """``torch.cuda``'s allocator statistics as the caching allocator keeps them: ``allocated`` drops at ``free()``;
    a block freed after ``record_stream`` stays active (not reusable) until its event completed and the allocator
    next allocates (``process_events`` runs in ``malloc``); peak counters only rise unless
    ``reset_peak_memory_stats``."""

    def __init__(self, monkeypatch):
        self.allocated = self.active = self.peak = self.resets = 0
        self.pending = []
        for name in ("memory_stats", "memory_stats_as_nested_dict", "memory_allocated", "max_memory_allocated",
                     "reset_peak_memory_stats", "synchronize"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))

    def malloc(self, nbytes: int) -> int:
        for entry in [e for e in self.pending if e[1].done]:
            self.pending.remove(entry)
            self.active -= entry[0]
        self.allocated += nbytes
        self.active += nbytes
        self.peak = max(self.peak, self.allocated)
        return nbytes

    def free(self, nbytes: int, copy: Copy = None) -> None:
        self.allocated -= nbytes
        if copy is None:
            self.active -= nbytes
        else:
            self.pending.append((nbytes, copy))

    # The torch.cuda functions the meters call.
    def memory_stats(self, device=None):
        return {"allocated_bytes.all.current": self.allocated, "allocated_bytes.all.peak": self.peak,
                "active_bytes.all.current": self.active}

    def memory_stats_as_nested_dict(self, device=None):
        return {"allocated_bytes": {"all": {"current": self.allocated, "peak": self.peak}},
                "active_bytes": {"all": {"current": self.active}}}

    def memory_allocated(self, device=None):
        return self.allocated

    def max_memory_allocated(self, device=None):
        return self.peak

    def reset_peak_memory_stats(self, device=None):
        self.resets += 1
        self.peak = self.allocated

    def synchronize(self, device=None):
        pass


def test_cuda_meter_does_not_count_the_temporaries_of_a_forward(monkeypatch):
    """A forward that allocates a large temporary (logits, a gather) and frees it before it ends holds only what it
    saved: the peak is the saved bytes, not the allocator's high-water mark."""
    cuda = FakeCudaAllocator(monkeypatch)
    cuda.malloc(10_000)  # model state
    meter = AllocatorMeter(torch.device("cuda", 0))
    meter.begin()
    with meter.record((0, 0)):
        temporary = cuda.malloc(4096)
        saved = cuda.malloc(256)
        cuda.free(temporary)
    assert meter.saved_bytes[(0, 0)] == saved and meter.peak_bytes == saved and meter.live_bytes == saved
    cuda.free(saved)
    meter.release((0, 0))
    assert meter.live_bytes == 0 and meter.peak_bytes == saved


def test_cuda_meter_counts_an_offloaded_storage_until_its_copy_finished(monkeypatch):
    """OFFLOAD frees the device copy at once (``allocated`` drops) but the block waits for its device-to-host copy
    (record_stream): the next forward runs with both on the device. Once the copy's event completed (and the
    allocator processed it), the storage no longer counts."""
    cuda = FakeCudaAllocator(monkeypatch)
    meter = AllocatorMeter(torch.device("cuda", 0))
    meter.begin()
    with meter.record((0, 0)):
        first = cuda.malloc(256)
    copy = Copy()
    cuda.free(first, copy)  # what the offloader's last reference drop does after source.record_stream(d2h)
    meter.offloaded((0, 0), [(1, first)])
    assert meter.live_bytes == first and meter.host_bytes == first
    with meter.record((0, 1)):
        second = cuda.malloc(256)
    assert meter.peak_bytes == first + second, "the offloaded block is still on the device"
    copy.done = True
    with meter.record((0, 2)):
        third = cuda.malloc(256)  # the allocator processes the finished copy's event here
    assert meter.live_bytes == second + third and meter.peak_bytes == first + second
    meter.reloaded((0, 0), [(2, cuda.malloc(first))])
    assert meter.peak_bytes == first + second + third and meter.host_bytes == 0
    for key in ((0, 0), (0, 1), (0, 2)):
        meter.release(key)
    assert meter.live_bytes == 0


def test_cuda_meter_leaves_megatrons_peak_statistics_alone(monkeypatch):
    """Megatron reports ``max_memory_allocated`` itself: metering calls never reset the peak counters."""
    cuda = FakeCudaAllocator(monkeypatch)
    cuda.free(cuda.malloc(50_000))  # e.g. the first iteration's optimizer step
    for _ in range(3):
        meter = AllocatorMeter(torch.device("cuda", 0))
        meter.begin()
        with meter.record("a"):
            kept = cuda.malloc(1000)
        cuda.free(kept)
        meter.release("a")
        assert meter.peak_bytes == kept
    assert cuda.resets == 0 and torch.cuda.max_memory_allocated() == 50_000


def test_cuda_meter_tracks_outputs_and_held_inputs(monkeypatch):
    """The output is inside the forward's delta (tracked only to subtract it when the runtime frees it); the input,
    allocated by the receive before the forward, is added once."""
    cuda = FakeCudaAllocator(monkeypatch)
    meter = AllocatorMeter(torch.device("cuda", 0))
    received, output = torch.empty(32), torch.empty(16)  # 128 and 64 bytes
    cuda.malloc(128)
    meter.begin()
    with meter.record("a"):
        cuda.malloc(256 + 64)
    meter.track("a", output)
    meter.hold_input("a", received)
    meter.hold_input("a", received)
    assert meter.saved_bytes["a"] == 256 + 64 + 128 == meter.live_bytes and meter.tracked_bytes == {}
    cuda.free(64)
    meter.untrack("a")
    assert meter.live_bytes == 256 + 128 and meter.peak_bytes == 256 + 64 + 128
