"""The training-log report: the `PipeMesh plan:` line, the per-interval figures and their writers."""
import argparse
import re

from megatron_pipemesh.config import PipeMeshConfig, ScheduleSettings
from megatron_pipemesh.integration.flags import PipeMeshArgs
from megatron_pipemesh.integration.report import (IntervalReport, format_interval, parse_interval_line, plan_line,
                                                  megatron_syncs, recompute_summary, schedule_picture, write_scalars)
from megatron_pipemesh.runtime.stats import OpRecord, RuntimeStats
from megatron_pipemesh.schedule.config import ScheduleConfig
from megatron_pipemesh.schedule.lower import LoweringOptions, lower
from megatron_pipemesh.schedule.plan import RunPlan


def _args(**overrides):
    values = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64, micro_batch_size=2,
                  tensor_model_parallel_size=1, data_parallel_size=1, pipemesh_device_tflops=1.0, pipemesh_mfu=0.5,
                  pipemesh_dp_gbps=10.0, pipemesh_p2p_gbps=10.0, bf16=False, padded_vocab_size=256)
    values.update(overrides)
    return argparse.Namespace(**values)


def _settings(config, recompute=None, flags=PipeMeshConfig(ScheduleSettings(pipeline_schedule="pipemesh"))):
    return PipeMeshArgs(True, RunPlan(config, recompute or {}), 60.0, flags=flags)


def test_plan_line_names_groups_digest_recompute_and_predictions():
    """The start-up line carries p, V, m, the groups, the digest the runtime checks, recompute and predictions."""
    config = ScheduleConfig(2, 2, 8, (6, 2), (4, 4))
    line = plan_line(_args(overlap_grad_reduce=True), _settings(config, {(0, 0, 0): "full", (0, 0, 1): "selective"}))
    digest = lower(config, LoweringOptions(param_sync=False, grad_sync=True)).digest()
    assert line.startswith("PipeMesh plan: p=2 V=2 m=8 | --forward-groups 6 2 --backward-groups 4 4 | digest " + digest)
    assert "recompute full 1, selective 1 of 32 chunk-micro-batches" in line
    assert "predicted peak activation MiB per rank " in line and "predicted iteration " in line
    assert "(depth-first " in line and "breadth-first " in line
    assert "[analytic costs at 1 TFLOP/s peak (--pipemesh-device-tflops) at MFU 0.5]" in line  # where the rate came from


def test_training_lowering_follows_megatrons_sync_switches():
    """The digest is computed with the DP hooks Megatron will set (grad sync needs overlap + align)."""
    def training_lowering(args, recv_lookahead, placement=None):
        return RunPlan(placement=placement or {}, recv_lookahead=recv_lookahead).lowering(**megatron_syncs(args))
    assert training_lowering(_args(), 1) == LoweringOptions(recv_lookahead=1, param_sync=False, grad_sync=False)
    assert training_lowering(_args(overlap_grad_reduce=True, align_grad_reduce=False), 2).grad_sync is False
    both = training_lowering(_args(overlap_grad_reduce=True, overlap_param_gather=True, align_param_gather=True), 1)
    assert both.grad_sync and both.param_sync


def test_recompute_summary_counts_levels():
    """Recompute is summarised as counts per level out of all chunk-micro-batches."""
    config = ScheduleConfig(2, 2, 4, (4,), (4,))
    assert recompute_summary({}, config) == "recompute none"
    assert recompute_summary({(0, 0, 0): "none", (1, 1, 2): "full"}, config) == "recompute full 1 of 16 chunk-micro-batches"


def test_schedule_picture_shows_the_first_ranks_only():
    """--pipemesh-print-schedule draws at most 4 ranks and says how to see the rest."""
    picture = schedule_picture(ScheduleConfig(6, 2, 12, (12,), (6, 6)))
    rows = [line for line in picture.splitlines() if line.startswith("rank ")]
    assert [row.split(" |")[0] for row in rows] == ["rank 0", "rank 1", "rank 2", "rank 3"]
    assert "2 more ranks (pipemesh show --picture --pp 6 --vpp 2 -m 12" in picture


def _stats(wait, drain, dp, total, peak, source="saved-tensors", timed=True):
    stats = RuntimeStats(0, 0, "d", False, [OpRecord(0, "F0.0", 0.0, wait, 0.1)])
    stats.total_s, stats.send_drain_s, stats.dp_sync_s = total, drain, dp
    stats.memory_source, stats.peak_activation_bytes, stats.timed_waits = source, peak, timed
    return stats


def test_interval_report_averages_waits_and_keeps_the_peak():
    """Waits are averaged per iteration, the activation peak is the interval's maximum, re-reads are ignored."""
    report = IntervalReport()
    first, second = _stats(0.010, 0.002, 0.004, 0.100, 3 << 20), _stats(0.020, 0.0, 0.002, 0.300, 1 << 20)
    report.add(first)
    report.add(first)
    report.add(second)
    report.add(RuntimeStats(0, 0, "d", True, total_s=9.0))  # forward-only (evaluation): not counted
    figures = report.local_figures()
    assert figures["iterations"] == 2
    assert abs(figures["pipeline_wait_ms"] - 16.0) < 1e-9 and abs(figures["dp_wait_ms"] - 3.0) < 1e-9
    assert abs(figures["forward_backward_ms"] - 200.0) < 1e-9 and figures["peak_activation_mib"] == 3.0


def test_interval_line_round_trips_and_hides_untimed_waits():
    """The per-interval line parses back; a metered stock schedule shows no wait columns."""
    pm = IntervalReport()
    pm.add(_stats(0.001, 0.0, 0.002, 0.05, 2 << 20))
    stock = IntervalReport()
    stock.add(_stats(0.0, 0.0, 0.0, 0.04, 1 << 20, timed=False))
    line = format_interval(10, [pm.local_figures(), pm.local_figures()])
    parsed = parse_interval_line("noise " + line)
    assert parsed == {"iteration": 10, "forward-backward": [50.0, 50.0], "pipeline wait": [1.0, 1.0],
                      "data-parallel wait": [2.0, 2.0], "peak activation": [2.0, 2.0]}
    stock_line = format_interval(10, [stock.local_figures()])
    assert "pipeline wait" not in stock_line and parse_interval_line(stock_line)["peak activation"] == [1.0]
    assert format_interval(10, [IntervalReport().local_figures()]) is None


def test_scalars_go_to_tensorboard_and_wandb():
    """Every per-rank figure is written under pipemesh/<name>/rank<r> to both writers."""
    class Board:
        def __init__(self):
            self.calls = []

        def add_scalar(self, name, value, step):
            self.calls.append((name, value, step))

        def log(self, values, step):
            self.calls.append((values, step))

    report = IntervalReport()
    report.add(_stats(0.001, 0.0, 0.002, 0.05, 2 << 20))
    board, wandb = Board(), Board()
    write_scalars(7, [report.local_figures()] * 2, board, wandb)
    assert ("pipemesh/peak_activation_mib/rank1", 2.0, 7) in board.calls and len(board.calls) == 8
    assert wandb.calls[0][1] == 7 and wandb.calls[0][0]["pipemesh/pipeline_wait_ms/rank0"] == 1.0


def test_plan_line_reports_host_placement_per_rank_and_digest_with_host_ops():
    """Host-placed chunk-micro-batches are counted per rank with their bytes, and the digest includes OFFLOAD/RELOAD."""
    config = ScheduleConfig(2, 2, 8, (6, 2), (4, 4))
    plan = {(0, 0, 0): "host", (0, 1, 0): "host", (0, 0, 1): "full", (1, 0, 3): "host"}
    line = plan_line(_args(), _settings(config, plan))
    digest = lower(config, LoweringOptions(param_sync=False, grad_sync=False,
                                           host_placement=((0, 0, 0), (0, 1, 0), (1, 0, 3)))).digest()
    assert f"digest {digest}" in line and RunPlan(config, plan).lowering(**megatron_syncs(_args())).host_placement == (
        (0, 0, 0), (0, 1, 0), (1, 0, 3))
    assert "recompute full 1 of 32 chunk-micro-batches" in line
    match = re.search(r"host 2 \(([0-9.]+) MiB\) 1 \(([0-9.]+) MiB\) per rank", line)
    assert match and float(match.group(1)) > float(match.group(2)) > 0, line
    assert "host" not in plan_line(_args(), _settings(config, {(0, 0, 0): "full"})).split("|")[3]


def test_interval_line_reports_peak_host_memory():
    """With offloaded activations the interval line adds the peak host MiB per rank (and only then)."""
    report = IntervalReport()
    stats = _stats(0.001, 0.0, 0.002, 0.05, 2 << 20)
    stats.peak_host_bytes = 3 << 20
    report.add(stats)
    line = format_interval(10, [report.local_figures(), IntervalReport().local_figures() | {"iterations": 1}])
    assert line.endswith("| peak host MiB 3.00 0.00"), line
    assert parse_interval_line(line)["peak host"] == [3.0, 0.0]
