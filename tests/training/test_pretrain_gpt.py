"""End-to-end: pipemesh-pretrain-gpt under torchrun on the shipped corpus (default schedule)."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import megatron_harness as h  # noqa: E402

from megatron_pipemesh.training.pretrain_gpt import _pop_flag, prepare_argv  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

TINY_GPT = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "2", "--global-batch-size", "8",
    "--train-iters", "3", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
    "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1",
    "--num-workers", "0", "--seed", "1234",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from megatron_pipemesh.data.prepare import default_corpus_dir, prepare_corpus

    prefix = tmp_path_factory.mktemp("data") / "corpus"
    stats = prepare_corpus(default_corpus_dir(), prefix)
    return stats["megatron_args"]


def _iteration_losses(log: str):
    from megatron_pipemesh.bench.logparse import parse_log

    return [it.loss for it in parse_log(log).iterations]


def test_pp2_vp2_default_schedule_on_corpus(corpus, tmp_path):
    """The CPU entry point trains PP=2, VP=2 on the corpus for 3 iterations with finite losses."""
    args = TINY_GPT + corpus + [
        "--split", "98,1,1", "--data-cache-path", str(tmp_path / "cache"),
        "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
        "--clip-grad", "1.0",
    ]
    cp = h.run_torchrun([str(REPO / "scripts" / "pretrain_gpt.py")] + args, nproc=2, timeout=150)
    assert cp.returncode == 0, h.failure_excerpt(cp.stdout, 6000)
    losses = _iteration_losses(cp.stdout)
    assert len(losses) == 3, cp.stdout[-4000:]
    assert all(0.0 < x < 10.0 for x in losses)
    assert "Number of virtual stages per pipeline stage: 2" in cp.stdout
    assert "CPU RNG state changed" not in cp.stdout  # quiet CPU mode: dropout is on here (docs/cpu.md)


def test_pop_own_flag_and_cpu_args():
    """The entry point takes out its own --megatron-lm-script flag and adds missing CPU flags only without CUDA."""
    script, rest = _pop_flag(["--a", "--megatron-lm-script", "x.py", "--b"], "--megatron-lm-script")
    assert script == "x.py" and rest == ["--a", "--b"]
    script, rest = _pop_flag(["--megatron-lm-script=y.py"], "--megatron-lm-script")
    assert script == "y.py" and rest == []
    cpu = prepare_argv(["--distributed-backend", "gloo"], cuda=False)
    assert cpu.count("--distributed-backend") == 1 and "--use-cpu-initialization" in cpu
    assert prepare_argv(["--transformer-impl", "transformer_engine"], cuda=True) == [
        "--transformer-impl", "transformer_engine"]


def test_megatron_lm_script_mode(tmp_path):
    """--megatron-lm-script runs a checkout's script as __main__ with its folder on sys.path."""
    (tmp_path / "gpt_builders.py").write_text("VALUE = 42\n")
    out_file = tmp_path / "out.json"
    (tmp_path / "pretrain_gpt.py").write_text(textwrap.dedent(f"""
        import json, sys
        import gpt_builders
        import megatron.core, megatron.training.models.gpt  # importable after the bootstrap
        if __name__ == "__main__":
            json.dump({{"argv": sys.argv, "value": gpt_builders.VALUE}}, open({str(out_file)!r}, "w"))
    """))
    cp = subprocess.run([sys.executable, "-m", "megatron_pipemesh.training.pretrain_gpt",
                         "--megatron-lm-script", str(tmp_path / "pretrain_gpt.py"), "--num-layers", "2"],
                        capture_output=True, text=True, cwd=REPO, timeout=120)
    assert cp.returncode == 0, cp.stderr[-4000:]
    res = json.loads(out_file.read_text())
    assert res["value"] == 42
    assert res["argv"][0].endswith("pretrain_gpt.py")
    assert "--megatron-lm-script" not in res["argv"] and "--num-layers" in res["argv"]
    import torch

    if not torch.cuda.is_available():
        assert "--distributed-backend" in res["argv"]


def test_on_prepared_runs_after_preparation_before_training(monkeypatch):
    """A launcher's hook (the bench's activation meter) runs once the process is prepared (PipeMesh installed)
    and before Megatron parses the command line."""
    from megatron_pipemesh.training import pretrain_gpt

    calls = []
    monkeypatch.setattr(sys, "argv", ["pipemesh-pretrain-gpt"])
    monkeypatch.setattr(pretrain_gpt, "_prepare_process", lambda: calls.append("prepare") or False)
    monkeypatch.setattr(pretrain_gpt, "prepare_argv", lambda argv, cuda: calls.append(("argv", cuda)) or argv)
    monkeypatch.setattr(pretrain_gpt, "_pretrain", lambda: calls.append(("train", sys.argv[1:])))
    pretrain_gpt.main(["--x"], on_prepared=lambda: calls.append("hook"))
    assert calls == ["prepare", "hook", ("argv", True), ("train", ["--x"])]
