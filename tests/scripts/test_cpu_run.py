"""The single-node launcher really trains: tiny GPT on CPU, 2 ranks (gloo), PP=2, VP=2, PipeMesh groups."""
from __future__ import annotations

import subprocess

from .helpers import PYTHON, REPO, SINGLE, clean_env, run


def test_single_node_cpu_demo(tmp_path):
    """The single-node launcher trains the tiny CPU config 3 iterations on the corpus, with per-rank logs."""
    prep = subprocess.run([PYTHON, "-m", "megatron_pipemesh.data.prepare", "--input",
                           str(REPO / "megatron_pipemesh" / "data" / "corpus"), "--output-prefix",
                           str(tmp_path / "corpus")], capture_output=True, text=True, cwd=str(REPO), timeout=120)
    assert prep.returncode == 0, prep.stderr
    data_flags = prep.stdout.strip().splitlines()[-1].split("Megatron flags:")[-1].split()
    assert data_flags[:2] == ["--data-path", str(tmp_path / "corpus")]
    run_dir = tmp_path / "run"
    res = run(SINGLE, ["--nproc", "2", "--config", "configs/tiny-cpu.env", "--python", PYTHON,
                       "--run-dir", str(run_dir), "--", *data_flags, "--data-cache-path", str(tmp_path / "cache")],
              env=clean_env({"PYTHONWARNINGS": "ignore"}), timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-5000:]
    assert "lm loss" in out
    assert "iteration        3/       3" in out
    # per-rank log files written by torchrun --log-dir --tee
    logs = sorted(p.relative_to(run_dir).parts[-2:] for p in run_dir.glob("torchrun/*/attempt_0/*/stdout.log"))
    assert logs == [("0", "stdout.log"), ("1", "stdout.log")]
    assert any("lm loss" in p.read_text() for p in run_dir.glob("torchrun/*/attempt_0/1/stdout.log"))
