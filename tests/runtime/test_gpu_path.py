"""The executor's GPU-path decisions, pinned on CPU with recording stand-ins (no process group needed)."""
from datetime import timedelta

import pytest
import torch

from megatron_pipemesh.runtime.executor import PipeMeshRuntimeError, _Run
from megatron_pipemesh.runtime.stats import OpRecord, RuntimeStats
from megatron_pipemesh.runtime.transport import DistTransport, timed_waits
from megatron_pipemesh.schedule.ops import Op, OpKind


class RecordingWork:
    """Stands in for a c10d Work: records how it was waited on."""

    def __init__(self, completes=True):
        self.calls = []
        self.completes = completes

    def wait(self, *args):
        self.calls.append(args)
        return self.completes

    def is_completed(self):
        return True


class RecordingTransport(DistTransport):
    """The torch.distributed transport on a named backend, global rank 3, whose transfers are given works."""

    def __init__(self, backend: str, groups, works):
        super().__init__(lambda: groups)
        self._backend, self.works, self.posted = backend, list(works), []

    def rank(self):
        return 3

    def backend(self, group):
        return self._backend

    def _irecv(self, tensor, src, group, tag):
        self.posted.append(("recv", src, group, tag))
        return self.works.pop(0)

    def _isend(self, tensor, dst, group, tag):
        self.posted.append(("send", dst, group, tag))
        return self.works.pop(0)


def _run(backend: str, device: str = "cpu", groups=None, works=()):
    """A call on pipeline rank 1 of global ranks [2, 3], its transport started (no process group needed)."""
    run = _Run.__new__(_Run)  # only the fields the helpers read
    run.rank, run.pp_rank, run.pp_ranks = 3, 1, [2, 3]

    class Plan:
        def digest(self):
            return "abc123"

        class config:
            @staticmethod
            def describe():
                return "p=2 V=2 m=4"
    run.schedule = Plan()
    run.transport = RecordingTransport(backend, {("F", 2, 3): "group-F-2-3"} if groups is None else groups, works)
    run.transport.start_call(pp_group=None, device=torch.device(device), timeout=timedelta(seconds=7), locate=run._where,
                             retire=lambda op, tensor: None, uses_links=True)
    return run


def _receive_input(run, microbatch: int = 2):
    """Post the receive of F1.<microbatch>'s input from pipeline rank 0 (link F 2->3)."""
    op = Op(OpKind.RECV_FORWARD, 1, microbatch, peer=0)
    run.transport.post_receive(op, torch.empty(1), run._link("F", 0, 1), 4)


@pytest.mark.parametrize("backend,device,timed", [
    ("gloo", "cpu", True), ("nccl", "cuda", False), ("cpu:gloo,cuda:nccl", "cuda", False),
    ("cpu:gloo,cuda:nccl", "cpu", True), ("ucc", "cuda", False)])
def test_only_gloo_waits_carry_a_timeout(backend, device, timed):
    """NCCL (and any non-gloo) work is waited on without a timeout; gloo work with one."""
    assert timed_waits(backend, torch.device(device)) is timed


def test_nccl_wait_has_no_timeout_and_gloo_wait_has_one():
    """The executor's wait passes no timeout on NCCL (a timed NCCL wait blocks the host) and the
    configured timeout on gloo."""
    op = Op(OpKind.FORWARD, 1, 2)
    nccl, gloo = RecordingWork(), RecordingWork()
    for run in (_run("nccl", "cuda", works=[nccl]), _run("gloo", works=[gloo])):
        _receive_input(run)
        run.transport.wait_receive(op, 5, "receive")
    assert nccl.calls == [()]
    assert gloo.calls == [(timedelta(seconds=7),)]


def test_gloo_timeout_names_rank_step_op_and_plan():
    """A gloo wait that times out raises naming the rank, pipeline rank, step, op and plan digest, and
    marks its link unusable."""
    run = _run("gloo", works=[RecordingWork(completes=False)])
    _receive_input(run)
    with pytest.raises(PipeMeshRuntimeError) as info:
        run.transport.wait_receive(Op(OpKind.FORWARD, 1, 2), 5, "receive of its input")
    text = str(info.value)
    for part in ("rank 3 (pipeline rank 1)", "step 5", "F1.2", "abc123", "timed out after 7 s"):
        assert part in text
    assert run.transport.broken_links == ["F 2->3"]  # gloo closed that link: the next call must say so


def test_missing_link_group_is_an_error_naming_the_link():
    """No silent fall-back to the shared pipeline group: a missing link group raises naming the link."""
    run = _run("gloo", groups={("F", 2, 3): "group-F-2-3"}, works=[RecordingWork()])
    _receive_input(run)
    assert run.transport.posted[0][2] == "group-F-2-3"
    with pytest.raises(PipeMeshRuntimeError) as info:
        run.transport.send(Op(OpKind.SEND_BACKWARD, 0, 0, peer=0), torch.zeros(1), run._link("B", 1, 0), 4)
    assert "pipeline link B 3->2" in str(info.value) and "install()" in str(info.value)


def test_stats_resolve_reads_cuda_style_events_lazily():
    """Compute times come from the (start, ready, end) events when present, read only on demand."""
    class Event:
        def __init__(self, ms):
            self.ms, self.synced = ms, False

        def elapsed_time(self, other):
            return other.ms - self.ms

        def synchronize(self):
            self.synced = True
    events = (Event(0.0), Event(2.0), Event(12.0))
    stats = RuntimeStats(0, 0, "d", False, [OpRecord(0, "F0.0", 0.0, 0.5, 0.5, events)])
    assert stats.records[0].compute_s == 0.5  # not read yet: no synchronisation happened
    assert stats.forward_s == pytest.approx(0.010)
    assert stats.records[0].wait_s == pytest.approx(0.002)
    assert events[2].synced and stats.time_source == "cuda-events"


def test_a_replacing_schedule_continues_the_transfer_tags():
    """A schedule that replaces another mid-run (re-planning) continues its call counter and failure
    state, so a stale receive of an earlier failed call keeps a tag no later call uses."""
    from megatron_pipemesh.runtime.executor import PipeMeshOptions, PipeMeshSchedule
    from megatron_pipemesh.schedule.plan import RunPlan

    old = PipeMeshSchedule(RunPlan(), PipeMeshOptions(), p2p_groups=dict)
    next(old.transport._calls), next(old.transport._calls)
    old.transport.broken_links.append("F 0->1")
    new = PipeMeshSchedule(RunPlan(), PipeMeshOptions(), p2p_groups=dict).continue_from(old)
    assert next(new.transport._calls) == 2 and new.transport.broken_links == ["F 0->1"]
