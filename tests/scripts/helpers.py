"""Shared helpers of the launcher tests: run a script under a controlled (fake Slurm) environment."""
from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[2]
SINGLE = REPO / "scripts" / "pretrain_gpt_pipemesh.sh"
SBATCH = REPO / "scripts" / "slurm" / "pretrain_gpt_pipemesh.sbatch"
BENCH = REPO / "scripts" / "slurm" / "bench_schedules.sbatch"
VENV_PYTHON = REPO / ".venv" / "bin" / "python"
PYTHON = str(VENV_PYTHON if VENV_PYTHON.exists() else Path(sys.executable))
ENTRY = "megatron_pipemesh.training.pretrain_gpt"

# Variables a developer's shell or CI may carry that would change what the scripts do.
_SCRUB_PREFIXES = ("SLURM_", "PIPEMESH_", "NCCL_", "GLOO_")
_SCRUB = {"MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE", "MEGATRON_LM_DIR", "CUDA_DEVICE_MAX_CONNECTIONS",
          "OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "PYTHONPATH"}


def write_exe(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


FAKE_SRUN = f"""#!{sys.executable}
# Fake srun: records its argv, then runs the task command once per node (SLURM_NODEID = 0..n-1),
# writing each task's output to --output with %j / %t / %n replaced.
import json, os, subprocess, sys
args = sys.argv[1:]
with open(os.environ["FAKE_SLURM_LOG"], "a") as fh:
    fh.write(json.dumps(["srun"] + args) + "\\n")
nodes, output, i = 1, None, 0
while i < len(args) and args[i].startswith("-"):
    a = args[i]
    if a in ("--nodes", "-N"):
        nodes = int(args[i + 1]); i += 2; continue
    if a in ("--output", "-o"):
        output = args[i + 1]; i += 2; continue
    if a.startswith("--output="):
        output = a.split("=", 1)[1]
    if a in ("--ntasks", "--ntasks-per-node", "-n"):
        i += 2; continue
    i += 1
cmd = args[i:]
status = 0
for node in range(nodes):
    env = dict(os.environ, SLURM_NODEID=str(node), SLURM_PROCID=str(node), SLURM_LOCALID="0")
    out = None
    if output:
        path = output.replace("%j", os.environ.get("SLURM_JOB_ID", "")).replace("%t", str(node)).replace("%n", str(node))
        out = open(path, "w")
    status |= subprocess.call(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None)
sys.exit(status)
"""

FAKE_SCONTROL = """#!/usr/bin/env bash
# Fake scontrol: only "show hostnames LIST"; prints FAKE_HOSTNAMES (one per line).
echo "scontrol $*" >>"$FAKE_SLURM_LOG"
if [ "$1 $2" = "show hostnames" ]; then printf '%s\\n' $FAKE_HOSTNAMES; exit 0; fi
exit 1
"""

FAKE_PYTHON = f"""#!{sys.executable}
# Fake interpreter: records its argv (one JSON line) and exits 0.
import json, os, sys
with open(os.environ["FAKE_PYTHON_LOG"], "a") as fh:
    fh.write(json.dumps(sys.argv[1:]) + "\\n")
"""


def clean_env(extra: Optional[Dict[str, str]] = None, path_prefix: Optional[Path] = None) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_SCRUB_PREFIXES) and k not in _SCRUB}
    if path_prefix is not None:
        env["PATH"] = f"{path_prefix}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra or {})
    return env


def fake_slurm(tmp_path: Path, nodelist: str = "node[01-03,07],gpu5",
               hostnames: Optional[Sequence[str]] = ("node01", "node02", "node03", "node07", "gpu5"),
               nnodes: Optional[int] = 5, gpus: Optional[str] = "8", job_id: str = "4242",
               scontrol: bool = True) -> Dict[str, str]:
    """A fake Slurm job environment with srun (and scontrol) on PATH under tmp_path/bin."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    write_exe(bin_dir / "srun", FAKE_SRUN)
    if scontrol:
        write_exe(bin_dir / "scontrol", FAKE_SCONTROL)
    extra = {"SLURM_JOB_ID": job_id, "SLURM_JOB_NODELIST": nodelist, "SLURM_NODEID": "0",
             "SLURM_JOB_NAME": "pm-test", "SLURM_SUBMIT_DIR": str(REPO),
             "FAKE_SLURM_LOG": str(tmp_path / "slurm.log"), "FAKE_HOSTNAMES": " ".join(hostnames or ())}
    if nnodes is not None:
        extra["SLURM_NNODES"] = str(nnodes)
    if gpus is not None:
        extra["SLURM_GPUS_ON_NODE"] = gpus
    return clean_env(extra, bin_dir)


def run(script: Path, args: Sequence[str], env: Optional[Dict[str, str]] = None, cwd: Optional[Path] = None,
        timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], env=env if env is not None else clean_env(),
                          cwd=str(cwd or REPO), capture_output=True, text=True, timeout=timeout)


def commands(stdout: str) -> List[List[str]]:
    """The printed commands (comment lines skipped), each split like a shell would."""
    return [shlex.split(line) for line in stdout.splitlines() if line.strip() and not line.startswith("#")]


def exports(cmds: List[List[str]]) -> Dict[str, str]:
    out = {}
    for c in cmds:
        if c and c[0] == "export":
            k, _, v = c[1].partition("=")
            out[k] = v
    return out


def find(cmds: List[List[str]], first: str) -> List[List[str]]:
    return [c for c in cmds if c and c[0] == first]


def option(cmd: Sequence[str], flag: str) -> str:
    """Value after the last occurrence of flag in cmd."""
    idx = max(i for i, a in enumerate(cmd) if a == flag)
    return cmd[idx + 1]


def training_args(cmd: Sequence[str]) -> List[str]:
    """The arguments after `-m megatron_pipemesh.training.pretrain_gpt`."""
    i = list(cmd).index(ENTRY)
    assert cmd[i - 1] == "-m"
    return list(cmd[i + 1:])
