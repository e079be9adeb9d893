"""Run a gpu_check check in a child Python (each check sets up its own one-process world), with the checks' package
importable as ``gpu_check_lib``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from ..helpers import REPO


def env() -> dict:
    environment = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    environment.pop("OUT", None)
    return environment


def run_child(code: str, timeout: int) -> subprocess.CompletedProcess:
    """``code`` (dedented) after ``scripts/`` is put on sys.path; returns the finished process (output captured)."""
    prelude = f"import sys\nsys.path.insert(0, {str(REPO / 'scripts')!r})\n"
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=str(REPO), env=env(),
                          capture_output=True, text=True, timeout=timeout)


def printed(proc: subprocess.CompletedProcess, label: str = "result"):
    """The JSON the child printed on its line starting with ``label`` (the child's output when there is none)."""
    line = next((l for l in proc.stdout.splitlines() if l.startswith(label + " ")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(line[len(label) + 1:])
