"""``pipemesh plan --megatron-args``: the rows and their keys, the flags of each row, the uneven split in the
prediction, and errors that name the flag before any work (cli/megatron_args.py)."""
import json
import shlex

import pytest

from megatron_pipemesh.integration.command_flags import without
from tests.cli.test_commands import run

# The tiny GPT of the training tests (tests/training/test_pretrain_gpt.py TINY_GPT) at PP=2, V=2, on mock data,
# dropout 0: the command of the done-when.
TINY = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
        "--micro-batch-size 2 --global-batch-size 8 --train-iters 3 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine "
        "--eval-iters 0 --eval-interval 1000 --log-interval 1 --num-workers 0 --seed 1234 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 257 --hidden-dropout 0 --attention-dropout 0 "
        "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2")
CLUSTER = ["--nodes", "1", "--gpus-per-node", "4", "--device-memory-gib", "1", "--nic-gbps", "0.25"]
KEYS = {"flags", "predicted_iteration_s", "tokens_per_s", "peak_memory_gb", "fits", "ratio_to_user"}


def advice_json(flags, cluster=CLUSTER, after_dashes=False):
    argv = ["plan"] + cluster + ["--json"]
    argv += ["--"] + shlex.split(flags) if after_dashes else ["--megatron-args", flags]
    code, out, err = run(argv)
    assert code == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def tiny():
    return advice_json(TINY)


def test_the_rows_and_their_keys(tiny):
    """Every row of the issue is there with its keys; the user's row is the command as given, at ratio 1; the flags
    of the other rows are the user's with only what they change replaced."""
    rows = tiny["rows"]
    assert set(rows) == {"user", "best_stock", "pipemesh", "best_layout", "best_layout_stock"}
    for name, row in rows.items():
        assert row is not None, (name, tiny["notes"])
        assert KEYS <= set(row), name
        assert len(row["peak_memory_gb"]) == row["pp"] and row["fits"]
    assert rows["user"]["flags"] == shlex.split(TINY) and rows["user"]["ratio_to_user"] == 1.0
    kept = without(shlex.split(TINY), ["--pipeline-model-parallel-size", "--num-virtual-stages-per-pipeline-rank"])
    for name in ("best_stock", "pipemesh", "best_layout", "best_layout_stock"):
        flags = rows[name]["flags"]
        own = kept[:]  # a row that changes the micro-batch size changes its value, in place
        own[own.index("--micro-batch-size") + 1] = str(rows[name]["micro_batch_size"])
        assert flags[:len(own)] == own, name  # the user's other flags, in place
        assert rows[name]["micro_batch_size_changed"] == (rows[name]["micro_batch_size"] != 2), name
        assert ("mbs " in rows[name]["describe"]) == rows[name]["micro_batch_size_changed"], name
        assert flags.count("--pipeline-model-parallel-size") == 1, name
    for name in ("pipemesh", "best_layout"):
        tail = rows[name]["flags"]
        assert tail[tail.index("--pipeline-schedule") + 1] == "pipemesh"
        assert "--forward-groups" in tail and "--backward-groups" in tail
    assert "--pipeline-schedule" not in rows["best_stock"]["flags"]
    assert tiny["run"] in rows and "measured CPU matmul rate" in tiny["rate"]
    # The search is never worse than the user's layout: best_layout is PipeMesh's best over all layouts.
    assert rows["best_layout"]["predicted_iteration_s"] <= rows["pipemesh"]["predicted_iteration_s"] * (1 + 1e-9)
    assert rows["best_layout_stock"]["predicted_iteration_s"] <= rows["best_stock"]["predicted_iteration_s"] * (1 + 1e-9)


def test_flags_after_dashes_and_text_ends_with_the_command():
    """The command after -- gives the same rows; the text output ends with the one command to run (its program, a
    PipeMesh row's entry point, and its flags). At a given rate: this CPU's measured one moves between runs, and with
    it which row clears the advice's error."""
    rated = CLUSTER + ["--device-tflops", "0.05"]
    first, again = advice_json(TINY, rated), advice_json(TINY, rated, after_dashes=True)
    assert {k: v and v["flags"] for k, v in again["rows"].items()} == {k: v and v["flags"] for k, v in first["rows"].items()}
    code, out, err = run(["plan"] + rated + ["--megatron-args", TINY])
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[-2].startswith(f"run ({first['run']}") and lines[-1] == first["rows"][first["run"]]["command"]


UNEVEN = ("--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
          "--micro-batch-size 1 --global-batch-size 8 --train-iters 3 --lr 1e-3 --mock-data --tokenizer-type "
          "NullTokenizer --vocab-size 257 --pipeline-model-parallel-size 4")


def test_an_uneven_split_moves_the_per_stage_prediction():
    """--decoder-first/last-pipeline-num-layers 1 at PP=4 over 8 layers: ranks hold 1/3/3/1 layers instead of 2/2/2/2.
    The user's row prices every rank by its layers: the middle ranks' compute grows by 3/2 (their layers), the first
    and last ranks' shrinks; a --pipeline-model-parallel-layout of the same counts predicts the same."""
    even = advice_json(UNEVEN)["rows"]["user"]
    uneven = advice_json(UNEVEN + " --decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 1")
    layout = advice_json(UNEVEN + " --pipeline-model-parallel-layout 'Et|ttt|ttt|tL'")["rows"]["user"]
    user = uneven["rows"]["user"]
    assert even["stage_layers"] == [2, 2, 2, 2] and user["stage_layers"] == [1, 3, 3, 1]
    for rank in (1, 2):  # no embedding or output layer there: compute is per layer
        assert user["compute_s_per_rank"][rank] == pytest.approx(1.5 * even["compute_s_per_rank"][rank], rel=1e-6)
    for rank in (0, 3):
        assert user["compute_s_per_rank"][rank] < even["compute_s_per_rank"][rank]
    assert layout["stage_layers"] == user["stage_layers"]
    assert layout["compute_s_per_rank"] == pytest.approx(user["compute_s_per_rank"], rel=1e-9)
    assert user["predicted_iteration_s"] != pytest.approx(even["predicted_iteration_s"], rel=1e-6)


@pytest.mark.parametrize("argv, message", [
    (["--nodes", "1", "--gpus-per-node", "4", "--nic-gbps", "1", "--megatron-args", TINY],
     "--device-memory-gib (the memory of one GPU, GiB) or --gpu MODEL is required"),
    (["--nodes", "1", "--gpus-per-node", "4", "--nic-gbps", "1", "--gpu", "Z80", "--megatron-args", TINY],
     "--gpu Z80: not a known GPU model"),
    (CLUSTER + ["--megatron-args", TINY + " --fast-mode 3"], "Megatron does not know --fast-mode"),
    (CLUSTER + ["--megatron-args", TINY.replace("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2",
                                                "--pipeline-model-parallel-size 1 --pipeline-schedule pipemesh")],
     "--pipeline-schedule pipemesh with --pipeline-model-parallel-size 1: PipeMesh schedules a pipeline"),
    (CLUSTER + ["--megatron-args", ""], "--megatron-args needs the flags"),
    (CLUSTER + ["--megatron-args", TINY, "--", "--num-layers", "4"], "the command is given twice"),
])
def test_bad_input_names_the_flag(argv, message):
    code, out, err = run(["plan"] + argv)
    assert code == 2 and message in err and out == ""


def test_progress_on_stderr_and_a_search_out_of_time_says_what_it_left(tiny):
    """Progress lines go to stderr (stdout stays one JSON object), none with --quiet; --search-seconds stops the layout
    search and the JSON and its note say so, with the least bound left; without it the search is complete."""
    assert tiny["search_complete"] and tiny["unsearched_bound_s"] is None
    code, out, err = run(["plan"] + CLUSTER + ["--json", "--search-seconds", "1e-9", "--megatron-args", TINY])
    assert code == 0, err
    stopped = json.loads(out)
    assert not stopped["search_complete"] and stopped["unsearched_bound_s"] > 0
    assert stopped["search_stopped_by"] == "search_seconds" and tiny["search_stopped_by"] is None
    assert stopped["rows"]["best_layout"]["predicted_iteration_s"] == stopped["rows"]["pipemesh"]["predicted_iteration_s"]
    assert any(note.startswith("the layout search stopped at its deadline, --search-seconds 1e-09, after 0 of ")
               for note in stopped["notes"]), stopped["notes"]
    lines = err.splitlines()
    assert lines[0].startswith("pipemesh plan [") and lines[0].endswith("] reading the command with Megatron's "
                                                                           "argument parser")
    assert any("] user: " in line for line in lines) and any("candidates (TP x PP x DP" in line for line in lines)
    code, out, err = run(["plan"] + CLUSTER + ["--quiet", "--megatron-args", TINY])
    assert code == 0 and err == "" and "--num-layers 4 " in out.rstrip().splitlines()[-1]


def test_cluster_flags_are_checked_by_argparse():
    code, _, err = run(["plan", "--nodes", "0", "--gpus-per-node", "4", "--nic-gbps", "1", "--megatron-args", TINY])
    assert code == 2 and "--nodes" in err
    code, _, err = run(["plan", "--nodes", "1", "--gpus-per-node", "4", "--megatron-args", TINY])
    assert code == 2 and "--nic-gbps" in err


def test_text_says_when_the_user_command_does_not_fit(tiny):
    """The table marks a row over the memory, and the text says the user's command does not fit, naming the rows
    that do; the command to run is one that fits."""
    from megatron_pipemesh.cli.megatron_args import text

    out = json.loads(json.dumps(tiny))
    out["rows"]["user"]["fits"] = False
    out["rows"]["user"]["peak_memory_gb"] = [2.0, 1.5]
    out["run"] = "best_stock"
    report = text(out)
    assert "your command does not fit: peak 2.00 GiB per GPU > budget 0.90 GiB; rows that fit: " in report
    assert "user" not in report.split("rows that fit: ")[1].splitlines()[0]
    assert " NO " in report and report.rstrip().endswith(out["rows"]["best_stock"]["command"])


@pytest.mark.parametrize("device, on_cpu", [([], True), (["--device-tflops", "100"], False)])
def test_costs_of_this_cpu_hold_compute_for_host_copies(device, on_cpu):
    """Without --gpu / --device-tflops the rows are priced for (and run on) this CPU, whose host copies are memcpys on
    the rank's thread: the cluster says so; given a GPU rate, copies run on streams of their own."""
    from megatron_pipemesh.cli.megatron_args import build_advice_parser, problem_and_cluster
    args = build_advice_parser().parse_args(CLUSTER + device + ["--megatron-args", TINY])
    _, _, cluster, rate = problem_and_cluster(args, shlex.split(TINY))
    assert rate.given is not on_cpu
    assert cluster.host_copies_on_compute is on_cpu
    assert cluster.spec(1, 2, False, False).host_copies_on_compute is on_cpu


def test_a_pp2_command_without_virtual_stages_still_gets_an_interleaved_pipemesh_layout():
    """Megatron's validate_args turns --overlap-p2p-communication off for a V = 1 command; the advice reads the user's
    own flags instead, so at PP = 2 PipeMesh (V >= 2) is searched unless the user forbids the overlap."""
    flat = TINY.replace(" --num-virtual-stages-per-pipeline-rank 2", "")
    two = ["--nodes", "2", "--gpus-per-node", "1", "--device-memory-gib", "1", "--nic-gbps", "0.25",
           "--device-tflops", "0.05"]
    rows = advice_json(flat, two)["rows"]
    assert rows["best_layout"] is not None and rows["best_layout"]["vpp"] >= 2
    forbidden = advice_json(flat + " --no-overlap-p2p-communication", two)
    assert forbidden["rows"]["best_layout"] is None
    assert any("allows V >= 2" in note for note in forbidden["notes"])


@pytest.mark.parametrize("flags, overlap", [("", (False, False)), (" --overlap-grad-reduce", (True, False)),
                                            (" --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather",
                                             (True, True))])
def test_the_advice_prices_the_commands_own_overlap_flags(flags, overlap):
    """Megatron overlaps the data-parallel reductions / gathers only with --overlap-grad-reduce /
    --overlap-param-gather (both off by default): the advice reads them from the command and every row's costs keep
    them."""
    from megatron_pipemesh.cli.megatron_args import build_advice_parser, problem_and_cluster
    args = build_advice_parser().parse_args(CLUSTER + ["--megatron-args", TINY + flags])
    _, problem, cluster, _ = problem_and_cluster(args, shlex.split(TINY + flags))
    assert problem.overlap == overlap
    spec = cluster.spec(1, 2, False, problem.distributed_optimizer, problem.overlap)
    assert (spec.overlap_grad_reduce, spec.overlap_param_gather) == overlap


def test_a_command_without_a_pipeline_is_priced_and_its_rows_name_their_micro_batch_size():
    """A PP = 1 command (data parallel alone) is a row the advice prices as Megatron runs it; every row says its
    micro-batch size (and whether it changed the command's), a PP = 1 row writes PP 1 once."""
    flat = TINY.replace("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2",
                        "--pipeline-model-parallel-size 1")
    out = advice_json(flat)
    user = out["rows"]["user"]
    assert user["pp"] == 1 and user["dp"] == 4 and "no pipeline" in user["describe"]
    assert out["rows"]["pipemesh"] is None and any("runs no pipeline" in note for note in out["notes"])
    for name, row in out["rows"].items():
        if row is None:
            continue
        assert row["flags"].count("--pipeline-model-parallel-size") == 1 and row["flags"].count("--micro-batch-size") == 1
        assert row["flags"][row["flags"].index("--micro-batch-size") + 1] == str(row["micro_batch_size"]), name


def test_jobs_1_and_2_give_the_same_rows():
    """--jobs N runs the layout search on N worker processes: the same rows (flags, words, predictions, peaks), the
    same counts of simulated candidates and notes as one process; only the time differs."""
    rated = CLUSTER + ["--device-tflops", "0.05"]  # not this CPU's measured rate, which changes run to run
    out = [advice_json(TINY, rated + ["--jobs", jobs]) for jobs in ("1", "2")]
    for one in out:
        del one["search_s"], one["search_cpu_s"]
    assert out[0] == out[1]
    assert out[0]["candidates"] > 10 and sum(out[0]["simulated"].values()) > 2 and out[0]["search_complete"]


# Priced or refused, never silent -------------------------------------------------------------------------------

H100_16 = ["--nodes", "2", "--gpus-per-node", "8", "--gpu", "H100", "--nic-gbps", "100", "--search-seconds", "20"]
LLAMA_CP = ("--num-layers 16 --hidden-size 2048 --num-attention-heads 16 --seq-length 16384 "
            "--max-position-embeddings 16384 --micro-batch-size 1 --global-batch-size 32 --bf16 "
            "--use-distributed-optimizer --context-parallel-size 2 --transformer-impl transformer_engine "
            "--position-embedding-type rope --untie-embeddings-and-output-weights --normalization RMSNorm --swiglu "
            "--disable-bias-linear --group-query-attention --num-query-groups 4 --mock-data --tokenizer-type "
            "NullTokenizer --vocab-size 128256 --train-iters 10 --lr 1e-4")
README_GPT = ("--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings "
              "2048 --micro-batch-size 1 --global-batch-size 64 --bf16 --use-distributed-optimizer "
              "--pipeline-model-parallel-size 4 --transformer-impl local --mock-data --tokenizer-type NullTokenizer "
              "--vocab-size 50257 --train-iters 1000 --lr 1e-4")
A10G_16 = ["--nodes", "16", "--gpus-per-node", "1", "--nic-gbps", "6.25", "--gpu", "A10G", "--host-memory-gb", "48",
           "--search-seconds", "20"]


def _rows_are_their_commands(out, gpus):
    """Every row's command, read by Megatron's parser for the cluster's GPUs, has the row's TP, CP, PP, DP, V and
    micro-batch size; its description names CP where it is not 1; a PipeMesh row runs PipeMesh's entry point."""
    from megatron_pipemesh.integration.megatron_command import read_command

    for name, row in out["rows"].items():
        if row is None:
            continue
        user = read_command(row["command"], world_size=gpus)
        assert (user.tp, user.cp, user.pp, user.dp, user.vpp, user.model.micro_batch_size) == (
            row["tp"], row["cp"], row["pp"], row["dp"], row["vpp"], row["micro_batch_size"]), name
        assert ("CP" in row["describe"]) == (row["cp"] > 1), name
        assert (row["schedule"] == "pipemesh") == user.launch.runs_pipemesh == user.pipemesh, name


@pytest.mark.parametrize("flags, cluster", [(TINY, CLUSTER), (README_GPT, A10G_16), (LLAMA_CP, H100_16)],
                         ids=["tiny", "readme-gpt-1.3b", "llama-cp2"])
def test_every_rows_command_is_the_row(flags, cluster):
    out = advice_json(flags, cluster)
    gpus = int(cluster[1]) * int(cluster[3])
    _rows_are_their_commands(out, gpus)


def test_a_cp_command_prices_cp_and_fp8_prices_differently_or_is_refused():
    out = advice_json(LLAMA_CP, H100_16)
    user = out["rows"]["user"]
    assert (user["tp"], user["cp"], user["dp"]) == (1, 2, 8) and "TP1 CP2 PP1 DP8" in user["describe"]
    fp8 = advice_json(LLAMA_CP + " --fp8-format hybrid", H100_16)
    assert fp8["rows"]["user"]["predicted_iteration_s"] < user["predicted_iteration_s"]
    assert {"what": "FP8 linears", "value": "1979 TFLOP/s peak at MFU 0.45", "source": "the device table"} in fp8["assumed"]
    code, _, err = run(["plan", "--nodes", "2", "--gpus-per-node", "8", "--gpu", "A100", "--nic-gbps", "100",
                        "--megatron-args", LLAMA_CP + " --fp8-format hybrid"])
    assert code == 2 and "--fp8-format hybrid: the A100 SXM 80GB has no FP8 tensor cores" in err
    assert err.count("\n") <= 2


def test_every_assumed_rate_says_where_it_came_from(tiny):
    out = advice_json(LLAMA_CP, H100_16)
    assumed = {item["what"]: item for item in out["assumed"]}
    assert set(assumed) >= {"compute", "GPU", "NIC", "intra-node link", "host link", "message latency", "vocabulary",
                            "device memory"}
    assert assumed["message latency"] == {"what": "message latency",
                                          "value": "30 us per pipeline transfer and collective step",
                                          "source": "the default, not measured (--latency-us to set it, or a "
                                                    "profile launched on several ranks to measure it)"}
    assert assumed["intra-node link"]["value"] == "3600 Gbit/s"
    assert "the device table: H100 SXM's NVLink 4 (SXM)" in assumed["intra-node link"]["source"]
    assert assumed["GPU"]["source"].startswith("--gpu H100 is the H100 SXM")
    assert assumed["vocabulary"]["source"] == "--vocab-size" and assumed["NIC"]["source"] == "--nic-gbps"
    assert {item["what"] for item in tiny["assumed"]} >= {"compute", "NIC", "intra-node link", "vocabulary"}


def test_a_given_message_latency_is_said_and_priced(tiny):
    """--latency-us replaces the default in the assumptions and in the costs: the user's row (a pipeline with
    data-parallel rings) takes longer by at least its messages' share."""
    out = advice_json(TINY, CLUSTER + ["--latency-us", "2000"])
    assumed = {item["what"]: item for item in out["assumed"]}
    assert assumed["message latency"] == {"what": "message latency",
                                          "value": "2000 us per pipeline transfer and collective step",
                                          "source": "--latency-us"}
    assert out["rows"]["user"]["predicted_iteration_s"] > tiny["rows"]["user"]["predicted_iteration_s"] + 0.002


def test_a_flag_the_costs_leave_out_is_named_and_mla_is_refused():
    out = advice_json(TINY + " --qk-layernorm --empty-unused-memory-level 1")
    named = {item["flag"]: item for item in out["unpriced"]}
    assert set(named) == {"--qk-layernorm", "--empty-unused-memory-level"}
    assert named["--empty-unused-memory-level"]["value"] == "1" and named["--qk-layernorm"]["effect"]
    code, text, _ = run(["plan"] + CLUSTER + ["--megatron-args", TINY + " --qk-layernorm"])
    assert code == 0 and "not priced: --qk-layernorm: norms of the queries and keys" in text
    code, _, err = run(["plan"] + CLUSTER + ["--megatron-args", TINY + " --multi-latent-attention"])
    assert code == 2 and "--multi-latent-attention: multi-latent attention" in err and err.count("\n") <= 2


def test_a_cuda_graph_command_is_never_advised_pipemesh():
    out = advice_json(README_GPT.replace("--transformer-impl local", "--transformer-impl transformer_engine")
                      + " --cuda-graph-impl transformer_engine", A10G_16)
    assert out["rows"]["pipemesh"] is None and out["rows"]["best_layout"] is None
    assert any(note.startswith("pipemesh, best_layout: --cuda-graph-impl") for note in out["notes"])
    assert all("--pipeline-schedule" not in row["flags"] for row in out["rows"].values() if row is not None)


def test_a_launcher_for_another_cluster_is_refused_and_a_pipemesh_row_runs_the_entry_point():
    code, _, err = run(["plan"] + CLUSTER + ["--megatron-args", "torchrun --nnodes 2 --nproc-per-node 4 "
                                                                "pretrain_gpt.py " + TINY])
    assert code == 2 and "runs 2 node(s), and --nodes is 1" in err
    out = advice_json("torchrun --nproc-per-node 4 /m/pretrain_gpt.py " + TINY)
    assert out["rows"]["pipemesh"]["command"].startswith(
        "torchrun --nproc-per-node 4 -m megatron_pipemesh.training.pretrain_gpt --megatron-lm-script /m/pretrain_gpt.py ")
    assert out["rows"]["best_stock"]["command"].startswith("torchrun --nproc-per-node 4 /m/pretrain_gpt.py ")
