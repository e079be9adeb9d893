"""Every shell script under scripts/ is shellcheck-clean (skipped only when shellcheck is not installed:
apt-get install -y shellcheck)."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from .helpers import REPO

SCRIPTS = sorted(p for pattern in ("scripts/**/*.sh", "scripts/**/*.sbatch") for p in REPO.glob(pattern))


def test_scripts_found():
    """The shell scripts to check are all found."""
    names = {p.name for p in SCRIPTS}
    assert {"pretrain_gpt_pipemesh.sh", "pretrain_gpt_pipemesh.sbatch", "bench_schedules.sbatch", "common.sh",
            "srun_node.sh"} <= names


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not on PATH (apt-get install -y shellcheck)")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_shellcheck(script):
    """Every shell script passes shellcheck."""
    res = subprocess.run(["shellcheck", "--external-sources", "--shell=bash", str(script)], cwd=str(REPO),
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
