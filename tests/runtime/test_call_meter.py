"""runtime/call_meter.py: one meter scope around a whole forward-backward call (``--pipemesh-measure-memory``
under the stock schedule; the bench's meter builds on the same code)."""
import torch

from megatron_pipemesh.runtime.call_meter import MeteredStockSchedule, chunks_device, metering, model_chunks
from megatron_pipemesh.runtime.memory import SavedTensorMeter, ambient_meter


def _schedule(*, model, forward_only=False, **_):
    x = torch.randn(32, 64)
    y = torch.relu(model[0](x))  # saves x (Linear) and y (ReLU): 2 x 32 x 64 fp32
    if not forward_only:
        y.sum().backward()
    return []


def test_stock_schedule_reports_the_peak_of_a_training_call():
    """A training call's saved tensors (not the parameters) land in ``last_stats``; a forward-only call is not
    measured."""
    layer = torch.nn.Linear(64, 64)
    stock = MeteredStockSchedule(_schedule)
    assert stock(model=[layer]) == []
    stats = stock.last_stats
    assert (stats.memory_source, stats.peak_activation_bytes, stats.plan_digest) == ("saved-tensors", 16384, "stock")
    assert not stats.timed_waits and stats.total_s > 0
    stock(model=[layer], forward_only=True)
    assert stock.last_stats.forward_only and stock.last_stats.memory_source == ""


def test_metering_is_ambient_only_when_asked():
    """``ambient`` makes the meter the runtime's ambient meter for the call only."""
    layer = torch.nn.Linear(64, 64)
    chunks = model_chunks(layer)
    assert chunks == [layer] and chunks_device(chunks) == torch.device("cpu")
    assert model_chunks([layer, None]) == [layer] and chunks_device([]) is None
    for ambient in (False, True):
        meter, seen = SavedTensorMeter(layer.parameters()), []
        with metering(meter, ambient=ambient):
            seen.append(ambient_meter())
            _schedule(model=[layer])
        assert seen == [meter if ambient else None] and ambient_meter() is None
        assert meter.peak_bytes == 16384 and meter.live_bytes == 0


def test_a_whole_call_on_cuda_counts_what_the_schedule_holds_between_ops(monkeypatch):
    """Metering a whole call with the allocator meter (the stock schedule on CUDA, the bench): each Megatron
    ``forward_step`` is one key until the ``backward_step`` of its output, its temporaries do not count, a sent
    output stops counting when ``deallocate_output_tensor`` frees it, and the allocator's peak is not reset."""
    from megatron_pipemesh.integration.bootstrap import prepare_megatron_import

    prepare_megatron_import()
    from megatron.core.pipeline_parallel import schedules

    from megatron_pipemesh.runtime import call_meter
    from megatron_pipemesh.runtime.memory import AllocatorMeter
    from tests.runtime.test_memory import FakeCudaAllocator

    cuda = FakeCudaAllocator(monkeypatch)
    saved, out = 256, 64  # bytes per forward; torch.empty(16) below is the 64-byte output

    def forward_step(forward_step_func, data_iterator, model, num_microbatches, input_tensor, forward_data_store,
                     config, cp_group_size, current_microbatch=None, vp_stage=None, **_):
        cuda.free(cuda.malloc(1 << 20))  # logits and loss terms: freed inside the op
        cuda.malloc(saved + out)
        return torch.empty(16), 1

    def backward_step(input_tensor, output_tensor, output_tensor_grad, config):
        cuda.free(cuda.malloc(1 << 19))
        cuda.free(saved)

    def deallocate_output_tensor(out_tensor, deallocate_pipeline_outputs=False):
        if deallocate_pipeline_outputs:
            cuda.free(out)

    for name, fake in (("forward_step", forward_step), ("backward_step", backward_step),
                       ("deallocate_output_tensor", deallocate_output_tensor)):
        monkeypatch.setattr(schedules, name, fake)
    monkeypatch.setattr(call_meter, "_WRAPPED", [], raising=False)  # wrap the fakes (monkeypatch restores Megatron's own)

    def stock(**_):  # two micro-batches in flight: F0 F1 B0 B1, the outputs deallocated after their sends
        outputs = []
        for j in range(2):
            output, _ = schedules.forward_step(None, None, None, 2, None, [], None, 1, current_microbatch=j)
            schedules.deallocate_output_tensor(output, True)
            outputs.append(output)
        for output in outputs:
            schedules.backward_step(None, output, None, None)
        return []

    cuda.malloc(4000)  # model state
    meter = AllocatorMeter(torch.device("cuda", 0))
    with call_meter.metering(meter):
        stock()
    assert meter.peak_bytes == 2 * saved + out, "F1's end: both saved sets and F1's output before its send"
    assert meter.live_bytes == 0 and meter.baseline == 4000 and cuda.resets == 0
    outside = AllocatorMeter(torch.device("cuda", 0))  # no call metered: the wrappers pass through
    outside.begin()
    stock()
    assert outside.peak_bytes == 0
