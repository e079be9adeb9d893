"""``pipemesh profile``'s measuring loop: how every time in a profile is taken (the layers and the ends, the schedule
step, the optimizer), and how much is measured (:class:`ProfileSettings`).

:func:`measure` is the one loop: each named measurement is called once per round, the names taking turns in every
round so that a drift of the machine's speed (other processes, clocks) reaches them alike and their differences (a
recomputation's extra, a step less its pieces) stay fair; the first ``warmup`` rounds are dropped (first-call
allocations, lazy initialisation), then rounds go on until every number's median is stable (its confidence interval
within :attr:`ProfileSettings.stable_within`, :func:`..planning.profile_quality.is_stable`) or the time cap
:attr:`ProfileSettings.max_seconds` is reached; every sample is kept, so that the profile can say each piece's spread
and whether it stopped stable or capped. On CPU a :class:`.profile_pace.Pace` is ticked before every round and the
round's samples are taken at its pace (the machine's own speed moves by 10-25% over minutes here, every core alike).
:func:`medians` is the loop with a fixed count of repeats.

:class:`Timer` takes one block's seconds: the wall clock on CPU; on CUDA CUDA events around the block launched
behind queued work, as training launches it (the host's Python time hides behind kernels queued earlier).
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ContextManager, Dict, List, Mapping, Optional, Sequence, Tuple

from ..planning.profile_quality import is_stable

if TYPE_CHECKING:
    from .profile_pace import Pace


@dataclass(frozen=True)
class ProfileSettings:
    """How much to measure."""

    warmup: int = 2
    """Calls before the timed ones (first-call allocations, lazy initialisation)."""
    repeats: int = 5
    """The fewest timed calls of a piece; the median is kept."""
    stable_within: float = 0.02
    """A piece is timed again until its median's ~95% confidence interval is within this fraction of it either
    side (:func:`..planning.profile_quality.is_stable`)."""
    stable_floor_s: float = 50e-6
    """...or within this many seconds either side (pieces so short that the timer's resolution is the bound)."""
    max_seconds: float = 10.0
    """The time cap of each group of pieces timed together: past it the repeats stop, stable or not, and the
    profile records which pieces were not."""
    max_micro_batch: Optional[int] = None
    """The largest micro-batch size measured (None: the command's); larger than the command's measures the sizes
    the advice may change it to (1, 2, 4, ... and this one)."""
    seed: int = 1234
    """Seed of the weights and inputs."""
    bucket_bytes: Optional[int] = None
    """The larger message the links are timed with (None: on CUDA Megatron's gradient bucket of the command,
    :func:`.profile_links.megatron_bucket_bytes`; on CPU :data:`.profile_links.CPU_BUCKET_BYTES`)."""
    ranks_per_node: int = 1
    """On CPU: the ranks that will compute at once on this machine; the compute is timed with that many cores
    computing (the others run the command's layer, :mod:`.profile_siblings`), at most the cores this process may
    use. Ignored on CUDA (each rank computes on a device of its own)."""


LEAD_S = 5e-3
"""How far ahead of the device the host starts launching a timed block at first (a block whose launches outrun it
gets a longer lead)."""
LEAD_CAP_S = 0.05
"""The longest lead: a block that still outruns it waits on the device (a ``.item()``, a synchronising collective)
or is host-bound beyond it, and is timed from an empty queue, as training runs it after such a wait."""
CALIBRATION_CYCLES = 10_000_000
"""GPU cycles of ``torch.cuda._sleep`` timed once to turn a lead in seconds into cycles (about 5-10 ms)."""


class Timer:
    """Seconds a block costs: the wall clock on CPU; on CUDA what it costs the device's queue in training.

    In training the host runs ahead of the device: kernels wait in the stream's queue, so the host's Python work
    between them (the schedule's step, Megatron's wrappers) hides behind kernels queued earlier. Timed on an empty
    queue, that Python time shows as device time. So each timed block is launched behind a device sleep (its lead,
    ``torch.cuda._sleep``; the start event recorded after it): while the device sleeps, the host queues the block,
    and the events measure its kernels back to back. The block costs the longer of that and the host's own time (a
    host that cannot keep ahead leaves the device idle in training too).

    A block whose start event had fired by the time the host finished it outran its lead: the next call of the same
    code gets twice the lead (at least twice the host's time, at most :data:`LEAD_CAP_S`); one that outruns the
    longest lead waits on the device or is host-bound, and is timed from an empty queue from then on (its events
    then span every gap, which training sees too after such a wait). Leads are kept per block's code (a layer's
    forward, a backward call, a schedule step), so that each kind of block settles within the warm-up calls."""

    def __init__(self, cuda: bool, watch: Optional[Callable[[str], ContextManager]] = None,
                 pace: Optional["Pace"] = None):
        self.cuda = cuda
        self.watch = watch
        """Entered around each group of timed rounds with its label (:meth:`.profile_load.LoadWatch.piece`): the
        machine's load while they ran; None: not watched."""
        self.pace = pace
        """The machine's pace each round's samples are taken at (:func:`measure`); None: as timed (CUDA)."""
        self.leads: Dict[object, float] = {}
        """Lead in seconds per block's code object (0: timed from an empty queue)."""
        self._cycles_per_s: Optional[float] = None

    def __call__(self, fn: Callable[[], object]) -> Tuple[object, float]:
        if not self.cuda:
            began = time.perf_counter()
            out = fn()
            return out, time.perf_counter() - began
        import torch

        key = getattr(getattr(fn, "__func__", fn), "__code__", fn)
        lead = self.leads.get(key, LEAD_S)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if lead:
            torch.cuda._sleep(max(1, int(lead * self._device_cycles_per_s())))
        start.record()
        began = time.perf_counter()
        out = fn()
        host_s = time.perf_counter() - began
        ahead = bool(lead) and not start.query()  # the device still slept: every kernel was queued before it ran
        end.record()
        torch.cuda.synchronize()
        device_s = start.elapsed_time(end) / 1e3
        if ahead or not lead:
            return out, max(device_s, host_s) if ahead else device_s
        self.leads[key] = 0.0 if lead >= LEAD_CAP_S else min(LEAD_CAP_S, max(2 * lead, 2 * host_s))
        return out, max(device_s, host_s)

    def span(self) -> "Span":
        """A :class:`Span` on this timer's clock, for marks inside a block this timer times."""
        return Span(self.cuda)

    def _device_cycles_per_s(self) -> float:
        """The device's ``_sleep`` cycles per second, timed once."""
        import torch

        if self._cycles_per_s is None:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(CALIBRATION_CYCLES)
            end.record()
            torch.cuda.synchronize()
            self._cycles_per_s = CALIBRATION_CYCLES / max(start.elapsed_time(end) / 1e3, 1e-6)
        return self._cycles_per_s


class Span:
    """Seconds between :meth:`start` and :meth:`stop` marks made inside a timed block (summed over pairs), on the
    clock of the :class:`Timer` that times the block: the wall clock on CPU; on CUDA events in the stream, read once
    the block's timer has synchronised. Part of a block timed in the same call as the block, so that what is left
    of it is measured, not the difference of two medians taken apart."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self._pairs: List[list] = []

    def start(self) -> None:
        self._pairs.append([self._mark()])

    def stop(self) -> None:
        self._pairs[-1].append(self._mark())

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @property
    def seconds(self) -> float:
        if self.cuda:
            return sum(a.elapsed_time(b) for a, b in self._pairs) / 1e3
        return sum(b - a for a, b in self._pairs)


class ForwardsInBackward:
    """Seconds the modules of a model spend in forward calls made while its backward runs: the recomputation of a
    checkpointed layer, timed where it happens (Megatron's ``CheckpointFunction`` and ``CheckpointWithoutOutput`` call
    the recomputed modules again inside autograd's backward; a forward that a recomputation stops early counts up to
    there), outermost calls only. A recompute level's extra is
    then measured, not the difference of two ~25-50 ms totals whose own noise is 15-50% of a 3-7 ms extra."""

    def __init__(self, model):
        self.span: Optional[Span] = None
        """Open while a backward runs (:meth:`counting`); None otherwise: forwards outside a backward are not
        counted."""
        self._depth = 0
        self._hooks = [hook for module in model.modules() for hook in (
            module.register_forward_pre_hook(self._enter), module.register_forward_hook(self._leave, always_call=True))]

    def _enter(self, *_) -> None:
        if self.span is not None:
            if self._depth == 0:
                self.span.start()
            self._depth += 1

    def _leave(self, *_) -> None:
        if self.span is not None and self._depth > 0:
            self._depth -= 1
            if self._depth == 0:
                self.span.stop()

    @contextlib.contextmanager
    def counting(self, timer: "Timer"):
        """Around a backward: yields the :class:`Span` that collects its forwards (read once ``timer`` is done)."""
        self.span, self._depth = timer.span(), 0
        try:
            yield self.span
        finally:
            self.span = None

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


@dataclass(frozen=True)
class Measured:
    """Every timed sample of one named measurement."""

    columns: Tuple[Tuple[float, ...], ...]
    """Per number the measurement returns, its samples in round order (seconds)."""
    stable: bool
    """Whether every number's median was stable when the repeats stopped (False: the time cap stopped them)."""

    @property
    def medians(self) -> Tuple[float, ...]:
        return tuple(statistics.median(column) for column in self.columns)


def measure(calls: Mapping[str, Callable[[], Sequence[float]]], settings: ProfileSettings,
            watch: Optional[Callable[[str], ContextManager]] = None, label: str = "",
            clock: Callable[[], float] = time.perf_counter, pace: Optional["Pace"] = None) -> Dict[str, Measured]:
    """Per name, the samples of each number ``calls[name]()`` returns (seconds): ``settings.warmup`` rounds
    dropped, then rounds until every number's median is stable or ``settings.max_seconds`` have passed, at least
    ``settings.repeats`` (see the module). ``watch(label)``, where given, is entered around the timed rounds (the
    machine's load while they ran, :mod:`.profile_load`); ``pace``, where given, is ticked before each timed round
    and the round's samples are taken at its base pace (:meth:`.profile_pace.Pace.at_base`)."""
    samples: Dict[str, List[Tuple[float, ...]]] = {name: [] for name in calls}

    def stable(name: str) -> bool:
        return all(is_stable(column, settings.stable_within, settings.stable_floor_s)
                   for column in zip(*samples[name]))

    for _ in range(settings.warmup):
        for call in calls.values():
            call()
    with watch(label) if watch is not None else contextlib.nullcontext():
        began, rounds = clock(), 0
        while True:
            tick_s = pace.tick() if pace is not None else None
            for name, call in calls.items():
                sample = tuple(call())
                samples[name].append(sample if tick_s is None else pace.at_base(sample, tick_s))
            rounds += 1
            if rounds >= settings.repeats and (all(map(stable, calls)) or clock() - began >= settings.max_seconds):
                break
    return {name: Measured(tuple(zip(*rows)), stable(name)) for name, rows in samples.items()}


def medians(calls: Mapping[str, Callable[[], Sequence[float]]], warmup: int, repeats: int,
            pace: Optional["Pace"] = None) -> Dict[str, Tuple[float, ...]]:
    """Per name, the median of each number ``calls[name]()`` returns (seconds) over exactly ``repeats`` rounds after
    ``warmup`` rounds, the names taking turns in every round (see the module), at ``pace`` where given."""
    fixed = ProfileSettings(warmup=warmup, repeats=repeats, max_seconds=0.0)
    return {name: found.medians for name, found in measure(calls, fixed, pace=pace).items()}
