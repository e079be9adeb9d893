"""The ``pipemesh`` command's table: the subcommands of :mod:`.cli` and of the wings (``bench``, ``study``,
``headroom``), ``--version``, and a closed pipe that ends the command quietly. It stands above every layer and wing,
so that none of them imports another upwards to find its parser.

    pipemesh {show,simulate,plan,profile,bench,study,headroom} ...    (python -m megatron_pipemesh ...)
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from . import __version__
from .cli.common import run_command
from .cli.parser import add_subcommands, own_words


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipemesh", description="PipeMesh elastic pipeline schedules for Megatron-LM "
                                     "(no GPU needed). Each subcommand's --help lists its flags.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_subcommands(sub)
    from .bench.cli import add_bench_parser
    add_bench_parser(sub)
    from .study.study import add_study_parser
    add_study_parser(sub)
    from .study.headroom import add_headroom_parser
    add_headroom_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``pipemesh`` console entry point. A reader that stops early (``pipemesh ... | head -1``) ends it with
    status 0 and nothing on stderr, as a shell tool ends."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        code = own_words(argv)
        if code is None:
            code = run_command(build_parser().parse_args(argv))
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # What is left in Python's buffer would fail again at exit: point stdout at nothing.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
