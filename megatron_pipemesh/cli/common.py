"""What the ``pipemesh`` subcommands and the bench's share: the usage error, the number check that raises it (its
rules and argparse types are :mod:`..flag_types`, handed on here), the JSON output and the error-to-exit-code
rule."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from ..flag_types import nonnegative_number, number_rule, parse_number, positive_int, positive_number  # noqa: F401
from ..schedule.config import ScheduleConfigError
from ..schedule.timeline import ScheduleError


class UsageError(Exception):
    """Bad command-line input; printed as one paragraph, exit code 2."""


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


def old_spelling(new: str):
    """An argparse action for the old spelling of ``new`` (``parser.add_argument(NEW, OLD, action=old_spelling(NEW))``):
    it stores the value as ``new`` does and says once on stderr that ``new`` is the spelling to use."""

    class OldSpelling(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            if option_string != new:
                print(f"{parser.prog}: {option_string} is deprecated: it is spelled {new} now (same value and "
                      "unit)", file=sys.stderr)
            setattr(namespace, self.dest, values)

    return OldSpelling


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
