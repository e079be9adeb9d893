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
