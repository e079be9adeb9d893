"""The loopback transport's copies behave like NCCL's point-to-point kernels (runtime/loopback.py), pinned on CPU:
the CUDA engine's stream ordering against stand-ins of torch.cuda's streams and events, and the world's matching
against a recording engine."""
import contextlib
import gc
import weakref

import torch

from megatron_pipemesh.runtime.loopback import CopyEngine, CudaCopyEngine, LoopbackWorld

LINK = ("F", 0, 1)


class Event:
    def __init__(self, stream, log):
        self.stream, self.log, self.done = stream, log, False

    def query(self):
        return self.done


class Stream:
    """Logs what is enqueued on it, in order."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def record_event(self):
        event = Event(self, self.log)
        self.log.append((self.name, "record", id(event)))
        return event

    def wait_event(self, event):
        self.log.append((self.name, "wait", id(event)))


def _fake_cuda(monkeypatch, log):
    """torch.cuda's streams for one thread: ``current`` is the poster's compute stream; new streams are 'comm<n>'."""
    state = {"current": Stream("compute", log), "made": 0}

    def new_stream(device=None):
        state["made"] += 1
        return Stream(f"comm{state['made']}", log)

    @contextlib.contextmanager
    def on(stream):
        previous, state["current"] = state["current"], stream
        try:
            yield
        finally:
            state["current"] = previous

    monkeypatch.setattr(torch.cuda, "Stream", new_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: state["current"])
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append((state["current"].name, "sleep", cycles)))
    return state


def test_cuda_copies_run_on_the_links_stream_after_both_posters(monkeypatch):
    """Each post records an event on the poster's current stream; the copy runs on the link's communication stream
    (one per link) after both events and the optional delay; the waiter's stream waits for the copy's event."""
    log = []
    _fake_cuda(monkeypatch, log)
    engine = CudaCopyEngine(delay_cycles=1000)
    source, target = torch.arange(4.0), torch.zeros(4)
    sent, received = engine.ready(source), engine.ready(target)
    done = engine.copy(LINK, source, target, (sent, received))
    assert torch.equal(target, source)
    assert log == [("compute", "record", id(sent)), ("compute", "record", id(received)),
                   ("comm1", "wait", id(sent)), ("comm1", "wait", id(received)), ("comm1", "sleep", 1000),
                   ("comm1", "record", id(done))]
    engine.wait(done)
    assert log[-1] == ("compute", "wait", id(done))
    assert not engine.done(done)
    done.done = True
    assert engine.done(done)
    engine.copy(LINK, source, target, ())
    same = log[-1][0]
    engine.copy(("B", 1, 0), source, target, ())
    assert (same, log[-1][0]) == ("comm1", "comm2")  # one stream per link


class Recording(CopyEngine):
    """Copies at once but hands out events that complete only when told."""

    def __init__(self):
        self.calls = []

    def ready(self, tensor):
        event = {"ready": id(tensor)}
        self.calls.append(("ready", id(tensor)))
        return event

    def copy(self, link, source, target, ready):
        super().copy(link, source, target, ready)
        event = {"copy": link, "done": False}
        self.calls.append(("copy", link, tuple(e["ready"] for e in ready)))
        return event

    def wait(self, event):
        self.calls.append(("wait", event["copy"]))

    def done(self, event):
        return event["done"]


def test_the_world_completes_transfers_by_the_copys_event_and_keeps_no_tensor():
    """The later post launches the copy (after the sender's and the receiver's ready events, in that order);
    both works complete when the copy's event has; the world keeps no reference to either tensor once matched."""
    engine = Recording()
    world = LoopbackWorld(2, backend="nccl", engine=engine)
    source, target = torch.arange(3.0), torch.zeros(3)
    receive = world._post("recv", target, (LINK, 0))
    send = world._post("send", source, (LINK, 0))
    assert engine.calls == [("ready", id(target)), ("ready", id(source)), ("copy", LINK, (id(source), id(target)))]
    assert torch.equal(target, source) and not send.is_completed() and not receive.is_completed()
    assert receive.wait() and engine.calls[-1] == ("wait", LINK)
    send._event["done"] = True
    assert send.is_completed() and receive.is_completed()
    refs = weakref.ref(source), weakref.ref(target)
    del source, target
    gc.collect()
    assert all(ref() is None for ref in refs), "the world must not keep transfer tensors alive"
