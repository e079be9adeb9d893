"""`pipemesh bench --advice`: the refusals (exit 2 naming the flag, before any run), the advisor's cluster, the run
flags, the report and its JSON, and one run of the smallest command end to end."""
import dataclasses
import json
import shlex

import pytest

from megatron_pipemesh.cli.common import UsageError

from megatron_pipemesh.bench import advice_plan, advice_run
from megatron_pipemesh.bench import cli as bench_cli
from megatron_pipemesh.bench.advice_parts import PARTS
from megatron_pipemesh.bench.logparse import IterationRecord

from tests.planning.test_profile import MODEL, profile as a_profile

# tests/training/test_advice_rows.py's TINY: a tiny GPT on mock data at PP=2, V=2, dropout 0, two iterations.
TINY = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
        "--micro-batch-size 2 --global-batch-size 8 --train-iters 2 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine "
        "--eval-iters 0 --eval-interval 1000 --log-interval 1 --num-workers 0 --seed 1234 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 257 --hidden-dropout 0 --attention-dropout 0 "
        "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2")
SETTINGS = advice_plan.AdviceBenchSettings(nproc=2, nic_gbps=0.1, device_tflops=0.05, mfu=0.45, device_memory_gb=4.0)


def plan(words, settings):
    """The advice as ``bench --advice`` plans it: the command read once, then planned."""
    return advice_plan.plan_advice(advice_plan.advisor_problem(words, settings), settings)


@pytest.fixture(scope="module")
def planned():
    """The advice for TINY on 2 ranks at 100 Mbit/s (planned once for the module)."""
    return plan(shlex.split(TINY), SETTINGS)


@pytest.fixture
def no_runs(monkeypatch):
    """Any run or namespace is a failure: the refusals come before them."""
    def boom(*a, **k):
        raise AssertionError("a run started before the input was checked")
    monkeypatch.setattr(advice_run, "run_rows", boom)
    monkeypatch.setattr(advice_plan, "plan_advice", boom)


@pytest.mark.parametrize("argv,flag", [
    (["--advice", "--nproc", "2"], "--megatron-args"),
    (["--advice", "--megatron-args", TINY], "--nproc"),
    (["--advice", "--megatron-args", "  ", "--nproc", "2"], "--megatron-args"),
    (["--advice", "--megatron-args", TINY, "--nproc", "2", "--rate", "fast"], "--rate"),
    (["--advice", "--megatron-args", TINY, "--nproc", "2", "--rate", "0"], "--rate"),
    (["--advice", "--megatron-args", TINY, "--nproc", "2", "--unshaped", "--rate", "100mbit"], "--unshaped"),
    (["--advice", "--megatron-args", TINY, "--nproc", "2", "--quick"], "--quick"),
    (["--advice", "--megatron-args", TINY, "--nproc", "2", "--configs", "pp2"], "--configs"),
    (["--advice", "--megatron-args", TINY, "--nproc", "2", "--network", "shared"], "--network shared"),
    (["--advice", "--megatron-args", TINY, "--nproc", "2", "--iters", "0"], "--iters"),
    (["--advice", "--megatron-args", TINY, "--nproc", "300"], "--nproc"),
    (["--advice", "--megatron-args", TINY, "--nproc", "2", "--profile-max-seconds", "-1"], "--profile-max-seconds"),
    (["--advice", "--unshaped", "--megatron-args", TINY, "--nproc", "2", "--no-profile", "--profile-max-seconds", "2"],
     "--profile-max-seconds 2 with --no-profile is contradictory"),
    (["--nproc", "2"], "--nproc needs --advice"),
    (["--megatron-args", TINY], "--megatron-args needs --advice"),
])
def test_bad_input_exits_2_naming_the_flag(argv, flag, capsys, no_runs):
    assert bench_cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert flag in err and len(err.splitlines()) == 1


def test_a_world_size_that_does_not_fit_the_command_names_nproc(capsys, monkeypatch):
    """PP = 2 on 3 ranks: Megatron's own parser refuses it, and the message names --nproc, before any run."""
    monkeypatch.setattr(advice_run, "run_rows", lambda *a, **k: pytest.fail("ran"))
    assert bench_cli.main(["--advice", "--unshaped", "--megatron-args", TINY, "--nproc", "3"]) == 2
    err = capsys.readouterr().err
    assert "--nproc 3" in err and "--megatron-args" in err


def test_a_missing_or_contradictory_profile_is_refused_before_any_work(capsys, no_runs, monkeypatch):
    monkeypatch.setattr(advice_run, "profile_here", lambda *a: pytest.fail("profiled"))
    assert bench_cli.main(["--advice", "--unshaped", "--megatron-args", TINY, "--nproc", "2", "--profile", "p.json"]) == 2
    assert "--profile p.json: no such file" in capsys.readouterr().err
    assert bench_cli.main(["--advice", "--unshaped", "--megatron-args", TINY, "--nproc", "2", "--profile", "p.json",
                           "--no-profile"]) == 2
    assert "--profile p.json with --no-profile is contradictory" in capsys.readouterr().err


def test_a_profile_of_another_model_is_refused_naming_the_mismatch(tmp_path, capsys, monkeypatch):
    """The advisor reads --profile as pipemesh plan does: another hidden size is one line, before any run."""
    monkeypatch.setattr(advice_run, "run_rows", lambda *a, **k: pytest.fail("ran"))
    path = tmp_path / "other.json"
    path.write_text(a_profile(model=dataclasses.replace(MODEL, hidden_size=32)).to_json())
    assert bench_cli.main(["--advice", "--unshaped", "--megatron-args", TINY, "--nproc", "2", "--profile",
                           str(path)]) == 2
    err = capsys.readouterr().err
    assert "measured for hidden 32, this command has hidden 64" in err


def test_a_profile_timed_beside_other_work_is_refused_naming_the_load_and_the_pieces(tmp_path, capsys,
                                                                                    monkeypatch):
    """A profile of the command whose load record says other processes computed while it timed: bench --advice
    exits 2 before any run, naming the load average and the pieces; the same profile from an idle machine passes
    the check."""
    from megatron_pipemesh.planning.profile_quality import LoadRecord

    monkeypatch.setattr(advice_run, "run_rows", lambda *a, **k: pytest.fail("ran"))
    user_model = advice_plan.advisor_problem(shlex.split(TINY), SETTINGS)[1][0].model
    busy = LoadRecord(cores=2, loadavg_before=(2.0, 1.5, 1.0), loadavg_after=(3.1, 1.8, 1.1),
                      others_cores={"layers mbs 2": 1.7, "embedding mbs 2": 0.02})
    path = tmp_path / "busy.json"
    path.write_text(dataclasses.replace(a_profile(model=user_model), load=busy).to_json())
    assert bench_cli.main(["--advice", "--unshaped", "--megatron-args", TINY, "--nproc", "2", "--profile",
                           str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--advice cannot judge predictions from {path}" in err and "load average 2.00 -> 3.10" in err
    assert "layers mbs 2 (1.70 cores)" in err and "embedding" not in err
    idle = tmp_path / "idle.json"
    idle.write_text(dataclasses.replace(a_profile(model=user_model), load=dataclasses.replace(
        busy, others_cores={"layers mbs 2": 0.01})).to_json())
    advice_run.refuse_loaded_profile(str(idle))
    advice_run.refuse_loaded_profile(None)


def test_a_profile_measured_after_the_command_was_read_is_matched_without_reading_it_again(tmp_path, monkeypatch):
    """bench --advice reads the command once (Megatron's parser takes seconds): the profile it measures afterwards is
    matched to the command read, and one of another model is refused naming the mismatch."""
    import megatron_pipemesh.cli.megatron_args as megatron_args

    parsed = advice_plan.advisor_problem(shlex.split(TINY), SETTINGS)
    monkeypatch.setattr(megatron_args, "problem_and_cluster", lambda *a: pytest.fail("the command was read again"))
    good, other = tmp_path / "good.json", tmp_path / "other.json"
    user_model = parsed[1][0].model
    good.write_text(a_profile(model=user_model).to_json())
    other.write_text(a_profile(model=dataclasses.replace(user_model, hidden_size=32)).to_json())
    argv, (_, problem, _, _) = advice_plan.with_profile(parsed, dataclasses.replace(SETTINGS, profile=str(good)))
    assert problem.profile is not None and argv[argv.index("--profile") + 1] == str(good)
    assert parsed[1][1].profile is None
    with pytest.raises(UsageError, match="measured for hidden 32, this command has hidden 64"):
        advice_plan.with_profile(parsed, dataclasses.replace(SETTINGS, profile=str(other)))


def test_the_profile_reaches_the_advisor():
    """Never silently ignored: the file is among the advisor's flags."""
    argv = advice_plan.advisor_argv(advice_plan.AdviceBenchSettings(2, 0.1, 0.05, 0.45, 4.0, profile="p.json"))
    assert argv[argv.index("--profile") + 1] == "p.json"


def test_the_advisor_plans_n_single_gpu_nodes_at_the_rate(planned):
    """--nodes N --gpus-per-node 1, the NIC at the rate, the bench's device rate; every row priced with its parts,
    which add up to the row's predicted iteration time on every pipeline rank."""
    advice, parts, argv = planned
    assert argv[:6] == ["--nodes", "2", "--gpus-per-node", "1", "--nic-gbps", "0.1"]
    assert argv[argv.index("--device-tflops") + 1] == "0.05"
    assert advice["gpus"] == 2 and advice["rows"]["user"] is not None
    for name, row in advice["rows"].items():
        if row is None:
            continue
        assert row["tp"] * row["pp"] * row["dp"] == 2
        assert len(parts[name]) == row["pp"]
        for rank in parts[name]:
            assert rank.total == pytest.approx(row["predicted_iteration_s"], rel=1e-6), name


def test_run_flags_replace_only_what_the_measurement_needs():
    flags = shlex.split(TINY) + ["--save", "/ckpt", "--save-interval", "5"]
    out = advice_run.run_flags(flags, warmup=2, iters=3)
    assert out[out.index("--train-iters") + 1] == "5" and out.count("--train-iters") == 1
    assert out[out.index("--timing-log-level") + 1] == "2" and out[out.index("--timing-log-option") + 1] == "all"
    assert out[out.index("--log-interval") + 1] == "1" and "--save" not in out and "--save-interval" not in out
    assert out[out.index("--num-virtual-stages-per-pipeline-rank") + 1] == "2" and "--mock-data" in out


def test_rank_cores():
    assert advice_run.rank_cores(2, 1, 2, False) == [0, 1]
    assert advice_run.rank_cores(2, 2, 2, False) is None  # more ranks than cores, unpinned
    assert advice_run.rank_cores(2, 2, 2, True) == [0, 0, 1, 1]  # each stage's replicas on its core


def _timers(world, fb, fwd, bwd):
    names = {"forward-backward": fb, "forward-compute": fwd, "backward-compute": bwd, "all-grads-sync": 1.0,
             "optimizer": 5.0}
    return {name: {rank: ms for rank in range(world)} for name, ms in names.items()}


def _runs(advice, slow=None, cores=(0, 1)):
    """Synthetic runs of every row: the prediction's compute met, except ``slow`` whose compute is 30% above."""
    runs = {}
    for name, row in advice["rows"].items():
        if row is None:
            continue
        ms = row["predicted_iteration_s"] * 1e3
        world = row["pp"] * row["dp"]
        factor = 1.3 if name == slow else 1.0
        compute = 0.8 * ms * factor
        its = [IterationRecord(i, compute + 0.2 * ms, timers=_timers(world, compute + 0.2 * ms - 5, compute / 3,
                                                                      2 * compute / 3)) for i in (2, 3)]
        runs[name] = {"returncode": 0, "log": f"/x/{name}.log", "wall_s": 1.0, "iterations": its, "error": "",
                      "same_run_as": None, "cores": list(cores) if cores else None}
    return runs


def _setup():
    return advice_run.AdviceSetup(shlex.split(TINY), SETTINGS, None, 1, 2, 2, 8.0)


def test_report_and_json(planned, tmp_path):
    """Every row with its predicted and measured time, their ratio, the ratios to the user's command, the parts;
    the advised row's measured ratio; the missed row's cause, in the JSON and the table."""
    advice, parts, argv = planned
    document = advice_run.advice_document(_setup(), advice, parts, argv, _runs(advice, slow="user"), str(tmp_path))
    json.loads(json.dumps(document))
    rows = {r["name"]: r for r in document["rows"]}
    assert set(rows) == {name for name, row in advice["rows"].items() if row is not None}
    for r in rows.values():
        assert r["predicted_iteration_s"] > 0 and r["measured_iteration_s"] > 0
        assert r["measured_over_predicted"] == pytest.approx(r["measured_iteration_s"] / r["predicted_iteration_s"])
        assert set(r["measured_parts_s"][0]) == set(PARTS) and len(r["predicted_parts_s"]) == r["pp"]
    assert rows["user"]["miss"] and rows["user"]["cause"] == "compute"
    assert rows["user"]["measured_ratio_to_user"] == 1.0
    advised = document["advised"]
    assert document["advised_measured_ratio_to_user"] == pytest.approx(
        rows["user"]["measured_iteration_s"] / rows[advised]["measured_iteration_s"])
    text = advice_run.format_advice(document)
    assert "meas/pred" in text and f"advised row ({advised}): measured" in text
    assert "user: measured" in text and "compute (forward/backward compute) differs" in text
    assert "one core per rank" in text


def test_shared_cores_are_said(planned, tmp_path):
    advice, parts, argv = planned
    setup = advice_run.AdviceSetup(shlex.split(TINY), SETTINGS, None, 1, 2, 1, 8.0)  # 2 ranks, 1 core
    document = advice_run.advice_document(setup, advice, parts, argv, _runs(advice, cores=None), str(tmp_path))
    text = advice_run.format_advice(document)
    assert document["ranks_share_cores"] and "2 ranks share 1 cores: unpinned; the predictions share the cores" in text


@pytest.mark.parametrize("nproc,pin,shared,pinned", [(4, False, 2, False), (4, True, 2, True), (2, True, None, False)])
def test_more_ranks_than_cores_plan_for_ranks_sharing_the_cores(nproc, pin, shared, pinned):
    """4 ranks on 2 cores: the advice is planned for every rank on one host of 2 cores (unpinned, or each pipeline
    stage on its core with --pin-cores) at the rate of one core, not at cores / N of it; 2 ranks get a core each."""
    argv = ["bench", "--advice", "--unshaped", "--megatron-args", TINY, "--nproc", str(nproc),
            "--device-tflops", "0.05"]
    args = bench_cli.build_parser().parse_args(argv + (["--pin-cores"] if pin else []))
    setup = advice_run.resolve_advice(args, {"cores": 2, "memory_gb": 8.0}, lambda rate: None, "100mbit")
    assert (setup.settings.shared_cores, setup.settings.pinned_cores) == (shared, pinned)
    assert setup.settings.device_tflops == 0.05


def test_repeats_run_every_row_in_turn_and_pool_their_iterations(monkeypatch, tmp_path):
    """--repeats 3: rounds of every distinct row in the rows' order (a row with another row's flags runs once per
    round under that row), each round's measured iterations pooled; a row that fails is not run again; --repeats 0
    is refused naming the flag."""
    from megatron_pipemesh.bench import runner

    advice = {"rows": {name: {"flags": ["--seed", str(seed)], "pp": 1, "dp": 2, "tp": 1}
                       for name, seed in (("user", 1), ("best_stock", 1), ("best_layout", 2), ("best_layout_stock", 3))}}
    order = []

    def fake_run(cmd, env, log_path, timeout, sample_memory=False):
        seed = cmd[cmd.index("--seed") + 1]
        order.append(seed)
        elapsed = 1000.0 * len(order)
        text = "".join(f" iteration {i}/ 3 | elapsed time per iteration (ms): {elapsed + i:.1f} |\n" for i in (1, 2, 3))
        return (1 if seed == "3" else 0), 1.0, None, text

    monkeypatch.setattr(runner, "run_once", fake_run)
    readings = iter(range(1, 100))
    monkeypatch.setattr(advice_run, "reference_s", lambda: float(next(readings)))  # the machine's pace around each run
    argv = ["bench", "--advice", "--unshaped", "--megatron-args", TINY, "--nproc", "2", "--repeats", "3",
            "--warmup", "1", "--iters", "2"]
    args = bench_cli.build_parser().parse_args(argv)
    setup = advice_run.resolve_advice(args, {"cores": 2, "memory_gb": 8.0}, lambda rate: None, "100mbit")
    assert setup.repeats == 3
    runs = advice_run.run_rows(args, setup, advice, str(tmp_path))
    assert order == ["1", "2", "3", "1", "2", "1", "2"]  # the failed row ran once
    assert [it.iteration for it in runs["user"]["iterations"]] == [2, 3, 2, 3, 2, 3]
    assert [it.elapsed_ms for it in runs["best_layout"]["iterations"]] == [2002.0, 2003.0, 5002.0, 5003.0, 7002.0, 7003.0]
    assert runs["best_stock"]["same_run_as"] == "user" and len(runs["user"]["logs"]) == 3
    assert runs["best_layout_stock"]["returncode"] == 1 and len(runs["best_layout_stock"]["logs"]) == 1
    # read before and after each run
    assert runs["user"]["machine_s"] == [1.0, 2.0, 7.0, 8.0, 11.0, 12.0]
    assert runs["best_layout"]["machine_s"] == [3.0, 4.0, 9.0, 10.0, 13.0, 14.0]
    with pytest.raises(UsageError, match="--repeats"):
        advice_run.resolve_advice(bench_cli.build_parser().parse_args(argv[:-6] + ["--repeats", "0"]),
                                  {"cores": 2, "memory_gb": 8.0}, lambda rate: None, "100mbit")


def test_the_emulated_nics_burst_is_planned_for(monkeypatch):
    """The shaped network's tbf burst reaches the advisor's cluster (every layout's ClusterSpec) in data bytes (tc
    counts the frames' headers against it); unshaped, none."""
    import megatron_pipemesh.planning.advice as advice_module
    from megatron_pipemesh.bench.netns import MIN_BURST_BYTES, Shaping

    argv = ["bench", "--advice", "--megatron-args", TINY, "--nproc", "2", "--rate", "100mbit"]
    setup = advice_run.resolve_advice(bench_cli.build_parser().parse_args(argv), {"cores": 2, "memory_gb": 8.0},
                                      lambda rate: Shaping(rate), "100mbit")
    assert setup.settings.nic_burst_bytes == pytest.approx(MIN_BURST_BYTES * 1448 / 1514)
    unshaped = advice_run.resolve_advice(bench_cli.build_parser().parse_args(argv[:-2] + ["--unshaped"]),
                                         {"cores": 2, "memory_gb": 8.0}, lambda rate: None, "100mbit")
    assert unshaped.settings.nic_burst_bytes == 0.0
    seen = []
    advise = advice_module.advise
    monkeypatch.setattr(advice_module, "advise",
                        lambda problem, cluster: seen.append(cluster) or advise(problem, cluster))
    plan(shlex.split(TINY), dataclasses.replace(SETTINGS, nic_burst_bytes=MIN_BURST_BYTES))
    assert seen[-1].spec(1, 2, False, False).nic_burst_bytes == MIN_BURST_BYTES


def test_the_advisor_and_the_stock_rows_share_the_cores(monkeypatch):
    """The advisor's cluster carries the shared cores (so does every layout's ClusterSpec, the stock rows' simulation
    included), and 4 ranks on 2 cores are predicted slower than 4 ranks with a core each (at a fast NIC, where compute
    dominates): each pipeline rank's compute between 1x (the other stage in a bubble) and 2x (both computing: 2
    cores for 4 processes) its time on a core of its own."""
    import megatron_pipemesh.planning.advice as advice_module

    seen = []
    advise = advice_module.advise
    monkeypatch.setattr(advice_module, "advise",
                        lambda problem, cluster: seen.append(cluster) or advise(problem, cluster))
    settings = dataclasses.replace(SETTINGS, nproc=4, nic_gbps=25.0)
    shared, parts, _ = plan(shlex.split(TINY), dataclasses.replace(settings, shared_cores=2))
    assert seen[-1].shared_cores == 2 and not seen[-1].pinned_cores
    assert seen[-1].spec(1, 2, False, False).shared_cores == 2
    own, own_parts, _ = plan(shlex.split(TINY), settings)
    assert seen[-1].shared_cores is None
    assert shared["rows"]["user"]["predicted_iteration_s"] > 1.2 * own["rows"]["user"]["predicted_iteration_s"]
    for mine, alone in zip(parts["user"], own_parts["user"]):
        assert alone.compute < mine.compute <= 2 * alone.compute + 1e-12
    stock = next(name for name, row in shared["rows"].items() if row is not None and row["schedule"] != "pipemesh")
    assert parts[stock][0].total == pytest.approx(shared["rows"][stock]["predicted_iteration_s"], rel=1e-6)


def test_end_to_end_on_the_smallest_command(tmp_path, capsys, monkeypatch):
    """The tiny GPT on 2 ranks over the plain loopback, 1 warm-up + 1 measured iteration: every row has a
    predicted and a measured time, and the product's own lines are printed. (The test machine is shared: a profile
    timed beside other work would be refused, which the refusal's own test covers.)"""
    monkeypatch.setattr(advice_run, "refuse_loaded_profile", lambda path: None)
    out = tmp_path / "advice.json"
    # The profile's groups capped at 0.5 s: this test checks the flow, not the repeats until medians are stable.
    code = bench_cli.main(["--advice", "--unshaped", "--megatron-args", TINY, "--nproc", "2", "--warmup", "1",
                           "--iters", "1", "--profile-max-seconds", "0.5", "--json", str(out),
                           "--out-dir", str(tmp_path / "runs")])
    text = capsys.readouterr().out
    assert code == 0, text
    document = json.loads(out.read_text())
    assert document["rows"] and all(r["predicted_iteration_s"] > 0 and r["measured_iteration_s"] > 0
                                    for r in document["rows"])
    assert all(r["measured_parts_s"] is not None for r in document["rows"])
    assert "pipemesh bench --advice: 2 ranks" in text and "advised row (" in text and "meas x user" in text
    assert len(document["load_average"]["before"]) == 3 and "load average" in text
    # the message latency timed between two ranks before planning, and the machine's own speed at each moment
    assert document["network"]["planned_latency_us"] > 0 and " us per message (measured)" in text
    assert "--latency-us" in document["advisor_flags"]
    speed = document["machine_speed"]
    profile = json.loads((tmp_path / "runs" / "profile.json").read_text())
    assert profile["method"]["max_seconds"] == 0.5
    assert speed["at_profile_s"] == [profile["pace"]["seconds"]] and 0 < speed["at_profile_s"][0] < 1
    assert all(len(at) == 2 for at in speed["at_runs_s"].values())  # before and after each run
    assert all(r["machine_drift"] is not None for r in document["rows"])
    assert "the machine's own pace (2 products of 512x256 @ 256x1024, one thread, every core, before and after " \
           "each run) against the profile's pace: user " in text


def test_the_measured_message_latency_is_planned_for_and_in_the_advisors_flags(monkeypatch, planned):
    """The latency timed where the rows run reaches every layout's ClusterSpec and the flags that reproduce the
    advice with pipemesh plan; it lengthens the user's row (a pipeline: its transfers wait it)."""
    import megatron_pipemesh.planning.advice as advice_module

    seen = []
    advise = advice_module.advise
    monkeypatch.setattr(advice_module, "advise",
                        lambda problem, cluster: seen.append(cluster) or advise(problem, cluster))
    settings = dataclasses.replace(SETTINGS, latency_us=400.0)
    parsed = advice_plan.with_profile(advice_plan.advisor_problem(shlex.split(TINY), SETTINGS), settings)
    out, _, argv = advice_plan.plan_advice(parsed, settings)
    assert seen[-1].spec(1, 2, False, False).latency_us == 400.0
    assert argv[argv.index("--latency-us") + 1] == "400"
    assert out["rows"]["user"]["predicted_iteration_s"] > planned[0]["rows"]["user"]["predicted_iteration_s"]
