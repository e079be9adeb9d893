"""What the ``pipemesh`` command and its ``bench`` subcommand share: the usage error, argument checks and
the error-to-exit-code rule.  A leaf module, so ``cli`` and ``bench.cli`` need not import each other."""
from __future__ import annotations

import argparse
import math
import sys
from typing import Optional

from .schedule.config import ScheduleConfigError
from .schedule.timeline import ScheduleError


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


def check_number(flag: str, value: Optional[float], example: str, positive: bool = False,
                 at_most: Optional[float] = None) -> None:
    """UsageError unless ``value`` is finite and >= 0 (> 0 if ``positive``, <= ``at_most``); None passes."""
    if value is None:
        return
    bad = not math.isfinite(value) or value < 0 or (positive and value == 0) or (at_most is not None and value > at_most)
    if bad:
        rule = "a positive number" if positive else "a number >= 0"
        if at_most is not None:
            rule += f" and at most {at_most:g}"
        raise UsageError(f"{flag} {value} is invalid: it must be {rule}. Example: {flag} {example}")


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
