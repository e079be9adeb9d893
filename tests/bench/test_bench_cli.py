"""`pipemesh bench` argument validation, command lines, and the table / JSON / chart builders."""
import argparse
import copy
import json

import pytest

from megatron_pipemesh.bench import cli as bench_cli
from megatron_pipemesh.bench.calibrate import (MeasuredCompute, fit_transfer_overhead, measured_costs,
                                               predict_iteration_ms)
from megatron_pipemesh.bench.logparse import IterationRecord, ParsedLog
from megatron_pipemesh.bench.memory_fair import RunSpec
from megatron_pipemesh.bench.report import format_table, plot_summary, summarize
from megatron_pipemesh.bench.runner import (ModelSetup, ParallelConfig, RunResult, default_groups, launch_command,
                                            threads_per_rank, training_args)
from megatron_pipemesh.cli import UsageError
from megatron_pipemesh.planning.stock import StockRecompute, StockSetting
from megatron_pipemesh.schedule.config import ScheduleConfig


def _args(*argv):
    return bench_cli.build_parser().parse_args(["bench", *argv])


@pytest.mark.parametrize("argv,match", [
    (["--rate", "0"], "--rate"),
    (["--rate", "fast"], "--rate"),
    (["--rate=-3mbit"], "--rate"),
    (["--burst", "1000"], "MTU"),
    (["--repeats", "0"], "--repeats"),
    (["--iters", "0"], "--iters"),
    (["--warmup", "-1"], "--warmup"),
    (["--delay-ms", "-1"], "--delay-ms"),
    (["--configs", "dp2"], "ppN"),
    (["--configs", "pp1"], "pipeline size"),
    (["--vpp", "1"], "--vpp"),
    (["--hidden-size", "250", "--num-attention-heads", "4"], "divisible"),
    (["--mfu", "2"], "fractions"),
    (["--unshaped", "--rate", "100mbit"], "contradictory"),
    (["--unshaped", "--network", "shared"], "contradictory"),
    (["--unshaped", "--nic-queue", "fifo"], "contradictory"),
    (["--network", "shared", "--nic-queue", "fair"], "no peer to give a class"),
    (["--configs", "pp2xdp200"], "holds 250 ranks"),
    (["--configs", "pp4", "--microbatches", "2"], "at least the pipeline size"),
    (["--configs", "pp2", "--forward-groups", "1", "7"], "smaller than the pipeline size"),
    (["--configs", "pp2", "--forward-groups", "4", "4", "--backward-groups", "3"], "--backward-groups"),
])
def test_bad_input_is_a_usage_error(argv, match):
    """Each invalid bench setting raises UsageError naming the offending flag or rule."""
    with pytest.raises(UsageError, match=match):
        bench_cli.resolve(_args(*argv))


def test_main_prints_one_paragraph_and_exits_2(capsys):
    """`pipemesh bench` with a bad --rate exits 2 with one line naming the flag and value."""
    assert bench_cli.main(["--rate", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pipemesh bench: error: --rate nope") and "\n" not in err


def test_quick_defaults():
    """--quick: PP=2 x DP=2 with V=4, m=4, a 250 Mbit/s NIC per rank, budget auto:0.2, pinned, no unshaped runs;
    a flag the user gives wins over the --quick value."""
    args = _args("--quick")
    setup = bench_cli.resolve(args)
    assert [c.name for c in setup["configs"]] == ["pp2xdp2"]
    assert setup["repeats"] == 1 and setup["model"].warmup_iters == 1 and setup["model"].measured_iters == 2
    assert (setup["model"].chunk.hidden_size, setup["model"].vpp, setup["model"].microbatches) == (384, 4, 4)
    assert setup["shaping"].rate_mbit == 250 and setup["shaping"].burst_bytes >= 4 * 65536
    assert setup["shaping"].per_rank and setup["auto"].per_rank_network and setup["shaping"].nic_queue == "fair"
    assert bench_cli.resolve(_args("--quick", "--nic-queue", "fifo"))["shaping"].nic_queue == "fifo"
    assert setup["budget_mb"] == ("auto", 0.2) and setup["link_share"] == 1.0 and args.pin_cores and args.no_limit
    shared = bench_cli.resolve(_args("--quick", "--network", "shared", "--link-share", "0.5"))
    assert not shared["shaping"].per_rank and not shared["auto"].per_rank_network and shared["link_share"] == 0.5
    assert shared["shaping"].nic_queue == "fifo"
    assert setup["groups"][("pp2xdp2", "pipemesh")] == ((4,), (2, 2))
    assert bench_cli.resolve(_args("--quick", "--hidden-size", "128"))["model"].chunk.hidden_size == 128
    plain = bench_cli.resolve(_args())
    assert plain["model"].chunk.hidden_size == 256 and plain["budget_mb"] is None and plain["link_share"] == 1.0
    assert bench_cli.resolve(_args("--unshaped"))["shaping"] is None
    assert bench_cli.resolve(_args("--activation-budget-mb", "12.5"))["budget_mb"] == 12.5


@pytest.mark.parametrize("text", ["0", "-3", "lots", "auto:2", "auto:x"])
def test_bad_budget_is_a_usage_error(text):
    """A budget that is not a positive number, auto or auto:F with F in [0, 1] is rejected with an example."""
    with pytest.raises(UsageError, match="--activation-budget-mb"):
        bench_cli.resolve(_args("--activation-budget-mb", text))


def test_add_bench_parser_hook():
    """add_bench_parser registers `bench` on a `pipemesh` parser with cmd_bench as its handler."""
    parser = argparse.ArgumentParser(prog="pipemesh")
    sub = parser.add_subparsers(dest="command", required=True)
    bench_cli.add_bench_parser(sub)
    args = parser.parse_args(["bench", "--quick", "--json"])
    assert args.func is bench_cli.cmd_bench and args.quick and args.json


def test_config_parsing_and_threads():
    """ppNxdpM names parse to ParallelConfig; cores split into threads per rank, oversubscription flagged."""
    assert ParallelConfig.parse("pp2xdp2") == ParallelConfig(2, 2)
    assert ParallelConfig.parse("PP4") == ParallelConfig(4, 1)
    assert ParallelConfig(2, 2).name == "pp2xdp2" and ParallelConfig(2, 2).world == 4
    assert threads_per_rank(2, cores=2) == (1, False)
    assert threads_per_rank(4, cores=2) == (1, True)
    assert threads_per_rank(2, cores=16) == (8, False)


def test_default_groups_are_valid():
    """The bench's default group lists are valid for p = 2..4 and every m >= p (6 2 / 4 4 for p = 2, m = 8)."""
    for pp in (2, 3, 4):
        for m in range(pp, 17):
            forward, backward = default_groups(pp, m)
            ScheduleConfig(pp, 2, m, forward, backward)
    assert default_groups(2, 8) == ((6, 2), (4, 4))


def _flag(args, flag):
    return args[args.index(flag) + 1] if flag in args else None


def test_training_args_per_row():
    """Each row adds exactly its schedule and memory flags to the same model, data and batch flags."""
    model, config = ModelSetup(), ParallelConfig(2)
    data = ["--data-path", "/d/corpus", "--tokenizer-type", "NullTokenizer", "--vocab-size", "257"]
    one = training_args(model, config, RunSpec("1f1b", "1f1b", StockSetting(2, 1, 8)), data, "/r")
    assert "--num-layers-per-virtual-pipeline-stage" not in one and "--pipeline-schedule" not in one
    assert "--num-virtual-stages-per-pipeline-rank" not in one and "--recompute-granularity" not in one
    assert _flag(one, "--num-layers") == "4" and _flag(one, "--global-batch-size") == "16"
    assert _flag(one, "--timing-log-level") == "2" and _flag(one, "--timing-log-option") == "all"
    assert _flag(one, "--hidden-dropout") == "0" and _flag(one, "--attention-dropout") == "0"
    assert "--no-gradient-accumulation-fusion" in one  # the CPU layer's fused wgrad breaks --overlap-grad-reduce
    setting = StockSetting(2, 2, 8, 4, StockRecompute("full", method="block", num_layers=1))
    inter = training_args(model, config, RunSpec("interleaved-V2-g4", "interleaved", setting), data, "/r")
    assert _flag(inter, "--num-virtual-stages-per-pipeline-rank") == "2"
    assert _flag(inter, "--microbatch-group-size-per-virtual-pipeline-stage") == "4"
    assert _flag(inter, "--recompute-method") == "block" and _flag(inter, "--recompute-num-layers") == "1"
    assert inter.count("--pipeline-model-parallel-size") == 1
    pm = training_args(model, config, RunSpec("pipemesh-auto", "pipemesh-auto", groups=((8,), (8,)),
                                              plan_path="/p/plan.json"), data, "/r")
    assert _flag(pm, "--pipeline-schedule") == "pipemesh" and _flag(pm, "--pipemesh-plan") == "/p/plan.json"
    assert _flag(pm, "--num-layers-per-virtual-pipeline-stage") == "1"
    with pytest.raises(ValueError, match="plan file"):
        training_args(model, config, RunSpec("pipemesh", "pipemesh", groups=((8,), (8,))), data, "/r")
    dp = training_args(model, ParallelConfig(2, 2), RunSpec("1f1b", "1f1b", StockSetting(2, 1, 8)), data, "/r")
    assert "--overlap-grad-reduce" in dp and _flag(dp, "--global-batch-size") == "32"
    cmd = launch_command(2, ["--x"], ["ip", "netns", "exec", "ns"], python="py")
    assert cmd == ["ip", "netns", "exec", "ns", "py", "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", "2", "-m", "megatron_pipemesh.bench.rank", "--x"]
    # per-rank network: torchrun in the hub, its store on the hub's bridge address, each worker in its namespace
    cmd = launch_command(4, ["--x"], ["ip", "netns", "exec", "h"], python="py", rank_namespaces="h", master_port=29507)
    assert cmd == ["ip", "netns", "exec", "h", "py", "-m", "torch.distributed.run", "--nnodes", "1",
                   "--nproc-per-node", "4", "--master-addr", "10.213.0.254", "--master-port", "29507",
                   "-m", "megatron_pipemesh.bench.rank_netns", "h", "-m", "megatron_pipemesh.bench.rank", "--x"]


def _log(iter_ms, fwd, bwd, fb, warm=1, n=4):
    """A parsed log with constant per-iteration numbers (ms; per-rank lists)."""
    its = []
    for i in range(1, warm + n + 1):
        its.append(IterationRecord(i, iter_ms, 4.0, {
            "forward-backward": dict(enumerate(fb)), "forward-compute": dict(enumerate(fwd)),
            "backward-compute": dict(enumerate(bwd))}))
    return ParsedLog(its, warm + n)


SPECS = [RunSpec("1f1b", "1f1b", StockSetting(2, 1, 8), default=True),
         RunSpec("interleaved-V2-g2", "interleaved", StockSetting(2, 2, 8, 2)),
         RunSpec("interleaved-V2-g8", "interleaved", StockSetting(2, 2, 8, 8)),
         RunSpec("pipemesh", "pipemesh", groups=((6, 2), (4, 4)), plan_path="/p.json", recomputed=3)]
PEAKS = {"1f1b": [900, 500], "interleaved-V2-g2": [1000, 600], "interleaved-V2-g8": [2000, 1900],
         "pipemesh": [1100, 1000]}


def _results():
    out = []
    # row: (shaped iteration ms, unshaped iteration ms); breadth-first is the fastest but exceeds the budget
    for name, shaped_ms, unshaped_ms in (("1f1b", 900, 700), ("interleaved-V2-g2", 800, 600),
                                         ("interleaved-V2-g8", 500, 450), ("pipemesh", 700, 620)):
        for repeat in range(2):
            jitter = 10 * repeat
            out.append(RunResult("pp2", name, True, repeat, 0, 1.0, "x",
                                 _log(shaped_ms + jitter, [200, 210], [220, 230], [shaped_ms - 50] * 2), {0: 500.0, 1: 480.0},
                                 activation_peak_bytes=PEAKS[name]))
            out.append(RunResult("pp2", name, False, repeat, 0, 1.0, "x",
                                 _log(unshaped_ms + jitter, [200, 210], [220, 230], [unshaped_ms - 50] * 2),
                                 activation_peak_bytes=PEAKS[name]))
    out.append(RunResult("pp2", "pipemesh", True, 2, 1, 1.0, "x", ParsedLog([]), {}, "exit 1: boom"))
    return out


def test_summary_table_json_and_plot(tmp_path):
    """Rows carry measured peaks, fits and throughput; the faster breadth-first row exceeds the budget and
    is not the best stock; PipeMesh's ratio is to the fastest fitting stock row; table, JSON and chart render."""
    model = ModelSetup(warmup_iters=1, measured_iters=4)
    summary = summarize(_results(), model, [ParallelConfig(2)], {"pp2": SPECS}, {"pp2": 1500}, 200e6 / 8, 0.0)
    (entry,) = summary
    rows = {r["name"]: r for r in entry["schedules"]}
    tokens = model.tokens_per_iteration(1)
    shaped_tps = (tokens / 0.8 + tokens / 0.81) / 2  # median of the two repeats
    unshaped_tps = (tokens / 0.6 + tokens / 0.61) / 2
    inter = rows["interleaved-V2-g2"]
    assert inter["shaped"]["tokens_per_s_median"] == pytest.approx(shaped_tps) == inter["tokens_per_s"]
    assert inter["tokens_per_s_spread"] == pytest.approx((tokens / 0.8 - tokens / 0.81) / shaped_tps)
    assert inter["fraction_of_unshaped"] == pytest.approx(shaped_tps / unshaped_tps)
    assert inter["comm_share"] == pytest.approx(1 - 605 / 805)
    assert inter["shaped"]["idle_ms"] == [pytest.approx(750 - 420), pytest.approx(750 - 440)]
    assert inter["exposed_comm_ms"] == [pytest.approx(200), pytest.approx(200)]
    assert inter["stock_flags"] == ["--num-virtual-stages-per-pipeline-rank", "2",
                                    "--microbatch-group-size-per-virtual-pipeline-stage", "2"]
    assert rows["pipemesh"]["shaped"]["failed_runs"] == 1 and rows["pipemesh"]["shaped"]["runs"] == 2
    assert rows["pipemesh"]["shaped"]["peak_rss_mb"] == [500.0, 480.0]
    assert rows["interleaved-V2-g8"]["peak_activation_bytes"] == [2000, 1900]
    assert [r["fits"] for r in entry["schedules"]] == [True, True, False, True]
    assert rows["interleaved-V2-g8"]["tokens_per_s"] > inter["tokens_per_s"]
    assert entry["best_stock"] == "interleaved-V2-g2" and entry["best_stock_shaped"] == "interleaved-V2-g2"
    pm_tps = (tokens / 0.7 + tokens / 0.71) / 2
    assert rows["pipemesh"]["ratio_to_best_stock"] == pytest.approx(pm_tps / shaped_tps)
    assert entry["pipemesh_vs_best_stock_shaped"]["pipemesh"] == pytest.approx(pm_tps / shaped_tps)
    assert "ratio_to_best_stock" not in inter
    # the default command's row (here only 1F1B is marked) is the baseline of ratio_to_best_default
    assert entry["best_default"] == "1f1b" and rows["1f1b"]["default"] and not inter["default"]
    default_tps = (tokens / 0.9 + tokens / 0.91) / 2
    assert rows["pipemesh"]["ratio_to_best_default"] == pytest.approx(pm_tps / default_tps)
    cal = inter["calibration"]
    assert cal["unshaped"]["iteration_ms"] == pytest.approx(605, rel=0.02)  # the fitted overhead reproduces it
    assert entry["fitted_transfer_overhead_ms"] > 0 and entry["overhead_fitted_on"] == "interleaved-V2-g2"
    text = format_table(summary, "200 Mbit/s")
    assert "best stock (fastest that fits): interleaved-V2-g2" in text and "1f1b*" in text
    assert "best default command (fastest that fits): 1f1b" in text
    assert f"PipeMesh / best default command: pipemesh {pm_tps / default_tps:.3f}" in text
    assert f"pipemesh {pm_tps / shaped_tps:.3f}" in text and "interleaved-V2-g8 NO" in text
    assert "1 run(s) failed: exit 1: boom" in text and "simulator calibration" in text
    flat = [bench_cli.compact_row(entry, row) for row in entry["schedules"]]
    for row in flat:
        assert {"name", "fits", "peak_activation_bytes", "tokens_per_s", "tokens_per_s_spread", "stock_flags"} <= set(row)
    assert ("ratio_to_best_stock" in flat[-1]) and all("ratio_to_best_stock" not in r for r in flat[:-1])
    assert flat[-1]["ratio_to_best_default"] == pytest.approx(pm_tps / default_tps) and flat[-1]["best_default"] == "1f1b"
    assert [r["default"] for r in flat] == [True, False, False, False]
    json.dumps(summary)
    png = tmp_path / "bench.png"
    plot_summary(summary, str(png), "200 Mbit/s")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_overhead_is_fitted_on_the_shaped_run_without_unshaped_runs():
    """--quick / --no-limit run no unshaped variant: the per-transfer overhead is fitted on the shaped run of the
    depth-first stock row with the network modelled, reproduces that row, and the table says which run it was."""
    model = ModelSetup(warmup_iters=1, measured_iters=4)
    shaped_only = [r for r in _results() if r.shaped]
    (entry,) = summarize(shaped_only, model, [ParallelConfig(2)], {"pp2": SPECS}, {"pp2": 1500}, 200e6 / 8, 0.0)
    rows = {r["name"]: r for r in entry["schedules"]}
    assert (entry["overhead_fitted_on"], entry["overhead_fitted_variant"]) == ("interleaved-V2-g2", "shaped")
    assert entry["fitted_transfer_overhead_ms"] > 0
    assert rows["interleaved-V2-g2"]["calibration"]["shaped"]["iteration_ms"] == pytest.approx(805, rel=0.02)
    assert "unshaped" not in rows["interleaved-V2-g2"]["calibration"]
    assert "fitted on the shaped interleaved-V2-g2 run" in format_table([entry], "200 Mbit/s")
    (plain,) = summarize(_results(), model, [ParallelConfig(2)], {"pp2": SPECS}, {"pp2": 1500}, 200e6 / 8, 0.0)
    assert plain["overhead_fitted_variant"] == "unshaped" and plain["fitted_transfer_overhead_ms"] > 0
    plain_rows = {r["name"]: r for r in plain["schedules"]}
    assert plain_rows["interleaved-V2-g2"]["calibration"]["unshaped"]["iteration_ms"] == pytest.approx(605, rel=0.02)


def test_calibration_costs_and_fit():
    """Timers become simulator costs, shaping slows predictions, the fitted overhead reproduces a target time."""
    model, config = ModelSetup(), ParallelConfig(2)
    sched = ScheduleConfig.depth_first(2, 2, 8)
    compute = MeasuredCompute([160.0, 176.0], [320.0, 320.0], 50.0)
    costs = measured_costs(model, config, sched, compute, 25e6, latency_s=0.001)
    assert costs.forward_s == pytest.approx(0.010) and costs.backward_s == pytest.approx(0.020)
    assert costs.first_stage_extra_s == 0 and costs.last_stage_extra_s == pytest.approx(0.001 * 2 / 3)
    assert costs.p2p_s == pytest.approx(128 * 2 * 256 * 4 / 25e6) and costs.latency_s == 0.001
    free = predict_iteration_ms(model, config, sched, compute, None)
    shaped = predict_iteration_ms(model, config, sched, compute, 25e6)
    assert shaped["iteration_ms"] > free["iteration_ms"] >= 50 + 496
    target = free["forward_backward_ms"] + 40
    fitted = fit_transfer_overhead(model, config, sched, compute, target)
    check = copy.copy(measured_costs(model, config, sched, compute, None, latency_s=fitted))
    from megatron_pipemesh.planning.simulator import simulate
    assert simulate(sched, check).iteration_s * 1e3 == pytest.approx(target, rel=1e-3)
    assert fit_transfer_overhead(model, config, sched, compute, 1.0) == 0.0


def test_sigterm_stops_the_bench_like_ctrl_c():
    """SIGTERM raises KeyboardInterrupt in the bench, so the run's process group and namespace are cleaned up."""
    import os
    import signal

    previous = signal.getsignal(signal.SIGTERM)
    try:
        bench_cli._terminate_as_interrupt()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("argv,match", [
    (["--memory-budget-mb", "64"], "--memory-budget-mb 64 needs --sharding"),
    (["--sharding", "--configs", "pp2xdp2", "--activation-budget-mb", "auto"], "--activation-budget-mb auto with --sharding"),
    (["--sharding", "--configs", "pp2", "pp2xdp2"], "--sharding with --configs pp2 is invalid"),
    (["--sharding", "--configs", "pp2xdp2", "--memory-budget-mb", "auto:2"], "--memory-budget-mb auto:2 is invalid"),
    (["--sharding", "--configs", "pp2xdp2", "--memory-budget-mb", "0"], "--memory-budget-mb"),
])
def test_bad_sharding_input_is_a_usage_error(argv, match):
    """--sharding needs data parallelism and takes --memory-budget-mb (model state + activations), never the
    activation budget; --memory-budget-mb needs --sharding; each error names the flag and gives an example."""
    with pytest.raises(UsageError, match=match) as error:
        bench_cli.resolve(_args(*argv))
    assert "Example" in str(error.value)


def test_quick_sharding_defaults():
    """--quick --sharding: the --quick layout with hidden 256 / seq 128 (model state a real share of memory) and a
    memory budget auto:0.2; a flag the user gives wins; without --sharding nothing changes."""
    setup = bench_cli.resolve(_args("--quick", "--sharding"))
    assert setup["sharding"] and setup["budget_mb"] == ("auto", 0.2)
    assert (setup["model"].chunk.hidden_size, setup["model"].chunk.num_attention_heads, setup["model"].chunk.seq_length) == (256, 4, 128)
    assert (setup["model"].vpp, setup["model"].microbatches) == (4, 4) and [c.name for c in setup["configs"]] == ["pp2xdp2"]
    assert bench_cli.resolve(_args("--quick", "--sharding", "--memory-budget-mb", "70"))["budget_mb"] == 70
    assert bench_cli.resolve(_args("--quick", "--sharding", "--hidden-size", "128"))["model"].chunk.hidden_size == 128
    assert not bench_cli.resolve(_args("--quick"))["sharding"]


def test_training_args_with_sharding():
    """--sharding: every row runs the distributed optimizer with overlapped reduction and gather (no duplicate
    --overlap-grad-reduce); stock rows get no --pipemesh-sharding, PipeMesh rows their levels, in chunk order."""
    model, config = ModelSetup(vpp=2), ParallelConfig(2, 2)
    data = ["--data-path", "/d/corpus"]
    stock = training_args(model, config, RunSpec("interleaved-V2-g2", "interleaved", StockSetting(2, 2, 8, 2),
                                                 sharding=("optim", "optim")), data, "/r")
    assert {"--use-distributed-optimizer", "--overlap-param-gather"} <= set(stock)
    assert stock.count("--overlap-grad-reduce") == 1 and "--pipemesh-sharding" not in stock
    pm = training_args(model, config, RunSpec("pipemesh-auto", "pipemesh-auto", groups=((8,), (8,)),
                                              plan_path="/p.json", sharding=("optim", "optim_grads_params")), data, "/r")
    assert {"--use-distributed-optimizer", "--overlap-param-gather"} <= set(pm) and pm.count("--overlap-grad-reduce") == 1
    assert pm[pm.index("--pipemesh-sharding") + 1:] == ["optim", "optim_grads_params"]
    plain = training_args(model, config, RunSpec("1f1b", "1f1b", StockSetting(2, 1, 8)), data, "/r")
    assert "--use-distributed-optimizer" not in plain and "--overlap-grad-reduce" in plain


def test_sharding_fits_counts_model_state_and_activations():
    """--sharding: a row fits when every rank's measured peak of model state + activations is within the memory
    budget, however small its activations; rows and the JSON carry levels, state, peaks and predictions per rank."""
    model = ModelSetup(warmup_iters=1, measured_iters=4)
    config = ParallelConfig(2)
    specs = [RunSpec("interleaved-V2-g2", "interleaved", StockSetting(2, 2, 8, 2), sharding=("optim", "optim"),
                     predicted_state_bytes=(900.0, 800.0), predicted_peak_memory_bytes=(1400.0, 1300.0)),
             RunSpec("interleaved-V2-g8", "interleaved", StockSetting(2, 2, 8, 8), sharding=("optim", "optim")),
             RunSpec("pipemesh-auto", "pipemesh-auto", groups=((8,), (8,)), plan_path="/p.json",
                     sharding=("optim", "optim_grads"))]
    # (activation peaks, model state, peak of state + activations) per rank: g8's activations are the smallest but
    # its total exceeds the 1500-byte budget
    measured = {"interleaved-V2-g2": ([500, 400], [900, 800], [1400, 1250]),
                "interleaved-V2-g8": ([300, 300], [900, 800], [1600, 1150]),
                "pipemesh-auto": ([550, 450], [700, 650], [1300, 1150])}
    results = [RunResult("pp2", name, True, 0, 0, 1.0, "x", _log(800, [200, 210], [220, 230], [750] * 2),
                         activation_peak_bytes=act, model_state_bytes=state, peak_memory_bytes=total)
               for name, (act, state, total) in measured.items()]
    (entry,) = summarize(results, model, [config], {"pp2": specs}, {"pp2": 1500}, 200e6 / 8, 0.0, sharding=True)
    rows = {r["name"]: r for r in entry["schedules"]}
    assert [rows[n]["fits"] for n in measured] == [True, False, True]
    assert entry["memory_budget_bytes"] == 1500 and entry["activation_budget_bytes"] is None
    assert "ZeRO-1" in entry["stock_sharding"] and "CUDA-only" in entry["stock_sharding"]
    assert entry["best_stock"] == "interleaved-V2-g2"
    g2 = bench_cli.compact_row(entry, rows["interleaved-V2-g2"])
    assert g2["sharding"] == ["optim", "optim"] and g2["model_state_bytes"] == [900, 800]
    assert g2["peak_activation_bytes"] == [500, 400] and g2["peak_memory_bytes"] == [1400, 1250]
    assert g2["predicted_model_state_bytes"] == [900.0, 800.0] and g2["predicted_peak_memory_bytes"] == [1400.0, 1300.0]
    assert g2["memory_budget_bytes"] == 1500
    pm = bench_cli.compact_row(entry, rows["pipemesh-auto"])
    assert pm["sharding"] == ["optim", "optim_grads"] and pm["ratio_to_best_stock"] > 0
    text = format_table([entry], "200 Mbit/s")
    assert "memory (model state + activations) budget per rank" in text and "interleaved-V2-g8 NO" in text
    assert "sharding optim optim_grads" in text and "ZeRO-1 only" in text
    plain = bench_cli.compact_row({"config": "pp2"}, rows["interleaved-V2-g2"])
    assert "model_state_bytes" not in plain  # without --sharding the JSON rows keep their keys
