"""How far a row's prediction may be from its measurement, and the row to run given that.

Each row gets two errors, each combined (root of the sum of squares) with the spread of the profile's timings it was
priced from: the error of its predicted time (the interval printed with it), and the error of its predicted speed
over the user's command (the gain error), which decides. Both come from the accuracy ledger, per kind of row
(:data:`KINDS`: how far it departs from the user's command). A gain is judged by the second: the rows and the command
are priced from the same profile on the same machine, so much of their error is shared and cancels in their ratio;
adding the two rows' time errors would count it twice (the ledger of 2026-12-05: time errors up to 18%, gain errors
up to 12.5%). The advice changes the user's command only where a row's predicted time, raised by its gain error, stays
below the command's, lowered by the profile's spread; among those rows, the ones whose lowered time reaches the
fastest row's raised time, it chooses the one that changes least (then the fastest). Otherwise it keeps the command
and says by how much the best row was predicted faster and how large the error is.

The per-kind errors come from ``advice_error.json`` beside this module, which ``scripts/advice_accuracy.sh`` writes
from its ledger (the largest error of each kind's rows over its commands), with where and when they were measured.

Pure: standard library only.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Sequence, Tuple

KINDS = ("user", "same layout", "changed V", "changed micro-batch size", "changed layout")
"""Kinds of row, from the least change to the user's command to the most: the command itself; its layout, V and
micro-batch size with another schedule, recomputation or optimizer flags; another V; another micro-batch size; another
TP x CP x PP x DP (or EP)."""

ERRORS_FILE = os.path.join(os.path.dirname(__file__), "advice_error.json")
"""The ledger's measured errors per kind (written by ``scripts/advice_accuracy.sh --write-errors``)."""


@dataclass(frozen=True)
class ErrorTable:
    """The relative error of a prediction per kind of row, as the ledger measured it."""

    by_kind: Mapping[str, float]
    """Kind (:data:`KINDS`) -> the largest |measured / predicted - 1| of the ledger's rows of that kind."""
    source: str = ""
    """Where and when it was measured (the ledger's commands, machine and date)."""
    gain_by_kind: Mapping[str, float] = field(default_factory=dict)
    """Kind (other than ``user``) -> the largest |(row's measured / predicted) / (command's measured / predicted) - 1|
    of the ledger's rows of that kind: the error of a predicted speed over the command."""

    def of(self, kind: str) -> float:
        """The error of ``kind``; a kind the ledger had no row of takes the largest of the kinds that change more or
        as much (its error is not smaller than theirs would be)."""
        return _largest_from(self.by_kind, kind)

    def gain_of(self, kind: str) -> float:
        """The error of the predicted speed of a row of ``kind`` over the command: 0 for the command itself; without a
        measured gain error, the bound the two time errors give (the row's plus the command's)."""
        if kind == "user":
            return 0.0
        if self.gain_by_kind:
            return _largest_from(self.gain_by_kind, kind)
        return self.of(kind) + self.of("user")


def _largest_from(by_kind: Mapping[str, float], kind: str) -> float:
    if kind in by_kind:
        return by_kind[kind]
    later = [by_kind[k] for k in KINDS[KINDS.index(kind):] if k in by_kind]
    return max(later or list(by_kind.values()) or [0.0])


def load_errors(path: str = ERRORS_FILE) -> ErrorTable:
    """The error table of ``path``; a missing or malformed file is an error naming it and the script that writes it."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
        by_kind = {str(k): float(v) for k, v in data["by_kind"].items()}
        gain_by_kind = {str(k): float(v) for k, v in data.get("gain_by_kind", {}).items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{path}: the advice's measured errors cannot be read ({error}); "
                         "scripts/advice_accuracy.sh --write-errors writes it") from error
    unknown = sorted((set(by_kind) | set(gain_by_kind)) - set(KINDS))
    if unknown:
        raise ValueError(f"{path}: unknown kinds of row {unknown}; known: {', '.join(KINDS)}")
    return ErrorTable(by_kind, str(data.get("source", "")), gain_by_kind)


def row_kind(row, user) -> str:
    """The kind (:data:`KINDS`) of an :class:`~.advice_rows.AdviceRow` against the user's row."""
    if row is user or row.name == "user":
        return "user"
    if row.layout != user.layout:
        return "changed layout"
    if row.micro_batch_size is not None:  # set only where it changes the command's
        return "changed micro-batch size"
    if row.vpp != user.vpp:
        return "changed V"
    return "same layout"


@dataclass(frozen=True)
class RowInterval:
    """A row's predicted iteration time with its interval."""

    name: str
    kind: str
    """Its kind (:data:`KINDS`)."""
    predicted_s: float
    error: float
    """Relative half-width of the predicted time: the kind's measured error and the profile's spread combined."""
    gain_error: float
    """Relative half-width of the predicted time against the command's prediction: the kind's gain error and the
    profile's spread combined (the command's own: the spread alone)."""

    def within(self, error: float) -> Tuple[float, float]:
        """The predicted time lowered and raised by the relative ``error``."""
        return self.predicted_s * (1.0 - error), self.predicted_s * (1.0 + error)

    def to_dict(self) -> Dict[str, object]:
        return {"kind": self.kind, "error": self.error, "interval_s": list(self.within(self.error)),
                "gain_error": self.gain_error}


def interval(row, user, errors: ErrorTable, spread: float = 0.0) -> RowInterval:
    """The interval of ``row``: its kind's errors and the profile's relative ``spread`` combined."""
    kind = row_kind(row, user)
    return RowInterval(row.name, kind, row.iteration_s, math.hypot(errors.of(kind), spread),
                       math.hypot(errors.gain_of(kind), spread))


@dataclass(frozen=True)
class Choice:
    """The row to run and why."""

    run: Optional[str]
    """The row's name (``user``: keep the command); None when no row fits."""
    reason: str
    """One sentence: why this row."""
    intervals: Dict[str, RowInterval]
    """Every row's interval, by name."""
    kept: bool = False
    """The command was kept although another row was predicted faster (the gain is inside the error)."""


def choose(rows: Sequence, errors: ErrorTable, spread: float = 0.0) -> Choice:
    """The row to run among ``rows`` (:class:`~.advice_rows.AdviceRow`, the user's named ``user``; rows that do not fit
    are never chosen) with the module docstring's rule."""
    user = next(row for row in rows if row.name == "user")
    intervals = {row.name: interval(row, user, errors, spread) for row in rows}
    fitting = [row for row in rows if row.fits]
    if not fitting:
        return Choice(None, "no row fits the memory", intervals)
    fastest = min(fitting, key=lambda row: row.iteration_s)
    bounds = {name: found.within(found.gain_error) for name, found in intervals.items()}  # (low, high)
    near = [row for row in fitting if bounds[row.name][0] <= bounds[fastest.name][1]]
    if user.fits:
        if fastest is user:
            return Choice("user", "your command is predicted the fastest", intervals)
        near = [row for row in near if bounds[row.name][1] < bounds["user"][0]]
        if not near:
            return Choice("user", _keep(fastest, user, intervals), intervals, kept=True)
    least = min(near, key=lambda row: (KINDS.index(intervals[row.name].kind), row.iteration_s))
    if not user.fits:
        return Choice(least.name, _why(least, fastest, intervals, "your command does not fit the memory"), intervals)
    gain = user.iteration_s / least.iteration_s - 1.0
    return Choice(least.name, _why(least, fastest, intervals, f"predicted {100 * gain:.0f}% faster than your command, "
                                   f"beyond the advice's error ({_band(intervals[least.name], intervals['user'])})"),
                  intervals)


def _band(row: RowInterval, user: RowInterval) -> str:
    spread = f", ±{100 * user.gain_error:.0f}% for the profile's spread on your command" if user.gain_error else ""
    return f"±{100 * row.gain_error:.0f}% for a row of kind '{row.kind}' against your command{spread}"


def _keep(best, user, intervals: Mapping[str, RowInterval]) -> str:
    gain = user.iteration_s / best.iteration_s - 1.0
    margin = intervals[best.name].gain_error + intervals["user"].gain_error
    return (f"keep your command: the best row ({best.name}) is predicted {100 * gain:.0f}% faster, inside the advice's "
            f"error of ±{100 * margin:.0f}% ({_band(intervals[best.name], intervals['user'])})")


def _why(chosen, fastest, intervals: Mapping[str, RowInterval], head: str) -> str:
    if chosen is fastest:
        return head
    return (f"{head}; the fastest row ({fastest.name}, {fastest.iteration_s:.3f} s) is within the error of this one, "
            f"which changes less ({intervals[chosen.name].kind})")


def worst_errors(rows: Sequence[Tuple[str, float]]) -> Dict[str, float]:
    """Per kind, the largest |measured / predicted - 1| of ``rows`` ((kind, measured / predicted) pairs): the ledger's
    error table."""
    out: Dict[str, float] = {}
    for kind, ratio in rows:
        out[kind] = max(out.get(kind, 0.0), abs(ratio - 1.0))
    return {kind: out[kind] for kind in KINDS if kind in out}


def gain_errors(rows: Sequence[Tuple[str, float, float]]) -> Dict[str, float]:
    """Per kind other than ``user``, the largest error of a predicted speed over the command: ``rows`` are (kind, the
    row's measured / predicted, the command's measured / predicted) of rows measured beside their command."""
    return worst_errors([(kind, ratio / user_ratio) for kind, ratio, user_ratio in rows if kind != "user"])


def error_file(by_kind: Mapping[str, float], source: str, gain_by_kind: Mapping[str, float]) -> str:
    """The JSON text of an error table (:func:`load_errors` reads it)."""
    return json.dumps({"by_kind": dict(by_kind), "gain_by_kind": dict(gain_by_kind), "source": source},
                      indent=1) + "\n"

