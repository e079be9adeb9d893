"""The executor's pipeline transport: the in-process loopback runs a whole multi-rank program like gloo ranks do,
failures name rank, step and op, a failed call's sends stay alive, and the wait policy follows the backend."""
import re
from datetime import timedelta

import pytest
import torch

from megatron_pipemesh.runtime.errors import PipeMeshRuntimeError
from megatron_pipemesh.runtime.loopback import LoopbackWorld
from megatron_pipemesh.runtime.transport import GLOO_POLICY, NCCL_POLICY, DistTransport
from megatron_pipemesh.schedule import ScheduleConfig, lower
from megatron_pipemesh.schedule.lower import LoweringOptions
from megatron_pipemesh.schedule.ops import Op, OpKind
from tests import megatron_harness as h
from tests.runtime.transport_workers import FAIL_TIMEOUT_S, HOST_TIMEOUT_S

PP, VP, M, FORWARD, BACKWARD = 2, 2, 8, [6, 2], [4, 4]
WHERE = re.compile(r"rank 0 \(pipeline rank 0\), step (\d+) \((\S+)\) of plan ([0-9a-f]{16}) \[(.*?)\]: (.*)")
SEND, RECV, LINK = Op(OpKind.SEND_FORWARD, 0, 0, peer=1), Op(OpKind.RECV_FORWARD, 0, 0, peer=0), ("F", 0, 1)


@pytest.fixture(scope="module")
def loopback():
    """Clean and failing loopback runs under both policies, and the whole-model reference, in one process."""
    return h.run_worker("tests.runtime.transport_workers:loopback_runs", nproc=1, timeout=240,
                        kwargs={"pp": PP, "vp": VP, "microbatches": M, "forward_groups": FORWARD,
                                "backward_groups": BACKWARD})[0]


@pytest.fixture(scope="module")
def gloo():
    results = h.run_worker("tests.runtime.transport_workers:gloo_pipeline", nproc=PP, timeout=180,
                           kwargs={"pp": PP, "vp": VP, "microbatches": M, "forward_groups": FORWARD,
                                   "backward_groups": BACKWARD})
    return h.merge_rank_results(results)


def _flat(losses):
    return [value for pair in losses for value in pair]


def _plan():
    return lower(ScheduleConfig(PP, VP, M, tuple(FORWARD), tuple(BACKWARD)),
                 LoweringOptions(recv_lookahead=1, param_sync=False, grad_sync=False))


def test_loopback_runs_a_whole_program_like_gloo_ranks(loopback, gloo):
    """Thread-ranks over the loopback (either policy) give exactly the losses and gradients of gloo ranks, which
    equal the whole model's; no transfer or plan check touched torch.distributed."""
    reference = loopback["reference"]
    for backend in ("gloo", "nccl"):
        run = loopback[backend]
        assert not run["errors"] and all(run["ranks"]), run["errors"]
        assert run["dist_calls"] == {}
        losses = run["ranks"][PP - 1]["losses"]
        assert len(losses) == M and losses == gloo["losses"], backend
        assert max(h.compare_grads(run["grads"], gloo["grads"]).values()) == 0.0, backend
        assert _flat(losses) == pytest.approx(_flat(reference["losses"]), rel=1e-6)
        assert max(h.compare_grads(run["grads"], reference["grads"]).values()) <= 1e-6


def test_waits_are_timed_on_gloo_and_untimed_on_nccl(loopback):
    """The policy comes from the pipeline group's backend: every wait timed under gloo, none under NCCL."""
    assert loopback["gloo"]["timed_waits"] == loopback["gloo"]["waits"] > 0
    assert loopback["nccl"]["timed_waits"] == 0 < loopback["nccl"]["waits"]


def _failure(run, what: str):
    """Rank 0's error names its rank, the step and op F1.0 (its first op needing rank 1) and the plan."""
    error = run["ranks"][0]["error"]
    match = WHERE.search(error)
    assert match, error
    step, op, digest, described, said = match.groups()
    plan = _plan()
    assert (digest, described) == (plan.digest(), plan.config.describe())
    assert str(plan.programs[0][int(step)]) == op == "F1.0"
    assert said == what
    assert "injected failure" in run["ranks"][1]["error"]


def test_gloo_timeout_names_rank_step_and_op_and_breaks_the_link(loopback):
    """gloo policy: rank 1 fails in its first forward; rank 0's wait for its output times out naming rank, step,
    op and plan, and rank 0's next call refuses the link. Rank 1's posted receives only count (tags keep them
    apart)."""
    run = loopback["gloo-failing"]
    _failure(run, f"receive of its input timed out after {FAIL_TIMEOUT_S:.0f} s")
    rank0, rank1 = run["ranks"]
    assert rank0["broken_links"] == ["F 1->0"]
    assert "rank 0: an earlier call of the PipeMesh schedule failed and left the pipeline links F 1->0 unusable" in \
        rank0["next_call"]
    assert rank1["abandoned_receives"] >= 1 and rank1["broken_links"] == [] and "next_call" not in rank1


def test_a_failed_programs_sends_stay_alive(loopback):
    """Rank 0's sends that rank 1 never received are kept in flight with their output tensors after the failure."""
    rank0 = loopback["gloo-failing"]["ranks"][0]
    assert rank0["sends_in_flight"] > 0
    assert rank0["sends_holding_outputs"] == rank0["abandoned_sends"] >= rank0["sends_in_flight"]


def test_nccl_policy_failure_breaks_the_links_of_posted_receives(loopback):
    """NCCL policy: rank 0's untimed wait ends only with the transport's own failure (the watchdog's part), and
    rank 1's posted receives, which NCCL could not cancel, make their link unusable for its next call."""
    run = loopback["nccl-failing"]
    _failure(run, f"receive of its input failed: loopback transfer not matched within {HOST_TIMEOUT_S} s")
    rank0, rank1 = run["ranks"]
    assert set(rank0["broken_links"]) == {"F 1->0"}
    assert set(rank1["broken_links"]) == {"F 0->1"}
    assert "left the pipeline links F 0->1 unusable" in rank1["next_call"]


# The transport alone (no Megatron, no threads: a loopback post never blocks) -------------------------
def _start(transport, retired=None, timeout_s: float = 5.0):
    transport.start_call(pp_group=transport.world.pipeline_group, device=torch.device("cpu"),
                         timeout=timedelta(seconds=timeout_s),
                         locate=lambda step, op: f"rank {transport.rank()}, step {step} ({op})",
                         retire=lambda op, tensor: (retired if retired is not None else []).append(op),
                         uses_links=True)


def test_sends_of_a_failed_call_stay_alive_and_still_arrive():
    """A send its call left unmatched is kept, not dropped (dropping a gloo send's work cancels it), reaches the
    receive its peer posts with that call's tag, and is let go at the next call once complete."""
    world = LoopbackWorld(2)
    sender, receiver = world.transport(0), world.transport(1)
    for transport in (sender, receiver):
        _start(transport)
    data = torch.arange(4.0)
    sender.send(SEND, data, LINK, 0)
    sender.abandon()
    kept = sender.abandoned_sends
    assert len(kept) == 1 and kept[0].tensor is data and not kept[0].work.is_completed()
    buffer = torch.zeros(4)
    receiver.post_receive(RECV, buffer, LINK, 0)
    assert receiver.wait_receive(RECV.compute, 1, "receive of its input") is buffer
    assert torch.equal(buffer, data)
    _start(sender)
    assert sender.abandoned_sends == []


def test_a_failed_calls_posted_receive_cannot_take_later_data():
    """gloo policy: a receive call 0 left posted keeps call 0's tag and its link stays usable; call 1's send reaches
    call 1's receive, and is retired once complete."""
    world = LoopbackWorld(2)
    sender, receiver = world.transport(0), world.transport(1)
    for transport in (sender, receiver):
        _start(transport)
    stale = torch.zeros(4)
    receiver.post_receive(RECV, stale, LINK, 0)
    receiver.abandon()
    assert receiver.abandoned_receives == 1 and receiver.broken_links == []
    retired = []
    _start(sender, retired)
    _start(receiver)
    assert (sender.tag, receiver.tag) == (1, 1)
    fresh = torch.zeros(4)
    receiver.post_receive(RECV, fresh, LINK, 0)
    sender.send(SEND, torch.ones(4), LINK, 0)
    assert receiver.wait_receive(RECV.compute, 1, "receive of its input") is fresh
    sender.drain_sends(1, block=True)
    assert torch.equal(fresh, torch.ones(4)) and torch.equal(stale, torch.zeros(4)) and retired == [SEND]
    assert world.waits == [(timedelta(seconds=5),)] * 2
    receiver.end_call()


def test_nccl_policy_waits_untimed_and_posted_receives_break_their_links():
    """NCCL policy: waits take no timeout; receives a failed call left posted mark their link broken, and the next
    call fails naming it."""
    world = LoopbackWorld(2, backend="nccl")
    sender, receiver = world.transport(0), world.transport(1)
    for transport in (sender, receiver):
        _start(transport)
    assert receiver.policy is NCCL_POLICY
    receiver.post_receive(RECV, torch.zeros(4), LINK, 0)
    sender.send(SEND, torch.ones(4), LINK, 0)
    receiver.wait_receive(RECV.compute, 1, "receive of its input")
    sender.drain_sends(1, block=True)
    assert world.waits == [(), ()]
    receiver.post_receive(Op(OpKind.RECV_FORWARD, 0, 1, peer=0), torch.zeros(4), LINK, 2)
    with pytest.raises(PipeMeshRuntimeError, match=r"rank 1: receives posted but never consumed: F0\.1"):
        receiver.end_call()
    receiver.abandon()
    assert receiver.abandoned_receives == 1 and receiver.broken_links == ["F 0->1"]
    with pytest.raises(PipeMeshRuntimeError, match=r"rank 1: an earlier call .* links F 0->1 unusable"):
        _start(receiver)


def test_a_missing_link_is_an_error_naming_it():
    """No fall-back to another group: a transfer on a link the transport has no group for fails naming it."""
    transport = LoopbackWorld(2, links=[LINK]).transport(1)
    _start(transport)
    with pytest.raises(PipeMeshRuntimeError, match=r"rank 1, step 3 \(SEND_B0\.0>0\): no process group for the "
                                                   r"pipeline link B 1->0 \(gradients from global rank 1 to 0\)"):
        transport.send(Op(OpKind.SEND_BACKWARD, 0, 0, peer=0), torch.ones(1), ("B", 1, 0), 3)


@pytest.mark.parametrize("kind", ["send", "recv"])
def test_a_post_refused_by_the_backend_names_rank_step_op_and_breaks_the_link(monkeypatch, kind):
    """gloo raises at the post itself once the peer's connection closed (a dead peer): the error names rank, step,
    op and the peer like a failed wait, and the link is counted broken."""
    transport = LoopbackWorld(2, links=[LINK]).transport(0 if kind == "send" else 1)

    def refused(*args):
        raise RuntimeError("Connection closed by peer [10.0.0.2]:1234")

    monkeypatch.setattr(transport, f"_i{kind}", refused)
    _start(transport)
    with pytest.raises(PipeMeshRuntimeError) as raised:
        if kind == "send":
            transport.send(SEND, torch.ones(1), LINK, 4)
        else:
            transport.post_receive(RECV, torch.zeros(1), LINK, 4)
    where = f"rank {transport.rank()}, step 4 ({SEND if kind == 'send' else RECV})"
    peer = "send to pipeline rank 1" if kind == "send" else "receive from pipeline rank 0"
    assert str(raised.value) == f"{where}: posting the {peer} failed: Connection closed by peer [10.0.0.2]:1234"
    assert transport.broken_links == ["F 0->1"]


@pytest.mark.parametrize("backend,device,policy", [
    ("gloo", "cpu", GLOO_POLICY), ("nccl", "cuda", NCCL_POLICY), ("cpu:gloo,cuda:nccl", "cuda", NCCL_POLICY),
    ("cpu:gloo,cuda:nccl", "cpu", GLOO_POLICY), ("ucc", "cuda", NCCL_POLICY)])
def test_the_torch_transport_takes_its_policy_from_the_pipeline_groups_backend(monkeypatch, backend, device, policy):
    """DistTransport picks the policy from the pipeline group's backend (no NCCL needed: the backend is stubbed),
    and asks for the link groups only when the program transfers (the provider may be a collective call)."""
    from megatron_pipemesh.runtime import transport as module

    asked = []
    monkeypatch.setattr(module.dist, "get_backend", lambda group: backend)
    transport = DistTransport(lambda: asked.append(True) or {})
    for uses_links in (False, True):
        transport.start_call(pp_group="pipeline", device=torch.device(device), timeout=timedelta(seconds=1),
                             locate=lambda step, op: "", retire=lambda op, tensor: None, uses_links=uses_links)
        assert transport.policy is policy
    assert asked == [True]


def test_a_schedule_takes_a_transport_or_the_link_groups_of_the_default_one(monkeypatch):
    """PipeMeshSchedule(transport=...) uses that transport; without one it builds the torch.distributed one on the
    given link groups, and without those either its first transfer fails saying what to pass."""
    from megatron_pipemesh.runtime import PipeMeshOptions, PipeMeshSchedule
    from megatron_pipemesh.runtime import transport as module
    from megatron_pipemesh.schedule.plan import RunPlan

    loopback = LoopbackWorld(2).transport(0)
    assert PipeMeshSchedule(RunPlan(), PipeMeshOptions(), transport=loopback).transport is loopback
    with pytest.raises(ValueError, match="either a transport or the p2p_groups"):
        PipeMeshSchedule(RunPlan(), PipeMeshOptions(), p2p_groups=dict, transport=loopback)
    default = PipeMeshSchedule(RunPlan(), PipeMeshOptions()).transport
    assert isinstance(default, DistTransport) and default.link_groups is None
    monkeypatch.setattr(module.dist, "get_backend", lambda group: "gloo")
    default.start_call(pp_group="pipeline", device=torch.device("cpu"), timeout=timedelta(seconds=1),
                       locate=lambda step, op: f"step {step} ({op})", retire=lambda op, tensor: None, uses_links=True)
    with pytest.raises(PipeMeshRuntimeError, match=r"pipeline link F 0->1 .*install\(\).* given no provider of link "
                                                   r"groups: pass p2p_groups="):
        default.post_receive(Op(OpKind.RECV_FORWARD, 0, 0, peer=0), torch.zeros(1), LINK, 0)
