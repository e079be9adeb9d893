"""The ``pipemesh`` command: show / simulate output, files it writes, and one-paragraph usage errors."""
import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_pipemesh.command import main
from megatron_pipemesh.schedule import ScheduleConfig, compute_program, lower

REPO = Path(__file__).resolve().parents[2]
SCHEDULE = ["--pp", "4", "--vpp", "2", "--microbatches", "12", "--forward-groups", "8", "4", "--backward-groups", "6", "6"]
CONFIG = ScheduleConfig(4, 2, 12, (8, 4), (6, 6))
DIRECT = ["--forward-ms", "1", "--dp-reduce-ms", "20", "--dp-gather-ms", "20", "--p2p-ms", "0.01"]


def run(argv):
    """Run the CLI in-process; return (exit code, stdout, stderr). argparse errors exit via SystemExit."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


# ---------------------------------------------------------------------------------------------
# show


def test_show_text():
    """`show` prints a header with the flags and digest, then one line per rank with its compute order."""
    code, out, err = run(["show"] + SCHEDULE)
    assert code == 0 and err == ""
    lines = out.strip().splitlines()
    assert lines[0].startswith("# " + CONFIG.describe())
    assert lower(CONFIG).digest() in lines[0]
    assert lines[1:] == [f"rank {r}: " + " ".join(map(str, compute_program(CONFIG, r))) for r in range(4)]


def test_show_json():
    """`show --json` gives {"schedule", "digest", "ranks"} with each rank's compute order."""
    code, out, _ = run(["show"] + SCHEDULE + ["--json"])
    assert code == 0
    data = json.loads(out)
    assert data["schedule"] == CONFIG.describe()
    assert data["digest"] == lower(CONFIG).digest()
    assert data["ranks"] == [[str(op) for op in compute_program(CONFIG, r)] for r in range(4)]


def test_show_json_lowered():
    """`show --json --lowered` lists the full lowered programs (sends, receives, DP syncs)."""
    code, out, _ = run(["show"] + SCHEDULE + ["--json", "--lowered"])
    assert code == 0
    ranks = json.loads(out)["ranks"]
    assert ranks == [[str(op) for op in program] for program in lower(CONFIG).programs]
    assert any(op.startswith("SEND_F") for op in ranks[0]) and any(op.startswith("RECV_B") for op in ranks[0])
    assert "GRAD_SYNC0" in ranks[0] and "PARAM_SYNC0" in ranks[0]


def test_show_text_lowered():
    """`show --lowered` prints the lowered programs as text."""
    code, out, _ = run(["show"] + SCHEDULE + ["--lowered"])
    assert code == 0
    lines = out.strip().splitlines()[1:]
    assert lines == [f"rank {r}: " + " ".join(map(str, p)) for r, p in enumerate(lower(CONFIG).programs)]


def test_show_picture_with_two_digit_microbatches():
    """`show --picture -m 12` lists every rank's ops as separate words in compute order (no `F0.10B1.4`)."""
    code, out, _ = run(["show", "--picture"] + SCHEDULE)
    assert code == 0
    rows = [line for line in out.splitlines() if line.startswith("rank ")]
    assert len(rows) == 4
    for r, row in enumerate(rows):
        words = [w for w in row.split("|", 1)[1].split() if w != "."]
        assert words == [str(op) for op in compute_program(CONFIG, r)]


def test_show_default_groups_are_depth_first():
    """Without group flags `show` prints Megatron's depth-first order."""
    code, out, _ = run(["show", "--pp", "4", "--vpp", "2", "-m", "8", "--json"])
    assert code == 0
    cfg = ScheduleConfig.depth_first(4, 2, 8)
    assert json.loads(out)["ranks"] == [[str(op) for op in compute_program(cfg, r)] for r in range(4)]


# ---------------------------------------------------------------------------------------------
# simulate

ROWS = ("given", "depth-first", "breadth-first")


@pytest.mark.parametrize("costs", [[], DIRECT], ids=["analytic", "direct"])
def test_simulate_table(costs):
    """`simulate` prints a table with rows given / depth-first / breadth-first and their groups."""
    code, out, err = run(["simulate"] + SCHEDULE + costs)
    assert code == 0 and err == ""
    lines = out.strip().splitlines()
    assert lines[0].split()[0] == "schedule" and "iter ms" in lines[0]
    rows = [line for line in lines[2:] if line.split()[0] in ROWS]
    assert [row.split()[0] for row in rows] == list(ROWS)
    assert "8 4 / 6 6" in rows[0] and "4 4 4 / 4 4 4" in rows[1] and "12 / 12" in rows[2]
    for row in rows:
        assert len(row.split()) >= 8 + 4  # name, groups, 4 numbers, 4 per-rank peaks


def test_simulate_json():
    """`simulate --json` holds the three schedules with per-rank numbers."""
    code, out, _ = run(["simulate"] + SCHEDULE + DIRECT + ["--json"])
    assert code == 0
    data = json.loads(out)
    assert set(data) == set(ROWS)
    assert data["given"]["forward_groups"] == [8, 4] and data["given"]["backward_groups"] == [6, 6]
    assert data["depth-first"]["forward_groups"] == [4, 4, 4]
    assert data["breadth-first"]["forward_groups"] == [12]
    for row in data.values():
        assert row["iteration_s"] > 0 and len(row["ranks"]) == 4
    # Costly DP: breadth-first hides more DP communication than depth-first.
    assert data["breadth-first"]["exposed_comm_s"] < data["depth-first"]["exposed_comm_s"]


def test_simulate_collectives_gloo_prices_the_reduce_scatter_as_an_all_reduce():
    """`--collectives gloo`: a slow data-parallel link makes every schedule slower than with NCCL's ring
    reduce-scatter; an unknown library is refused by name."""
    argv = ["simulate", "--pp", "2", "--vpp", "2", "-m", "4", "--dp", "4", "--dp-gbps", "1", "--json"]
    seconds = {}
    for library in ("nccl", "gloo"):
        code, out, _ = run(argv + ["--collectives", library])
        assert code == 0
        seconds[library] = json.loads(out)["breadth-first"]["iteration_s"]
    assert seconds["gloo"] > 1.3 * seconds["nccl"]
    code, _, err = run(argv + ["--collectives", "mpi"])
    assert code == 2 and "invalid choice: 'mpi'" in err


def test_simulate_trace_and_plot(tmp_path):
    """--trace and --plot write a JSON trace and a PNG, and say so."""
    trace, plot = tmp_path / "t.json", tmp_path / "p.png"
    code, out, _ = run(["simulate"] + SCHEDULE + DIRECT + ["--trace", str(trace), "--plot", str(plot)])
    assert code == 0
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(1 for e in events if e["ph"] == "X" and e.get("cat") == "compute") == 4 * 2 * 2 * 12
    assert f"wrote trace: {trace}" in out
    assert plot.read_bytes()[:4] == b"\x89PNG" and plot.stat().st_size > 1000
    assert f"wrote timeline picture: {plot}" in out


def test_plot_without_matplotlib_is_one_line(tmp_path, monkeypatch):
    """Where matplotlib cannot be imported, --plot exits 2 with one line naming `pip install matplotlib`."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    plot = tmp_path / "p.png"
    code, out, err = run(["simulate"] + SCHEDULE + DIRECT + ["--plot", str(plot)])
    assert (code, out) == (2, "")
    assert len(err.strip().splitlines()) == 1 and "pip install matplotlib" in err and "--plot" in err
    assert not plot.exists()


def test_cli_and_bench_cli_do_not_import_each_other():
    """The `pipemesh` command's table (megatron_pipemesh/command.py) imports bench/cli.py (to add `bench`); bench/cli.py
    never imports the table, and cli/'s parser never imports bench/ (bench/ stands above cli/)."""
    import ast

    def imported(path, package):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                names.update([module] + [f"{module}.{alias.name}" for alias in node.names])
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
        return names

    pkg = REPO / "megatron_pipemesh"
    assert "megatron_pipemesh.bench.cli" in imported(pkg / "command.py", "megatron_pipemesh")
    assert not {name for name in imported(pkg / "cli" / "parser.py", "megatron_pipemesh.cli") if ".bench" in name}
    assert "megatron_pipemesh.command" not in imported(pkg / "bench" / "cli.py", "megatron_pipemesh.bench")


# ---------------------------------------------------------------------------------------------
# invalid input: exit code 2, one paragraph on stderr naming the flag, no traceback

INVALID = [
    ("sum-mismatch", ["show", "--pp", "4", "--vpp", "2", "-m", "8", "--forward-groups", "4", "4", "--backward-groups", "4"],
     ["--backward-groups 4", "Example of a valid setting"]),
    ("group<p", ["show", "--pp", "4", "--vpp", "2", "-m", "8", "--forward-groups", "2", "6"],
     ["--forward-groups 2 6", "smaller than the pipeline size"]),
    ("underflow", ["show", "--pp", "4", "--vpp", "2", "-m", "12", "--forward-groups", "4", "4", "4", "--backward-groups", "4", "8"],
     ["--forward-groups 4 4 4 --backward-groups 4 8", "Example of a valid setting"]),
    ("zero-group", ["show", "--pp", "4", "--vpp", "2", "-m", "8", "--forward-groups", "0", "8"], ["--forward-groups", "0"]),
    ("negative-group", ["show", "--pp", "4", "--vpp", "2", "-m", "8", "--backward-groups", "-4", "12"], ["--backward-groups", "-4"]),
    ("float-group", ["show", "--pp", "4", "--vpp", "2", "-m", "8", "--forward-groups", "4.5", "3.5"], ["--forward-groups", "4.5"]),
    ("word-pp", ["show", "--pp", "two", "--vpp", "2", "-m", "8"], ["--pp", "two"]),
    ("zero-microbatches", ["show", "--pp", "4", "--vpp", "2", "-m", "0"], ["--microbatches", "0"]),
    ("negative-vpp", ["show", "--pp", "4", "--vpp", "-1", "-m", "8"], ["--vpp", "-1"]),
    ("missing-pp", ["show", "--vpp", "2", "-m", "8"], ["--pp"]),
    ("pp-1", ["show", "--pp", "1", "--vpp", "2", "-m", "8"], ["--pipeline-model-parallel-size 1"]),
    ("m<p", ["show", "--pp", "4", "--vpp", "2", "-m", "3"], ["3", "at least p=4"]),
    ("simulate-groups", ["simulate", "--pp", "4", "--vpp", "2", "-m", "8", "--forward-groups", "4", "4", "--backward-groups", "4"],
     ["--backward-groups 4"]),
    ("simulate-layers", ["simulate", "--pp", "4", "--vpp", "2", "-m", "8", "--num-layers", "10"], ["--num-layers 10"]),
    ("simulate-forward-ms", ["simulate", "--pp", "4", "--vpp", "2", "-m", "8", "--forward-ms", "0"], ["--forward-ms"]),
    ("simulate-mfu", ["simulate", "--pp", "4", "--vpp", "2", "-m", "8", "--mfu", "0"], ["--mfu"]),
    ("no-command", [], ["command"]),
]


def assert_one_paragraph_error(code, out, err, words):
    assert code == 2, (code, out, err)
    assert out == ""
    assert "Traceback" not in err
    text = err.strip()
    assert text and "\n\n" not in text  # a single paragraph
    assert "error:" in text.splitlines()[-1]
    for word in words:
        assert word in text, (word, text)


@pytest.mark.parametrize("name,argv,words", INVALID, ids=[row[0] for row in INVALID])
def test_invalid_input(name, argv, words):
    """Bad input exits with code 2 and a one-paragraph message naming the flag and values."""
    assert_one_paragraph_error(*run(argv), words)


# Validation gaps in the cli package (see reasons).
NOT_REJECTED = [
    pytest.param(["--forward-ms", "1", "--backward-ms", "-1"], id="negative-backward-ms"),
    pytest.param(["--forward-ms", "1", "--p2p-ms", "-5"], id="negative-p2p-ms"),
    pytest.param(["--forward-ms", "1", "--dp-reduce-ms", "-10"], id="negative-dp-reduce-ms"),
    pytest.param(["--forward-ms", "nan"], id="nan-forward-ms"),
    pytest.param(["--mfu", "5"], id="mfu-above-1"),
]


@pytest.mark.parametrize("extra", NOT_REJECTED)
def test_invalid_costs_rejected(extra):
    """Negative/NaN durations and an MFU above 1 are usage errors."""
    code, out, err = run(["simulate", "--pp", "4", "--vpp", "2", "-m", "8"] + extra)
    assert code == 2 and "Traceback" not in err


def test_mfu_example_is_a_fraction():
    """The example proposed for a bad --mfu lies in (0, 1]."""
    code, _, err = run(["simulate", "--pp", "4", "--vpp", "2", "-m", "8", "--mfu", "0"])
    assert code == 2
    example = float(err.rsplit("--mfu", 1)[1].split()[0])
    assert 0 < example <= 1


# ---------------------------------------------------------------------------------------------
# As a subprocess (`python -m megatron_pipemesh`)


def _subprocess(args):
    return subprocess.run([sys.executable, "-m", "megatron_pipemesh"] + args, cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_subprocess_show_json():
    """`python -m megatron_pipemesh show --json` works and matches the in-process output."""
    proc = _subprocess(["show"] + SCHEDULE + ["--json"])
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == json.loads(run(["show"] + SCHEDULE + ["--json"])[1])


def test_subprocess_invalid_groups():
    """As a process, invalid groups exit with status 2 and a one-paragraph message, no traceback."""
    proc = _subprocess(["show", "--pp", "4", "--vpp", "2", "-m", "8", "--forward-groups", "4", "4",
                        "--backward-groups", "4"])
    assert_one_paragraph_error(proc.returncode, proc.stdout, proc.stderr, ["--backward-groups 4", "Example of a valid setting"])


def test_simulate_valid_config_with_m_not_multiple_of_p():
    """`simulate` accepts any config that `show` accepts, even when m is not a multiple of p."""
    argv = ["--pp", "3", "--vpp", "4", "-m", "7", "--forward-groups", "4", "3", "--backward-groups", "3", "4"]
    assert run(["show"] + argv)[0] == 0
    code, out, err = run(["simulate"] + argv + DIRECT)
    assert code == 0, err
    assert out.strip().splitlines()[2].split()[0] == "given"


SMALL_MODEL = ["--dp", "4", "--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
               "--vocab-size", "1024"]


def test_simulate_and_plan_show_levels_and_memory_split():
    """--sharding: simulate and plan print the level per chunk and weights/grads/optimizer/activations per rank."""
    code, out, err = run(["simulate", "--pp", "2", "--vpp", "2", "-m", "8", "--forward-groups", "6", "2",
                          "--backward-groups", "4", "4", "--sharding", "optim", "optim_grads_params"] + SMALL_MODEL)
    assert code == 0, err
    assert "sharding optim optim_grads_params, scope data-parallel" in out
    assert out.count("[optim optim_grads_params] weights") == 2 and "optimizer" in out and "activations" in out
    code, out, err = run(["plan", "--pp", "2", "--vpp", "2", "-m", "4", "--sharding", "optim", "--memory-budget-gb", "8"]
                         + SMALL_MODEL)
    assert code == 0, err
    assert "sharding: --pipemesh-sharding optim optim" in out and "rank 1: [optim optim]" in out


@pytest.mark.parametrize("argv, words", [
    (["--sharding", "auto"], ["auto", "pipemesh plan"]),
    (["--sharding", "optim", "optim", "optim"], ["--sharding", "one per virtual chunk"]),
    (["--sharding", "optim", "--forward-ms", "1"], ["--sharding", "analytic"]),
    (["--sharding", "optim", "--no-distributed-optimizer"], ["--use-distributed-optimizer"]),
])
def test_simulate_sharding_errors(argv, words):
    """Bad --sharding input is a one-paragraph usage error naming the rule."""
    assert_one_paragraph_error(*run(["simulate", "--pp", "2", "--vpp", "2", "-m", "8"] + argv), words)


def test_show_lowered_with_sharding():
    """show --lowered --sharding places GATHER/RELEASE around the ZeRO-3 chunk's spans; bad levels are usage errors."""
    code, out, err = run(["show", "--pp", "2", "--vpp", "2", "-m", "8", "--forward-groups", "6", "2", "--backward-groups",
                          "4", "4", "--lowered", "--sharding", "optim", "optim_grads_params"])
    assert code == 0, err
    rank0 = out.splitlines()[1]
    assert rank0.count("GATHER1.") == rank0.count("RELEASE1.") == 3 and "PARAM_SYNC1" not in rank0
    assert_one_paragraph_error(*run(["show", "--pp", "2", "--vpp", "2", "-m", "8", "--sharding", "zero3"]),
                               ["--sharding", "unknown level"])


# ---------------------------------------------------------------------------------------------
# uneven layer splits


def test_show_simulate_and_plan_read_the_layer_split_flags():
    """Megatron's split flags reach every subcommand: a layout sets V and `show` prints its layers per stage;
    `simulate` and `plan` price the stages by their layers (fewer layers on the last stage: less time there)."""
    layout = ["--pipeline-model-parallel-layout", "Et|ttt|tt|ttL"]
    code, out, _ = run(["show", "--pp", "2", "-m", "4"] + layout + ["--json"])
    assert code == 0 and json.loads(out)["stage_layers"] == [1, 3, 2, 2]
    code, out, _ = run(["show", "--pp", "4", "--vpp", "2", "-m", "8", "--num-layers", "12",
                        "--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers", "2"])
    assert code == 0 and "# transformer layers per stage (stage = chunk * p + rank): 1 2 2 1 1 2 2 1" in out
    model = ["--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "512", "--dp", "1"]
    busy = {}
    for name, split in (("even", []), ("uneven", ["--pipeline-model-parallel-layout", "Et|ttt|ttt|tL"])):
        code, out, err = run(["simulate", "--pp", "2", "--vpp", "2", "-m", "4", "--json"] + model + split)
        assert code == 0, err
        busy[name] = [r["busy_s"] for r in json.loads(out)["given"]["ranks"]]
    # Rank 0 holds 1 + 3 layers either way (even: 2 + 2); rank 1 holds 3 + 1: the same compute per rank.
    assert busy["uneven"] == pytest.approx(busy["even"], rel=1e-9)
    code, out, err = run(["simulate", "--pp", "2", "--vpp", "2", "-m", "4", "--json"] + model
                         + ["--pipeline-model-parallel-layout", "Et|ttt|tttt|L"])
    assert code == 0, err
    shifted = [r["busy_s"] for r in json.loads(out)["given"]["ranks"]]
    # Rank 0 now holds 1 + 4 layers, rank 1 holds 3 + 0 (and the output layer): one layer's forwards and backwards
    # (a quarter of rank 0's even compute, which has no output layer) move from rank 1 to rank 0.
    layer = busy["even"][0] / 4
    assert shifted == pytest.approx([busy["even"][0] + layer, busy["even"][1] - layer], rel=1e-9)
    code, out, err = run(["plan", "--pp", "2", "-m", "4", "--json"] + model + ["--pipeline-model-parallel-layout",
                                                                               "Et|ttt|ttt|tL"])
    assert code == 0 and json.loads(out)["fits"], err


@pytest.mark.parametrize("argv,words", [
    (["show", "--pp", "2", "-m", "4"], ["--vpp is required"]),
    (["show", "--pp", "2", "--vpp", "3", "-m", "4", "--pipeline-model-parallel-layout", "Et|tt|tt|tL"],
     ["--vpp 3 and --pipeline-model-parallel-layout", "disagree"]),
    (["simulate", "--pp", "2", "--vpp", "2", "-m", "4", "--num-layers", "6", "--decoder-first-pipeline-num-layers", "2",
      "--decoder-last-pipeline-num-layers", "4"], ["divides by zero", '--pipeline-model-parallel-layout "Et|tt|t|ttL"']),
    (["simulate", "--pp", "2", "-m", "4", "--pipeline-model-parallel-layout", "Et|tt|tt|tL", "--forward-ms", "1"],
     ["uneven layer split needs the analytic model"]),
])
def test_bad_layer_splits_are_one_paragraph_errors(argv, words):
    code, out, err = run(argv)
    assert code == 2 and out == "" and "Traceback" not in err
    for word in words:
        assert word in err, (word, err)
