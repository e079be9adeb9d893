"""The issue's done-when for ``pipemesh plan --megatron-args``: every row's flags run unchanged with
``torchrun --nproc-per-node 4 scripts/pretrain_gpt.py`` on CPU; the rows that keep the user's layout and V give the
user's losses (dropout 0); the others train (Megatron seeds each stage by its pipeline rank and initialises a rank's
layers in chunk order, so another layout or V starts from other weights).

Rows whose flags Megatron validates to the same settings are the same run and are trained once.
"""
import contextlib
import io
import json
import math
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import megatron_harness as h  # noqa: E402

from megatron_pipemesh.command import main  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# tests/training/test_pretrain_gpt.py's TINY_GPT on mock data at PP=2, V=2, dropout 0, two iterations.
TINY = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
        "--micro-batch-size 2 --global-batch-size 8 --train-iters 2 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine "
        "--eval-iters 0 --eval-interval 1000 --log-interval 1 --num-workers 0 --seed 1234 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 257 --hidden-dropout 0 --attention-dropout 0 "
        "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2")


def _advice() -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["plan", "--megatron-args", TINY, "--nodes", "1", "--gpus-per-node", "4", "--device-memory-gib", "1",
                     "--nic-gbps", "0.25", "--json"])
    assert code == 0
    return json.loads(out.getvalue())


def _settings(flags) -> str:
    """What Megatron makes of ``flags`` on 4 ranks: its validated namespace (equal for the same run)."""
    from megatron_pipemesh.integration.megatron_command import parse_megatron_command

    args = vars(parse_megatron_command(flags, 4))
    return repr(sorted((k, repr(v)) for k, v in args.items()))


def _losses(flags):
    from megatron_pipemesh.bench.logparse import parse_log

    cp = h.run_torchrun([str(REPO / "scripts" / "pretrain_gpt.py")] + list(flags), nproc=4, timeout=240)
    assert cp.returncode == 0, h.failure_excerpt(cp.stdout, 6000)
    return [it.loss for it in parse_log(cp.stdout).iterations]


def test_every_row_runs_and_the_user_layout_rows_match_the_user():
    advice = _advice()
    rows = {name: row for name, row in advice["rows"].items() if row is not None}
    assert {"user", "best_stock", "pipemesh", "best_layout"} <= set(rows), advice["notes"]
    runs = {}  # validated settings -> losses
    for name, row in rows.items():
        words = shlex.split(row["command"])
        program, flags = words[:len(words) - len(row["flags"])], words[len(words) - len(row["flags"]):]
        assert flags == row["flags"]  # the command is the flags, a PipeMesh row's behind PipeMesh's entry point
        assert program == (["pipemesh-pretrain-gpt"] if row["schedule"] == "pipemesh" else []), name
        key = _settings(row["flags"])
        if key not in runs:
            runs[key] = _losses(row["flags"])
        row["losses"] = runs[key]
    user = rows["user"]["losses"]
    assert len(user) == 2 and all(math.isfinite(x) and 0 < x < 10 for x in user)
    for name, row in rows.items():
        assert len(row["losses"]) == 2 and all(math.isfinite(x) for x in row["losses"]), name
        if row["keeps_user_layout"]:
            assert row["losses"] == user, name
    assert rows["pipemesh"]["keeps_user_layout"]
