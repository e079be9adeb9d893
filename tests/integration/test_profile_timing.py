"""`integration/profile_timing.py`: the profile's one measuring loop and its timer (on CUDA against a stand-in of one
CUDA stream, faked here on the host's clock)."""
import time

import pytest

from megatron_pipemesh.integration.profile_timing import Timer, medians


def test_the_measurements_take_turns_and_the_warm_up_rounds_are_dropped():
    """Each round calls every measurement once, in turn; the median of each number over the rounds after the
    warm-up is kept."""
    order, values = [], {"a": iter([(100.0, 0.0), (1.0, 2.0), (3.0, 4.0), (2.0, 9.0)]), "b": iter([(7.0,)] * 4)}

    def call(name):
        def one():
            order.append(name)
            return next(values[name])
        return one

    found = medians({"a": call("a"), "b": call("b")}, warmup=1, repeats=3)
    assert order == ["a", "b"] * 4 and found == {"a": (2.0, 4.0), "b": (7.0,)}


class FakeStream:
    """One CUDA stream as the host sees it: a kernel (or ``_sleep``) runs from when it was launched or the one before
    it finished, whichever is later; an event completes when the queue reaches it. GPU cycles run at 1 GHz."""

    CYCLES_PER_S = 1e9

    def __init__(self):
        self.busy_until = time.perf_counter()
        stream = self

        class Event:
            def __init__(self, enable_timing=False):
                self.at = None

            def record(self, *args):
                self.at = max(time.perf_counter(), stream.busy_until)

            def query(self):
                return time.perf_counter() >= self.at

            def elapsed_time(self, other):
                return (other.at - self.at) * 1e3

        self.Event = Event

    def launch(self, seconds: float) -> None:
        self.busy_until = max(time.perf_counter(), self.busy_until) + seconds

    def sleep(self, cycles: int) -> None:
        self.launch(cycles / self.CYCLES_PER_S)

    def synchronize(self, *args) -> None:
        left = self.busy_until - time.perf_counter()
        if left > 0:
            time.sleep(left)


@pytest.fixture
def stream(monkeypatch):
    import torch

    fake = FakeStream()
    monkeypatch.setattr(torch.cuda, "Event", fake.Event)
    monkeypatch.setattr(torch.cuda, "_sleep", fake.sleep)
    monkeypatch.setattr(torch.cuda, "synchronize", fake.synchronize)
    return fake


def _timed(block) -> float:
    timer = Timer(True)
    return medians({"block": lambda: (timer(block)[1],)}, warmup=2, repeats=5)["block"][0]


def test_on_cuda_the_hosts_python_time_hides_behind_queued_kernels(stream):
    """A schedule step: 10 ms of the host's Python, then 50 ms of kernels. In training the host runs ahead and the
    10 ms hide behind kernels queued earlier: the step costs the device 50 ms. Timed on an empty queue it read
    60 ms (the device idle while the host ran Python)."""
    def step():
        time.sleep(0.010)
        stream.launch(0.050)

    assert _timed(step) == pytest.approx(0.050, abs=0.004)


def test_on_cuda_a_host_that_cannot_keep_ahead_costs_its_own_time(stream):
    """30 ms of Python for 5 ms of kernels: the device idles in training too, the step costs the host's 30 ms; and a
    step that waits on the device (a .item()) costs what the device saw, gaps included."""
    def host_bound():
        time.sleep(0.030)
        stream.launch(0.005)

    def waits():
        stream.launch(0.010)
        stream.synchronize()  # e.g. a loss's .item()
        time.sleep(0.010)
        stream.launch(0.010)

    assert _timed(host_bound) == pytest.approx(0.030, abs=0.004)
    assert _timed(waits) == pytest.approx(0.030, abs=0.006)


def settings(**changes):
    from megatron_pipemesh.integration.profile_timing import ProfileSettings

    return ProfileSettings(**{"warmup": 0, "repeats": 5, "stable_within": 0.02, "stable_floor_s": 0.0,
                              "max_seconds": 10.0, **changes})


def test_the_repeats_stop_once_every_median_is_stable():
    """A steady piece alone stops at the fewest repeats; beside one whose samples settle only later, both go on in
    turn until that one's interval closes, and both are stable."""
    from megatron_pipemesh.integration.profile_timing import measure

    settling = iter([1.0, 1.5, 0.5, 1.4, 0.6] + [1.0] * 100)
    found = measure({"steady": lambda: (2.0,)}, settings(), clock=lambda: 0.0)
    assert found["steady"].columns == ((2.0,) * 5,) and found["steady"].stable
    both = measure({"steady": lambda: (2.0,), "settling": lambda: (next(settling),)}, settings(), clock=lambda: 0.0)
    rounds = len(both["steady"].columns[0])
    assert rounds == len(both["settling"].columns[0]) and 5 < rounds < 100
    assert both["settling"].stable and both["settling"].medians == (1.0,)


def test_the_repeats_stop_at_the_time_cap_and_say_the_piece_was_not_stable():
    """A piece whose samples never settle is timed until the (fake) clock passes the cap, then marked unstable; a
    watch is entered once around the timed rounds (after the warm-up) with the group's label."""
    from contextlib import contextmanager

    from megatron_pipemesh.integration.profile_timing import measure

    now, calls, entered = [0.0], [0], []

    def noisy():
        calls[0] += 1
        now[0] += 1.0
        return (1.0 if calls[0] % 2 else 2.0,)

    @contextmanager
    def watch(label):
        entered.append((label, calls[0]))
        yield

    found = measure({"noisy": noisy}, settings(warmup=2, max_seconds=7.5), watch, "layers mbs 1",
                    clock=lambda: now[0])
    assert entered == [("layers mbs 1", 2)]
    assert len(found["noisy"].columns[0]) == 8 and not found["noisy"].stable


def test_the_forwards_a_backward_runs_again_are_timed_there_and_only_there():
    """A block checkpointed around a 30 ms module: its backward runs the module again and that call is counted once
    (the outer call, not the module's children again); the forward outside a backward counts nothing, and a model
    without recomputation counts 0 in its backward."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from megatron_pipemesh.integration.profile_timing import ForwardsInBackward

    class Slow(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(4, 4)

        def forward(self, x):
            time.sleep(0.03)
            return self.inner(x)

    class Block(torch.nn.Module):
        def __init__(self, recompute: bool):
            super().__init__()
            self.slow, self.recompute = Slow(), recompute

        def forward(self, x):
            if self.recompute is None:
                return self.slow(x)
            return checkpoint(self.slow, x, use_reentrant=self.recompute == "reentrant")

    timer = Timer(False)
    # Megatron's checkpoints re-run the whole function; torch's non-reentrant one may stop it early by raising
    for recompute, low, high in (("reentrant", 0.03, 0.06), ("non-reentrant", 0.03, 0.06), (None, 0.0, 0.0)):
        block = Block(recompute)
        meter = ForwardsInBackward(block)
        x = torch.randn(2, 4, requires_grad=True)
        out = block(x)
        with meter.counting(timer) as inside:
            out.sum().backward()
        assert low <= inside.seconds <= high, (recompute, inside.seconds)
        meter.remove()
        assert not block.slow._forward_hooks and not block.slow._forward_pre_hooks


class _Pace:
    """Stands in for :class:`megatron_pipemesh.integration.profile_pace.Pace`: ticks from a list, base 1 s."""

    def __init__(self, ticks):
        self.ticks, self._next, self.base = [], iter(ticks), 1.0

    def tick(self):
        seconds = next(self._next)
        self.ticks.append((len(self.ticks), seconds))
        return seconds

    from megatron_pipemesh.integration.profile_pace import Pace
    at_base = Pace.at_base


def test_each_rounds_samples_are_taken_at_the_pace_of_its_tick():
    """The pace ticks once per timed round (not in the warm-up), before the round; every sample of that round is
    brought to the base pace: a round timed while the machine ran twice as slow counts half its seconds, so a piece
    that slowed with the machine measures steady."""
    from megatron_pipemesh.integration.profile_timing import measure

    machine = iter([9.0, 9.0, 1.0, 2.0, 2.0, 1.0, 1.5])  # two warm-up rounds, then five timed ones
    pace = _Pace([1.0, 2.0, 2.0, 1.0, 1.5])  # the block slowed as the machine did

    def layer():  # a piece that slows with the machine, and one that does not
        return 0.01 * next(machine), 0.03

    found = measure({"layer": layer}, settings(warmup=2, max_seconds=0.0), clock=lambda: 0.0, pace=pace)
    assert len(pace.ticks) == 5
    assert found["layer"].columns[0] == pytest.approx((0.01,) * 5)
    assert found["layer"].columns[1] == pytest.approx((0.03, 0.015, 0.015, 0.03, 0.02))


def test_the_pace_ticks_a_fixed_block_and_gives_its_median_over_the_first_reading():
    """The real block: the first reading is the median of its first ticks, every tick is recorded with its clock,
    the factor is the median of all over that first reading, and the record keeps the block, median and windows."""
    from megatron_pipemesh.integration.profile_pace import BASE_TICKS, BLOCK, Pace

    pace = Pace()
    assert len(pace.ticks) == BASE_TICKS and pace.base > 0
    assert pace.at_base((2.0 * pace.base,), 2.0 * pace.base) == pytest.approx((pace.base,))
    pace.ticks += [(pace.ticks[-1][0] + 1.0, 3.0 * pace.base)] * (BASE_TICKS + 1)  # the machine three times slower
    assert pace.factor() == pytest.approx(3.0)
    record = pace.record()
    assert record.block == BLOCK and record.seconds == pytest.approx(3.0 * pace.base)
    assert record.spread.samples == 2 * BASE_TICKS + 1 and len(record.window_medians_s) == 1
