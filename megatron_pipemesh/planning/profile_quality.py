"""How trustworthy a profile's times are: the spread of each measured piece's samples (:class:`Spread`), the
load the machine carried while the profile timed (:class:`LoadRecord`), and the machine's own pace then
(:class:`MachinePace`).

A piece is timed in rounds until the median is stable: its confidence interval (distribution-free, from the order
statistics of the samples) within :attr:`Spread.stable_within` of the median, or until a time cap, which the
spread then records (``stable`` False). Another process computing on the cores the profile uses slows the pieces
it overlaps, and their medians with them: :func:`load_problem` names the pieces a profile timed beside such work.

Pure: no torch.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Dict, Mapping, Optional, Sequence, Tuple

CONFIDENCE_Z = 1.96
"""The normal quantile of the median's confidence interval (about 95%)."""

OTHERS_BUSY_CORES = 0.1
"""Other processes' CPU time during a piece, in cores (CPU seconds per wall second), from which the piece counts as
timed beside other work: a tenth of a core is about what sshd, the kernel's workers and a shell leave on an idle
machine several times over."""


def median_interval(ordered: Sequence[float]) -> Tuple[float, float]:
    """(low, high): the order statistics around the median of the sorted samples ``ordered`` that hold the median
    with about 95% confidence (the binomial rank interval, normal approximation; the whole range below 6 samples)."""
    n = len(ordered)
    half = CONFIDENCE_Z * math.sqrt(n) / 2
    low = max(0, int(math.floor(n / 2 - half)))
    high = min(n - 1, int(math.ceil(n / 2 + half)) - 1)
    return ordered[low], ordered[max(low, high)]


def quantile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile of the sorted samples ``ordered`` (linear between neighbours)."""
    at = q * (len(ordered) - 1)
    below = int(math.floor(at))
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (at - below)


@dataclass(frozen=True)
class Spread:
    """The samples behind one measured piece."""

    samples: int
    """Timed calls (after the warm-up)."""
    median_s: float
    """Their median, seconds (what the profile keeps)."""
    q1_s: float
    """Their first quartile, seconds."""
    q3_s: float
    """Their third quartile, seconds."""
    low_s: float
    """The low end of the median's ~95% confidence interval, seconds (:func:`median_interval`)."""
    high_s: float
    """Its high end, seconds."""
    stable: bool
    """Whether the interval closed within the profile's tolerance; False: the time cap stopped the repeats first."""

    @property
    def relative_half_width(self) -> float:
        """Half the median's confidence interval over the median (0 where the median is 0)."""
        return (self.high_s - self.low_s) / 2 / self.median_s if self.median_s > 0 else 0.0

    @property
    def relative_iqr(self) -> float:
        """The samples' interquartile range over their median (0 where the median is 0)."""
        return (self.q3_s - self.q1_s) / self.median_s if self.median_s > 0 else 0.0

    def describe(self) -> str:
        """'±2.1% (IQR 4.0%, 9 samples)', with 'capped' where the repeats stopped at the time cap."""
        return (f"±{self.relative_half_width * 100:.1f}% (IQR {self.relative_iqr * 100:.1f}%, {self.samples} samples"
                + ("" if self.stable else ", capped") + ")")

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(data: Mapping) -> "Spread":
        return Spread(samples=int(data["samples"]), median_s=float(data["median_s"]), q1_s=float(data["q1_s"]),
                      q3_s=float(data["q3_s"]), low_s=float(data["low_s"]), high_s=float(data["high_s"]),
                      stable=bool(data["stable"]))


def spread_of(samples: Sequence[float], stable: bool) -> Spread:
    """The :class:`Spread` of ``samples`` (seconds, at least one)."""
    ordered = sorted(samples)
    low, high = median_interval(ordered)
    return Spread(samples=len(ordered), median_s=quantile(ordered, 0.5), q1_s=quantile(ordered, 0.25),
                  q3_s=quantile(ordered, 0.75), low_s=low, high_s=high, stable=stable)


MIN_STABLE_SAMPLES = 5
"""The fewest samples whose median can be stable: below 6 its interval is their whole range
(:func:`median_interval`), which holds the median with 1 - 2/2^n confidence, 94% at 5."""


def is_stable(samples: Sequence[float], within: float, floor_s: float) -> bool:
    """Whether the median of ``samples`` is known well enough: at least :data:`MIN_STABLE_SAMPLES` and its
    confidence interval's half-width at most ``within`` of the median, or at most ``floor_s`` (pieces so short that
    a relative bound is the timer's resolution)."""
    if len(samples) < MIN_STABLE_SAMPLES:
        return False
    ordered = sorted(samples)
    low, high = median_interval(ordered)
    half = (high - low) / 2
    return half <= floor_s or half <= within * quantile(ordered, 0.5)


@dataclass(frozen=True)
class LoadRecord:
    """What else computed on the profile's cores while it timed (CPU only; read from ``/proc``)."""

    cores: int
    """The cores the profile could use (its affinity)."""
    loadavg_before: Tuple[float, float, float]
    """The machine's load average (1, 5, 15 minutes) when the compute's timing began."""
    loadavg_after: Tuple[float, float, float]
    """And when it ended."""
    others_cores: Dict[str, float]
    """Per group of pieces timed together (e.g. 'layers mbs 2'): other processes' CPU time on those cores while it
    was timed, in cores (CPU seconds per wall second); the profile's own process and its siblings are not counted."""
    threshold_cores: float = OTHERS_BUSY_CORES
    """From this many cores a group counts as timed beside other work."""

    @property
    def affected(self) -> Dict[str, float]:
        """The groups timed beside other work, with the cores it took."""
        return {name: busy for name, busy in self.others_cores.items() if busy >= self.threshold_cores}

    def to_dict(self) -> dict:
        return {"cores": self.cores, "loadavg_before": list(self.loadavg_before),
                "loadavg_after": list(self.loadavg_after), "others_cores": dict(self.others_cores),
                "threshold_cores": self.threshold_cores}

    @staticmethod
    def from_dict(data: Mapping) -> "LoadRecord":
        return LoadRecord(cores=int(data["cores"]),
                          loadavg_before=tuple(float(x) for x in data["loadavg_before"]),
                          loadavg_after=tuple(float(x) for x in data["loadavg_after"]),
                          others_cores={str(k): float(v) for k, v in data["others_cores"].items()},
                          threshold_cores=float(data.get("threshold_cores", OTHERS_BUSY_CORES)))

    def describe(self) -> str:
        """One line: the load average and the groups other processes computed beside."""
        busy = self.affected
        text = (f"load average {self.loadavg_before[0]:.2f} -> {self.loadavg_after[0]:.2f} on {self.cores} core(s); ")
        if not busy:
            return text + f"no other process took {self.threshold_cores:g} core or more while a piece was timed"
        return text + "other processes computed while timing " + ", ".join(
            f"{name} ({cores:.2f} cores)" for name, cores in busy.items())


@dataclass(frozen=True)
class MachinePace:
    """The machine's own speed while a profile timed its pieces (CPU): a fixed block timed once per round beside them.

    A VM's cores speed up and slow down together by 10-25% over seconds and minutes, and a layer's time with them
    (``scripts/machine_pace_check.py``: two cores' layers and the block move in step; layer over block holds within
    1-2% where the layer alone moves 5-6%). So every sample is taken at the pace of its round and the profile keeps
    them all at one pace, :attr:`seconds`: its pieces measured at different minutes (micro-batch 1 and 4, the layers
    and the optimizer) stay comparable, and a run's compute can be read against the pace it ran at."""

    block: str
    """The block, in words."""
    seconds: float
    """The block's median over every round: the pace every time in the profile is given at."""
    spread: Spread
    """The block's samples."""
    window_medians_s: Tuple[float, ...]
    """The block's median in consecutive windows of :data:`PACE_WINDOW_S` (how the machine moved while timed)."""

    @property
    def moved(self) -> float:
        """The windows' range over the median: how much the machine's speed moved during the profile."""
        windows = self.window_medians_s
        return (max(windows) - min(windows)) / self.seconds if windows and self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {"block": self.block, "seconds": self.seconds, "spread": self.spread.to_dict(),
                "window_medians_s": list(self.window_medians_s)}

    @staticmethod
    def from_dict(data: Mapping) -> "MachinePace":
        return MachinePace(block=str(data["block"]), seconds=float(data["seconds"]),
                           spread=Spread.from_dict(data["spread"]),
                           window_medians_s=tuple(float(x) for x in data["window_medians_s"]))

    def describe(self) -> str:
        """One line: the block's median and how far the machine moved while the profile timed."""
        return (f"machine pace {self.seconds * 1e3:.2f} ms per block ({self.block}, {self.spread.samples} rounds); "
                f"the machine moved {self.moved * 100:.0f}% across {len(self.window_medians_s)} windows of "
                f"{PACE_WINDOW_S:g} s, every time here is given at this pace")


PACE_WINDOW_S = 10.0
"""The window :attr:`MachinePace.window_medians_s` takes medians over."""


def pace_of(block: str, ticks: Sequence[Tuple[float, float]]) -> MachinePace:
    """The :class:`MachinePace` of ``ticks``, (clock seconds, block seconds) in time order (at least one)."""
    windows: Dict[int, list] = {}
    start = ticks[0][0]
    for at, seconds in ticks:
        windows.setdefault(int((at - start) // PACE_WINDOW_S), []).append(seconds)
    spread = spread_of([seconds for _, seconds in ticks], True)
    return MachinePace(block=block, seconds=spread.median_s, spread=spread, window_medians_s=tuple(
        quantile(sorted(values), 0.5) for _, values in sorted(windows.items())))


def load_problem(load: Optional[LoadRecord], name: str = "the profile") -> Optional[str]:
    """Why the times of a profile whose :class:`LoadRecord` is ``load`` (of the file ``name``) cannot be judged
    against: other processes computed while it timed (naming the load and the pieces); None where none did or the
    load was not recorded (a profile from CUDA, or an older file)."""
    if load is None or not load.affected:
        return None
    return (f"{name} was timed while other processes computed on its {load.cores} core(s) ({load.describe()}): its "
            "times are slower than this machine's and the predictions made from them cannot be judged. Profile "
            "again on an idle machine (pipemesh profile, or drop --profile to profile here)")


COMPUTE_PIECES = ("layer_forward_s", "layer_backward_s")
"""The pieces most of a row's compute is made of (every transformer layer's forward and backward)."""


def compute_spread(points) -> float:
    """How far a profile's compute may be from its medians, relative: the widest median confidence interval
    (half-width over the median) of :data:`COMPUTE_PIECES` over the points (:class:`~.profile.ComputePoint`); 0 for a
    file without spreads."""
    widths = [point.spread[name].relative_half_width for point in points if point.spread
              for name in COMPUTE_PIECES if name in point.spread]
    return max(widths, default=0.0)
