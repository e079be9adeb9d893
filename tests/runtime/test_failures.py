"""Failures end with the runtime's own error naming rank, step, op and plan digest, never a hang."""
import re

import pytest

from megatron_pipemesh.schedule.plan import RunPlan
from megatron_pipemesh.schedule import ScheduleConfig, lower
from megatron_pipemesh.schedule.lower import LoweringOptions
from tests import megatron_harness as h

# faulty_peer / plan_mismatch: PP=2, V=2, m=8, no DDP (no sync ops); rank 1's default groups are depth-first.
ELASTIC = ScheduleConfig(2, 2, 8, (6, 2), (4, 4))
DEFAULT = ScheduleConfig.depth_first(2, 2, 8)
WHERE = re.compile(r"rank 0 \(pipeline rank 0\), step (\d+) \((\S+)\) of plan ([0-9a-f]{16}) \[(.*?)\]: (.*)")
FAILED_AFTER = re.compile(r"worker: rank 0 failed after ([0-9.]+) s")
SLACK_S = 10  # beyond the runtime's own timeout, for a busy 2-core machine
HARNESS_TIMEOUT_S = 180  # start-up alone can take over a minute on a busy 2-core machine; a hang hits this


def _plan(config):
    """The plan the runtime lowers for a model without DDP (no sync functions, hence no sync ops)."""
    return lower(config, LoweringOptions(recv_lookahead=RunPlan().recv_lookahead, param_sync=False,
                                         grad_sync=False))


def _failure(kwargs, torchrun_args=()):
    """Run faulty_peer; return (seconds rank 0's schedule ran before it gave up, the op it names, the runtime's
    message after the WHERE prefix). The job itself must end (no hang) before the harness kills it."""
    with pytest.raises(h.WorkerError) as info:
        h.run_worker("tests.runtime.workers:faulty_peer", nproc=2, timeout=HARNESS_TIMEOUT_S, kwargs=kwargs,
                     torchrun_args=torchrun_args)
    text = str(info.value)
    assert f"timed out after {HARNESS_TIMEOUT_S}" not in text, "the job hung until the harness killed it"
    match, failed_after = WHERE.search(text), FAILED_AFTER.search(text)
    assert match and failed_after, f"no runtime error naming rank/step/op/plan in:\n{text[-3000:]}"
    elapsed = float(failed_after.group(1))
    step, op, digest, described, what = match.groups()
    plan = _plan(DEFAULT)
    assert (digest, described) == (plan.digest(), DEFAULT.describe())
    assert str(plan.programs[0][int(step)]) == op
    return elapsed, op, what


def test_plan_mismatch_is_detected_at_start_up():
    """Ranks given different groups stop before the first op, each plan printed with its digest."""
    with pytest.raises(h.WorkerError) as info:
        h.run_worker("tests.runtime.workers:plan_mismatch", nproc=2, timeout=HARNESS_TIMEOUT_S)
    text = str(info.value)
    assert f"timed out after {HARNESS_TIMEOUT_S}" not in text, "the job hung until the harness killed it"
    assert float(FAILED_AFTER.search(text).group(1)) < SLACK_S  # one all-gather, no op run
    assert re.search(r"rank [01]: ranks disagree on the PipeMesh plan", text)
    for rank, config in ((0, ELASTIC), (1, DEFAULT)):
        assert f"  rank {rank}: plan {_plan(config).digest()} {config.describe()}" in text


def test_stuck_peer_times_out_naming_rank_step_and_op():
    """A peer stuck in its first forward makes rank 0's receive time out after the configured 4 s."""
    elapsed, op, what = _failure({"mode": "stuck", "timeout_s": 4})
    assert op == "F1.0"  # rank 0's first op that needs rank 1's output
    assert 4 <= elapsed < 4 + SLACK_S
    # gloo raises its own timeout error (the runtime wraps it as "failed: ..."); other backends return False
    assert what.startswith(("receive of its input timed out after 4 s", "receive of its input failed:"))
    assert "4 s" in what or "4000ms" in what


def test_killed_peer_ends_the_job():
    """A peer that dies in its first forward makes rank 0's receive fail (or time out after 20 s) with the
    runtime's message, well before the harness kills it; when the peer's connection closed before rank 0 posts a
    later transfer, the post fails with that message instead."""
    # torchrun polls its ranks every 10 s here (default 0.1 s), so rank 0 reports before torchrun stops it.
    elapsed, op, what = _failure({"mode": "killed", "timeout_s": 20}, torchrun_args=("--monitor-interval", "10"))
    assert elapsed < 20 + SLACK_S
    if op == "F1.0":  # rank 0's first op that needs rank 1's output
        assert what.startswith(("receive of its input failed", "receive of its input timed out after 20 s"))
    else:  # a transfer rank 0 posts before it, to or from rank 1
        assert re.fullmatch(r"(SEND_F0\.[01]>1|RECV_F1\.[01]<1)", op), op
        kind = "send to" if op.startswith("SEND") else "receive from"
        assert what.startswith(f"posting the {kind} pipeline rank 1 failed: "), what
