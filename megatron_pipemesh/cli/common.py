"""What the ``pipemesh`` command and its ``bench`` subcommand share: the usage error, argument checks and
the error-to-exit-code rule.  A leaf module, so the subcommands and ``bench.cli`` need not import each other."""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Optional

from ..schedule.config import ScheduleConfigError
from ..schedule.timeline import ScheduleError


class UsageError(Exception):
    """Bad command-line input; printed as one paragraph, exit code 2."""


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


def check_number(flag: str, value: Optional[float], example: str, positive: bool = False,
                 at_most: Optional[float] = None, required: bool = False) -> None:
    """UsageError unless ``value`` keeps :func:`number_rule`; None passes unless ``required``."""
    if value is None:
        if required:
            raise UsageError(f"{flag} needs a number. Example: {flag} {example}")
        return
    rule = number_rule(value, positive, at_most)
    if rule:
        raise UsageError(f"{flag} {value} is invalid: it must be {rule}. Example: {flag} {example}")


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


def require_matplotlib(flag: str) -> None:
    """UsageError (one line, exit 2) naming the package to install when ``flag`` needs matplotlib but it
    cannot be imported (it is an install requirement, so this means a broken or hand-made environment)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise UsageError(f"{flag} needs matplotlib, which cannot be imported here ({error}): "
                         "pip install matplotlib") from error


def run_command(args: argparse.Namespace) -> int:
    """Run the parsed subcommand; bad input (usage, schedule or group errors) prints one line, exit 2."""
    try:
        return args.func(args)
    except (ScheduleConfigError, UsageError, ScheduleError) as error:
        print(f"pipemesh {args.command}: error: {error}", file=sys.stderr)
        return 2


def emit_json(document, target: Optional[str]) -> bool:
    """``--json [FILE]``: write ``document`` to FILE, or print it for ``-``; True when printed (then the table is not)."""
    if target and target != "-":
        with open(target, "w", encoding="utf-8") as handle:
            json.dump(document, handle, indent=1)
    if target == "-":
        print(json.dumps(document, indent=1))
        return True
    return False
