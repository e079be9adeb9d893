"""The memory-fair CPU benchmark with 8 ranks (``bench``), off unless asked: it can take the whole time budget."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .common import REPO, cores as available_cores

BENCH_RANKS = 8
"""Ranks of the benchmark (pp4xdp2): ``--bench auto`` runs it only with a core for each."""


def check_bench(out_dir: Path, deadline: float, mode: str):
    """``python -m megatron_pipemesh.bench --quick`` with 8 ranks (pp4xdp2), memory-fair when the bench
    offers it, within the time left."""
    cores = available_cores()
    if mode == "skip":
        return {"status": "skip", "reason": "--bench skip"}
    if mode == "auto" and cores < BENCH_RANKS:
        return {"status": "skip", "reason": f"{BENCH_RANKS} ranks need {BENCH_RANKS} cores without oversubscription; "
                                            f"this machine has {cores} (use --bench run to force)"}
    from megatron_pipemesh.bench.cli import add_bench_args

    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    options = {opt: action for action in parser._actions for opt in action.option_strings}
    json_path = out_dir / "bench.json"
    command = [sys.executable, "-m", "megatron_pipemesh.bench", "--quick", "--configs", "pp4xdp2"]
    notes = []
    if "--json" in options and options["--json"].nargs != 0:
        command += ["--json", str(json_path)]
    else:
        notes.append("this bench has no '--json FILE'; its summary.json is read from --out-dir")
        command += ["--out-dir", str(out_dir / "bench")]
    if "--pin-cores" in options:
        command.append("--pin-cores")  # one rank per core
    if "--activation-budget-mb" in options:
        command += ["--activation-budget-mb", "auto"]
    else:
        notes.append("this bench has no --activation-budget-mb: plain (not memory-fair) rows")
    rootless = os.geteuid() != 0
    if rootless:
        command.append("--unshaped")
        notes.append("not root: no shaped network namespace (--unshaped)")
    left = deadline - time.monotonic()
    if left < 60:
        return {"status": "skip", "reason": f"only {left:.0f} s of the time budget left", "command": command}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p]), OMP_NUM_THREADS="1")
    start = time.monotonic()
    try:
        proc = subprocess.run(command, cwd=str(REPO), env=env, capture_output=True, text=True, timeout=left)
    except subprocess.TimeoutExpired:
        return {"status": "fail", "reason": f"timed out after {left:.0f} s", "command": command, "notes": notes}
    summary = None
    for path in (json_path, out_dir / "bench" / "summary.json"):
        if path.exists():
            summary = json.loads(path.read_text())
            break
    status = "pass" if proc.returncode == 0 and summary is not None else "fail"
    return {"status": status, "seconds": time.monotonic() - start, "command": command, "notes": notes,
            "returncode": proc.returncode, "summary": summary,
            **({} if status == "pass" else {"output_tail": (proc.stdout + proc.stderr)[-3000:]})}


