"""``pipemesh profile`` on the smallest command and ``--show``; ``pipemesh plan --megatron-args ... --profile`` with it
(cli/profile.py, cli/megatron_args.py)."""
import json
import math
import os
import subprocess
import sys

import pytest

from megatron_pipemesh.planning.advice_error import load_errors
from megatron_pipemesh.planning.profile import load
from tests.cli.test_commands import run

SMALL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
         "--micro-batch-size 2 --global-batch-size 8 --train-iters 3 --lr 1e-3 --mock-data "
         "--tokenizer-type NullTokenizer --vocab-size 257 --pipeline-model-parallel-size 2")
CLUSTER = ["--nodes", "1", "--gpus-per-node", "2", "--device-memory-gib", "1", "--nic-gbps", "0.1", "--quiet"]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """pipemesh profile of SMALL in its own process (it starts a process group and Megatron's parallel state)."""
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "megatron_pipemesh", "profile", "--megatron-args", SMALL,
                           "--output", str(path), "--repeats", "1", "--warmup", "1", "--max-seconds", "0",
                           "--max-micro-batch-size", "4",
                           "--ranks-per-node", "2"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return path, done


def test_profile_writes_the_file_with_progress_and_show_prints_it(measured):
    """The file holds the model shape, a point per micro-batch size 1, 2 and 4 (--max-micro-batch-size above the
    command's 2: the sizes the advice may change it to) with positive times and bytes (full
    recomputation keeps less than none), the optimizer rate and the notes, no network (one process); progress lines
    went to stderr; --show prints the same table."""
    path, done = measured
    data = json.loads(path.read_text())
    assert data["schema_version"] == 3 and data["device"]["kind"] == "cpu" and data["versions"]["megatron_core"]
    assert data["model"]["hidden_size"] == 64 and data["model"]["seq_length"] == 32 and data["model"]["dtype"] == "fp32"
    profile = load(str(path))
    assert [p.micro_batch_size for p in profile.compute] == [1, 2, 4]
    for point in profile.compute:
        assert point.layer_forward_s > 0 and point.layer_backward_s > 0 and point.output_forward_s > 0
        assert point.layer_activation_bytes["full"] < point.layer_activation_bytes["none"]
        assert set(point.recompute_extra_s) >= {"full"}
    # Twice the micro-batch keeps twice the bytes in a layer (every saved tensor scales with it).
    assert profile.compute[1].layer_activation_bytes["none"] == pytest.approx(
        2 * profile.compute[0].layer_activation_bytes["none"], rel=0.05)
    assert profile.optimizer_s_per_param > 0 and any("TP > 1" in note for note in profile.notes)
    # timed with a second core computing the command's layer, as two ranks will run (where this machine has two)
    assert profile.method["cores_computing"] == min(2, len(os.sched_getaffinity(0)))
    # the mock data's loader, timed at every size
    assert all(point.batch_s > 0 for point in profile.compute)
    # the schedule step beyond the pieces, on every kind of chunk, never below 0
    assert all(set(point.step_forward_s) == set(point.step_backward_s) == {"only", "first", "middle", "last"}
               and min(point.step_forward_s.values()) >= 0 for point in profile.compute)
    assert "micro-batch 4: schedule step beyond the pieces" in done.stderr
    assert "pipemesh profile [" in done.stderr and "micro-batch 2: layer forward" in done.stderr
    assert "micro-batch 4: data loader" in done.stderr and "> building train" not in done.stdout + done.stderr
    code, out, err = run(["profile", "--show", str(path)])
    assert code == 0, err
    assert "hidden 64" in out and "optimizer step" in out and "batch ms" in out and out in done.stdout
    assert "step F+B ms only/first/middle/last stage" in out
    # stdout carries the table alone: Megatron's warnings go to stderr
    assert not [line for line in done.stdout.splitlines() if "WARNING" in line]
    assert profile.network is None and "network: not measured (one process)" in out
    # the machine's pace, ticked once per timed round (warm-up rounds and the first reading's ticks aside, at least
    # one per point's groups), is kept and shown; the progress says how far the first reading's pace was from it
    assert profile.pace.seconds > 0 and profile.pace.spread.samples > 15 + 3 * len(profile.compute)
    assert profile.pace.describe() in out and "the lines above at the first reading's pace, x " in done.stderr


def test_a_closed_pipe_ends_the_command_quietly(measured):
    """`pipemesh profile --show F | head -1` and `pipemesh plan ... | head -1`: the reader closes the pipe after one
    line; the command exits 0 with nothing on stderr (no BrokenPipeError traceback)."""
    path, _ = measured
    plan = ["plan", "--pp", "4", "--vpp", "2", "-m", "8", "--forward-ms", "1", "--memory-budget-gb", "20"]
    for words in (["profile", "--show", str(path)], plan):
        # The reader is gone before the command writes its first line (it is still importing).
        child = subprocess.Popen([sys.executable, "-m", "megatron_pipemesh", *words], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        child.stdout.close()
        err = child.stderr.read()
        assert child.wait(timeout=120) == 0 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_version_is_the_packages():
    """pipemesh --version prints the package's version (declared once, in megatron_pipemesh/__init__.py)."""
    import megatron_pipemesh

    done = subprocess.run([sys.executable, "-m", "megatron_pipemesh", "--version"], capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, f"pipemesh {megatron_pipemesh.__version__}")


def test_plan_with_the_profile_says_what_was_measured_and_refuses_another_model(measured):
    """The plan prices with the profile and names the measured and assumed costs, the link rates given or defaulted
    among the assumed; a command of another hidden size is refused in one line naming it, exit 2."""
    path, _ = measured
    code, out, err = run(["plan"] + CLUSTER + ["--megatron-args", SMALL, "--profile", str(path), "--json"])
    assert code == 0, err
    report = json.loads(out)["profile"]
    assert "layer forward/backward" in report["measured"]["1"] and "optimizer step" in report["measured"]["1"]
    assert "data loader" in report["measured"]["1"] and "schedule step" in report["measured"]["1"]
    assert "NIC 0.1 Gbit/s (--nic-gbps, given)" in report["assumed"]["1"]
    assert "intra-node link 100 Gbit/s (--intra-node-gbps default, not measured)" in report["assumed"]["1"]
    for key, found in report["measured"].items():  # rows at another micro-batch size: 1, 2 and 4 were measured
        assert "layer forward/backward" in found, key
    other = SMALL.replace("--hidden-size 64", "--hidden-size 128")
    code, out, err = run(["plan"] + CLUSTER + ["--megatron-args", other, "--profile", str(path)])
    assert code == 2 and out == ""
    assert err.strip() == (f"pipemesh plan: error: {path} was measured for hidden 64, this command has hidden 128: "
                           "re-run pipemesh profile with this command")


def test_a_data_path_that_cannot_be_read_here_leaves_the_loader_unmeasured_and_says_why(tmp_path):
    """The command's --data-path does not exist on this machine: the layers are still measured, the data loader is
    not, and a note says why (the dataset builder's own message) and that plans price it at 0."""
    path = tmp_path / "profile.json"
    command = SMALL.replace("--mock-data", "--data-path /nonexistent/corpus_text_document")
    done = subprocess.run([sys.executable, "-m", "megatron_pipemesh", "profile", "--megatron-args", command,
                           "--output", str(path), "--repeats", "1", "--warmup", "1", "--max-seconds", "0"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    profile = load(str(path))
    assert profile.compute and all(point.batch_s is None for point in profile.compute)
    note = [note for note in profile.notes if note.startswith("the data loader was not measured")]
    assert len(note) == 1 and "/nonexistent/corpus_text_document" in note[0] and note[0].endswith("plans price it at 0")
    code, out, err = run(["plan"] + CLUSTER + ["--megatron-args", command, "--profile", str(path), "--json"])
    assert code == 0, err
    assert "data loader" in json.loads(out)["profile"]["assumed"]["1"]


MOE = SMALL + (" --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 96 --moe-layer-freq [1,0] "
               "--disable-bias-linear --moe-token-dispatcher-type alltoall")


def test_a_moe_command_is_profiled_with_its_moe_and_dense_layers_and_planned_from_it(tmp_path):
    """The MoE command's profile names its MoE layers in the model shape, measures its layers (a MoE layer and, as
    --moe-layer-freq [1,0] has one, a dense layer), and plan --profile prices that command with it; the same model
    without experts is refused in one line that names the MoE layers."""
    path = tmp_path / "profile.json"
    done = subprocess.run([sys.executable, "-m", "megatron_pipemesh", "profile", "--megatron-args", MOE,
                           "--output", str(path), "--repeats", "1", "--warmup", "1", "--max-seconds", "0"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    profile = load(str(path))
    assert profile.shape.moe == "4 experts top-2 ffn 96 in 1 of 2 layers"
    assert profile.compute and all(p.layer_forward_s > 0 and p.layer_backward_s > 0 for p in profile.compute)
    code, out, err = run(["plan"] + CLUSTER + ["--megatron-args", MOE, "--profile", str(path), "--json"])
    assert code == 0, err
    assert "layer forward/backward" in json.loads(out)["profile"]["measured"]["1"]
    code, out, err = run(["plan"] + CLUSTER + ["--megatron-args", SMALL, "--profile", str(path)])
    assert code == 2 and out == ""
    assert "MoE layers 4 experts top-2 ffn 96 in 1 of 2 layers" in err and "re-run pipemesh profile" in err


def test_show_prints_each_piece_with_its_spread_and_the_load():
    """--show's table: one row per piece and size with its median, interval, IQR, samples and whether it stopped
    stable or at the time cap; the load record's line."""
    import dataclasses

    from megatron_pipemesh.cli.profile import table
    from megatron_pipemesh.planning.profile_quality import LoadRecord, spread_of
    from tests.planning.test_profile import point, profile

    spread = {"layer_forward_s": spread_of([0.004, 0.0041, 0.0039, 0.004, 0.0042], True),
              "recompute_extra_s:full": spread_of([0.001, 0.002, 0.0015, 0.001, 0.003], False)}
    busy = LoadRecord(cores=2, loadavg_before=(1.0, 0.5, 0.2), loadavg_after=(1.5, 0.6, 0.2),
                      others_cores={"layers mbs 2": 0.8})
    text = table(dataclasses.replace(profile(dataclasses.replace(point(), spread=spread)), load=busy), "p.json")
    rows = [line.split() for line in text.splitlines()]
    assert ["2", "layer_forward", "4.000", "3.7%", "2.5%", "5", "stable"] in rows
    assert ["2", "recompute_extra", "full", "1.500", "66.7%", "66.7%", "5", "at", "the", "time", "cap"] in rows
    assert "load while timing: load average 1.00 -> 1.50 on 2 core(s); other processes computed while timing " \
           "layers mbs 2 (0.80 cores)" in text


def _with_layer_spread(source, target, half_width):
    """``source``'s profile with every layer forward/backward median known to within +-``half_width`` (relative)."""
    data = json.loads(source.read_text())
    for point in data["compute"]:
        for name in ("layer_forward_s", "layer_backward_s"):
            median = point[name]
            point["spread"][name].update({"median_s": median, "low_s": median * (1 - half_width),
                                          "high_s": median * (1 + half_width)})
    target.write_text(json.dumps(data))
    return target


def test_a_profile_too_spread_to_tell_the_rows_apart_keeps_the_command(measured, tmp_path):
    """Medians known to +-1%: each row's interval is its kind's measured error (the ledger's) and 1%; known to +-60%,
    every interval is wider than any gain, and the advice says to keep the command with the gain and the error, in the
    JSON and in the text."""
    path, _ = measured
    tight = _with_layer_spread(path, tmp_path / "tight.json", 0.01)
    code, out, err = run(["plan"] + CLUSTER + ["--megatron-args", SMALL, "--profile", str(tight), "--json"])
    assert code == 0, err
    sharp = json.loads(out)
    assert sharp["profile_spread"] == pytest.approx(0.01)
    table = load_errors()
    for row in sharp["rows"].values():  # the ledger's error of each row's kind, and the spread
        assert row is None or row["error"] == pytest.approx(math.hypot(table.of(row["kind"]), 0.01))
    wide = _with_layer_spread(path, tmp_path / "wide.json", 0.95)
    code, out, err = run(["plan"] + CLUSTER + ["--megatron-args", SMALL, "--profile", str(wide), "--json"])
    assert code == 0, err
    found = json.loads(out)
    assert found["run"] == "user" and found["kept_command"] and found["profile_spread"] == pytest.approx(0.95)
    assert found["run_reason"].startswith("keep your command: the best row (")
    assert "inside the advice's error of ±1" in found["run_reason"]
    kept_for = found["run_reason"].split("(")[1].split(")")[0]  # the row the reason names
    assert found["rows"][kept_for]["interval_s"][1] >= found["rows"]["user"]["interval_s"][0]
    code, out, err = run(["plan"] + CLUSTER + ["--megatron-args", SMALL, "--profile", str(wide)])
    assert code == 0 and "\nrun (user: keep your command: the best row (" in out
