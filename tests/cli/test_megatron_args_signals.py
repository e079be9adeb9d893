"""``pipemesh plan --megatron-args`` stopped by a signal (cli/megatron_args.py): SIGINT (sent to the whole process
group, as a terminal's Ctrl-C is) and SIGTERM (to the command, and to its group) during the layout search print the rows found so far with the note of a
stopped search, exit with 128 + the signal, and leave none of the search's worker processes alive."""
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from megatron_pipemesh.cli.megatron_args import INTERRUPTED_STATUS

# Llama-3-8B on 4 x 8 H100 (scripts/advice_speed.sh): the user layout's rows in ~5 s, then a layout search of ~30 s on
# two workers, long enough to be interrupted in the middle.
LLAMA_8B = ("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention --num-query-groups 8 "
            "--ffn-hidden-size 14336 --swiglu --normalization RMSNorm --position-embedding-type rope "
            "--untie-embeddings-and-output-weights --disable-bias-linear --seq-length 8192 --max-position-embeddings 8192 "
            "--micro-batch-size 1 --global-batch-size 256 --bf16 --use-distributed-optimizer "
            "--tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 --mock-data --tokenizer-type NullTokenizer "
            "--vocab-size 128256 --transformer-impl local --train-iters 1000 --lr 1e-4")
CLUSTER = ["--nodes", "4", "--gpus-per-node", "8", "--gpu", "H100", "--nic-gbps", "100"]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _interrupt(number: int, group: bool):
    """Start the search, wait until the layout search runs on its workers, send ``number`` (to the process group with
    ``group``); (exit status, stdout, stderr, the workers seen)."""
    argv = [sys.executable, "-m", "megatron_pipemesh", "plan", *CLUSTER, "--jobs", "2", "--search-seconds", "0",
            "--megatron-args", LLAMA_8B]
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    err = []
    try:
        for line in child.stderr:
            err.append(line)
            if line.split("] ", 1)[-1].startswith("best_layout_stock: "):  # the layout search runs and has found one
                break
        time.sleep(1.0)
        workers = [p.pid for p in psutil.Process(child.pid).children(recursive=True)]
        assert len(workers) == 2, "".join(err)
        (os.killpg if group else os.kill)(child.pid, number)
        out, rest = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    return child.returncode, out, "".join(err) + rest, workers


@pytest.mark.parametrize("number,group", [(signal.SIGINT, True), (signal.SIGTERM, False), (signal.SIGTERM, True)])
def test_a_signal_prints_the_rows_found_so_far_and_ends_every_worker(number, group):
    """The rows of the user's layout and the best layouts found so far are printed with the note of an interrupted
    search (its bound on what was left), the exit status is 128 + the signal, no traceback, and both workers are gone
    (a worker left alive, or a KeyboardInterrupt in one, fails here). Sent to the whole group (a terminal, ``timeout``,
    ``scancel``), the workers leave it to the command: its message once, not once per process."""
    code, out, err, workers = _interrupt(number, group)
    name = signal.Signals(number).name
    assert code == INTERRUPTED_STATUS[name] == 128 + number, err
    assert err.count(f"{name}: stopping the search") == 1 and "Traceback" not in err, err
    for row in ("user", "best_stock", "best_layout_stock"):
        assert any(line.startswith(row + " ") for line in out.splitlines()), out
    assert f"note: the layout search was interrupted ({name}) after " in out, out
    assert "the rest run no faster than" in out and "no stock setting fits" not in out, out
    assert "--num-layers 32 " in out.rstrip().splitlines()[-1], out  # the command to run
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(pid) for pid in workers), [pid for pid in workers if not _gone(pid)]


def test_interrupted_exit_status_is_documented():
    """The statuses the help gives are the ones the command returns."""
    from megatron_pipemesh.cli.megatron_args import build_advice_parser

    text = " ".join(build_advice_parser().format_help().split())
    assert f"128 + the signal ({INTERRUPTED_STATUS['SIGINT']} / {INTERRUPTED_STATUS['SIGTERM']})" in text
    assert "0: search to the end" in text
