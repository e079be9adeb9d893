"""The number rules behind every numeric flag, and their argparse types: the ground layer that the flags
(:mod:`.config`), the ``pipemesh`` subcommands (:mod:`.cli`) and the bench all read, importing nothing of the
package."""
from __future__ import annotations

import argparse
import math
from typing import Optional


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1, with a message naming what was given."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {value}")
    return value


def parse_number(text: str) -> Optional[float]:
    """The number ``text`` spells, or None."""
    try:
        return float(text)
    except ValueError:
        return None


def number_rule(value: float, positive: bool = False, at_most: Optional[float] = None) -> Optional[str]:
    """The rule ``value`` breaks ('a positive number', 'a number >= 0', '... and at most X'), or None when it is
    finite and >= 0 (> 0 if ``positive``, <= ``at_most``): the one check behind every number flag."""
    if math.isfinite(value) and value >= 0 and not (positive and value == 0) and (at_most is None or value <= at_most):
        return None
    rule = "a positive number" if positive else "a number >= 0"
    return rule + (f" and at most {at_most:g}" if at_most is not None else "")


def _number_type(positive: bool):
    def number(text: str) -> float:
        value = parse_number(text)
        if value is None:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
        if number_rule(value, positive):
            raise argparse.ArgumentTypeError(f"expected {number_rule(value, positive)}, got {text!r}")
        return value
    return number


positive_number = _number_type(positive=True)
"""argparse type: a finite number > 0, with a message naming what was given."""
nonnegative_number = _number_type(positive=False)
"""argparse type: a finite number >= 0."""
