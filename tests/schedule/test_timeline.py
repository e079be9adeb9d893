"""The timeline engine (the simulator's inner loop): exact results recorded from the reference
engine, its memoized compiled form never reused for edited programs, and the waits it models by hand."""
import hashlib

import pytest

from megatron_pipemesh.schedule import DeadlockError, LoweringOptions, OpKind, ScheduleConfig, lower
from megatron_pipemesh.schedule.timeline import UnitCosts, execute


class _UnevenCosts:
    """Op-dependent durations (binary fractions, so sums are exact): ties and waits of every kind."""

    def compute(self, rank, op):
        return (1.0 if op.kind is OpKind.FORWARD else 2.0) + 0.25 * ((op.chunk * 7 + op.microbatch * 3 + rank) % 5)

    def transfer(self, src, dst, op):
        return 0.5 + 0.125 * ((op.microbatch + src) % 3), 0.0625 * (dst + 1)

    def data_parallel(self, rank, op):
        return 1.5 + 0.5 * op.chunk + (0.75 if op.kind is OpKind.PARAM_SYNC else 0.0)

    def host_copy(self, rank, op):
        return 0.375 + 0.125 * (op.microbatch % 4)


def canonical(timeline) -> str:
    """repr of (compute events per rank, comm events in time order, rank ends): the events, not the order in
    which an engine happened to record its communication."""
    comms = sorted(timeline.comms, key=lambda c: (c.start, c.end, c.src, c.dst, c.lane, str(c.op)))
    return repr((timeline.compute, comms, timeline.rank_end))


# Digest of canonical(timeline) and makespan, recorded with the greedy engine (commit 11df645's events, in
# time order): an engine rewrite must not change a single event.
RECORDED = [
    (ScheduleConfig(4, 2, 8), LoweringOptions(), "a1eb801a754e5b6d", 91.0625),
    (ScheduleConfig(4, 3, 12, (8, 4), (4, 8)), LoweringOptions(), "e4512e9355908893", 167.4375),
    (ScheduleConfig(2, 4, 6, (6,), (6,)), LoweringOptions(param_sync=False, align_grad_sync=False),
     "01c35a68bbe97c88", 103.0625),
    (ScheduleConfig(3, 2, 9, (6, 3), (3, 6)), LoweringOptions(recv_lookahead=2), "4b486bce2874470a", 88.5),
    (ScheduleConfig(2, 2, 8, (6, 2), (4, 4)),
     LoweringOptions(host_placement=((0, 0, 0), (0, 0, 1), (1, 1, 5), (0, 1, 2))), "b9bdce9bfeeb2ed3", 74.9375),
    (ScheduleConfig(4, 1, 8), LoweringOptions(), "04d5359ab848fbc0", 61.8125),
]


@pytest.mark.parametrize("config,options,digest,makespan", RECORDED)
def test_events_equal_the_recorded_reference(config, options, digest, makespan):
    """Any change of event order, start/end times, waits or lanes in the engine's fast loop."""
    for _ in range(2):  # the second run uses the memoized lowering and compiled form
        timeline = execute(lower(config, options), _UnevenCosts())
        text = canonical(timeline)
        assert (hashlib.sha256(text.encode()).hexdigest()[:16], timeline.makespan) == (digest, makespan)


def test_edited_programs_are_recompiled():
    """A stale compiled form reused for a schedule whose programs were edited after lowering."""
    config = ScheduleConfig(2, 2, 4)
    schedule = lower(config)
    execute(schedule)  # compiles and memoizes the lowered programs
    program = schedule.programs[1]
    forward = next(i for i, op in enumerate(program) if op.kind is OpKind.FORWARD and op.chunk == 1)
    schedule.programs[1] = [op for op in program if op.kind in (OpKind.RECV_FORWARD, OpKind.RECV_BACKWARD)] + \
        [program[forward]] + [op for i, op in enumerate(program)
                              if i != forward and op.kind not in (OpKind.RECV_FORWARD, OpKind.RECV_BACKWARD)]
    with pytest.raises(DeadlockError, match="rank 1"):
        execute(schedule)
    assert lower(config).programs[1] == program  # the memoized lowering was not edited either


def test_backward_of_a_zero2_chunk_waits_for_the_previous_groups_reduce():
    """The runtime reduce-scatters a ZeRO-2/3 chunk's gradient buffer after each backward group but the last
    (REDUCE) and, before the chunk's next backward, waits for it (``runtime/sharding.py``: ``restore_grads`` ->
    ``finish_reduce``): the next group accumulates into the same buffer. Hand-computed, p=2 V=1 m=4 with backward
    groups 2 2, F=1, B=2, free p2p, every data-parallel op 5:

    rank 1: F0 1-2 B0 2-4 F1 4-5 B1 5-7, REDUCE 7-12, F2 7-8; B2 waits for the REDUCE: 12-14 (8-10 if it did not),
    F3 14-15 B3 15-17, GRAD_SYNC 17-22.
    rank 0: F0 0-1 F1 1-2 B0 4-6 F2 6-7 B1 7-9, REDUCE 9-14, F3 9-10; B2 (its REDUCE and rank 1's B2 both end at 14)
    14-16, B3 17-19, GRAD_SYNC 19-24: the iteration takes 24, not 20."""
    schedule = lower(ScheduleConfig(2, 1, 4, (2, 2), (2, 2)), LoweringOptions(param_sync=False, sharding=("optim_grads",)))
    timeline = execute(schedule, UnitCosts(dp=5.0))
    spans = [{str(e.op): (e.start, e.end) for e in events} for events in timeline.compute]
    assert spans[1] == {"F0.0": (1, 2), "B0.0": (2, 4), "F0.1": (4, 5), "B0.1": (5, 7), "F0.2": (7, 8),
                        "B0.2": (12, 14), "F0.3": (14, 15), "B0.3": (15, 17)}
    assert spans[0] == {"F0.0": (0, 1), "F0.1": (1, 2), "B0.0": (4, 6), "F0.2": (6, 7), "B0.1": (7, 9), "F0.3": (9, 10),
                        "B0.2": (14, 16), "B0.3": (17, 19)}
    waited = next(e for e in timeline.compute[1] if str(e.op) == "B0.2")
    assert (waited.waited_on, waited.comm_part) == ("reduce", 4.0)
    dp = sorted((c.src, str(c.op), c.start, c.end) for c in timeline.comms if c.lane == "dp")
    assert dp == [(0, "GRAD_SYNC0", 19, 24), (0, "REDUCE0.0", 9, 14), (1, "GRAD_SYNC0", 17, 22), (1, "REDUCE0.0", 7, 12)]
    assert timeline.makespan == 24
    # ZeRO-1 reduces once, in GRAD_SYNC: nothing to wait for before a backward.
    plain = execute(lower(schedule.config, LoweringOptions(param_sync=False, sharding=("optim",))), UnitCosts(dp=5.0))
    assert not any(e.waited_on == "reduce" for events in plain.compute for e in events)


class _SlowSecondStage(UnitCosts):
    """Rank 1 computes three times slower than the others; transfers take 0.5."""

    def compute(self, rank, op):
        return super().compute(rank, op) * (3.0 if rank == 1 else 1.0)


def _start(timeline, rank, text):
    return next(e.start for e in timeline.compute[rank] if str(e.op) == text)


@pytest.mark.parametrize("send_wait, second, third", [("none", 1.0, 2.0), ("posted", 1.0, 4.5), ("delivered", 1.5, 5.0)])
def test_a_send_holds_the_next_compute_as_send_wait_says(send_wait, second, third):
    """Rank 0 runs F0.0 [0, 1], F0.1 [1, 2]; rank 1 posts the receive of F0.1 right before it (lookahead 0), after
    its F0.0 [1.5, 4.5], and the F0.1 transfer runs [4.5, 5]. Megatron's senders wait for the posting (gloo) or the delivery
    (NCCL) before their next compute; PipeMesh's runtime does not wait."""
    config = ScheduleConfig.depth_first(3, 1, 6)  # 1F1B: rank 0 runs F0.0 F0.1 F0.2 before its first backward
    options = LoweringOptions(recv_lookahead=0, send_wait=send_wait)
    timeline = execute(lower(config, options), _SlowSecondStage(1.0, 2.0, transfer=0.5))
    assert (_start(timeline, 0, "F0.1"), _start(timeline, 0, "F0.2")) == (second, third)


def test_megatron_warmup_waits_for_the_wrapped_input_it_posts_early():
    """Interleaved, p = 2, g = 4: rank 0 receives rank 1's first output (its F0.0 [1.5, 2.5], arriving at 3.0) with
    its second forward, as Megatron does, and its warm-up exchange blocks until it has arrived, so its third forward
    starts at 3.0, not 2.0; the receive still reaches F1.0 unchanged."""
    config = ScheduleConfig.uniform(2, 2, 8, 4)
    plain = execute(lower(config, LoweringOptions(recv_lookahead=0)), UnitCosts(1.0, 2.0, transfer=0.5))
    megatron = execute(lower(config, LoweringOptions(megatron_p2p=True)), UnitCosts(1.0, 2.0, transfer=0.5))
    assert _start(plain, 0, "F0.2") == 2.0
    assert _start(megatron, 0, "F0.2") == 3.0
    program = [str(op) for op in lower(config, LoweringOptions(megatron_p2p=True)).programs[0]]
    assert program.index("RECV_F1.0<1") == program.index("F0.1") + 2  # after F0.1 and its send


def test_megatron_sends_waiting_for_their_receiver_do_not_deadlock_interleaved_schedules():
    """Megatron's interleaved g > p schedules run on gloo, whose sends wait for their receiver: with the receives
    posted where Megatron posts them, every such schedule finishes (posted right before their consumers they
    deadlock)."""
    for config in (ScheduleConfig.uniform(2, 2, 8, 4), ScheduleConfig.uniform(4, 2, 12, 6), ScheduleConfig.depth_first(4, 4, 16)):
        execute(lower(config, LoweringOptions(megatron_p2p=True, send_wait="posted")), UnitCosts(1.0, 2.0, transfer=0.5))
    with pytest.raises(DeadlockError, match="waits for its sends to be received"):
        execute(lower(ScheduleConfig.uniform(2, 2, 8, 4), LoweringOptions(recv_lookahead=0, send_wait="posted")),
                UnitCosts(1.0, 2.0, transfer=0.5))


class _OneHost:
    """Links of ranks that share ``cores`` CPU cores of one host (each pipeline rank ``processes`` processes of one
    thread), their transfers on links of their own: the engine's compute routes alone."""

    def __init__(self, ranks, cores, processes=1, shared=True):
        from megatron_pipemesh.planning.network import make_route

        self.capacity = [float(cores)] + [float(processes)] * ranks
        self.routes = [make_route([(0, processes), (1 + r, processes)], self.capacity) for r in range(ranks)]
        self.shared = shared

    def p2p_route(self, src, dst):
        return None

    def dp_route(self, rank):
        return None

    def host_route(self, rank, offload):
        return None

    def embedding_route(self, src, dst):
        return None

    def compute_route(self, rank):
        return self.routes[rank] if self.shared else None

    def new_network(self):
        from megatron_pipemesh.planning.network import FairShareNetwork

        return FairShareNetwork(self.capacity)


class _OnHost(UnitCosts):
    """F = 1, B = 2, free communication, host copies of 1 on the compute stream, on ``links``."""

    host_copies_on_compute = True

    def __init__(self, links, costs=None):
        super().__init__()
        self._links, self._costs = links, costs

    def compute(self, rank, op):
        return self._costs.compute(rank, op) if self._costs else super().compute(rank, op)

    def transfer(self, src, dst, op):
        return self._costs.transfer(src, dst, op) if self._costs else super().transfer(src, dst, op)

    def data_parallel(self, rank, op):
        return self._costs.data_parallel(rank, op) if self._costs else super().data_parallel(rank, op)

    def host_copy(self, rank, op):
        return self._costs.host_copy(rank, op) if self._costs else 1.0

    def links(self):
        return self._links


def _spans(timeline):
    return [{str(e.op): (e.start, e.end) for e in events} for events in timeline.compute]


def test_ranks_on_one_core_share_it_while_both_compute_and_lend_it_in_a_bubble():
    """Two ranks on one core (p=2, V=1, m=2 1F1B, F=1, B=2, free transfers): while both compute each runs at half
    speed, a rank waiting for its input lends the core to the other (which then runs at full speed); the core is never
    idle, so the iteration is the total work, 12 (9 with a core each). Hand-computed:

    0-1 r0 F0 alone; 1-3 r0 F1 and r1 F0 at 0.5; 3-5 r1 B0 alone (r0's B0 waits for it); 5-7 r0 B0 and r1 F1 at 0.5
    (F1 done, B0 half); 7-9 r0 B0 and r1 B1 at 0.5 (B0 done, B1 half); 9-10 r1 B1 alone; 10-12 r0 B1 alone."""
    schedule = lower(ScheduleConfig(2, 1, 2), LoweringOptions(param_sync=False))
    timeline = execute(schedule, _OnHost(_OneHost(2, 1)))
    assert _spans(timeline) == [{"F0.0": (0, 1), "F0.1": (1, 3), "B0.0": (5, 9), "B0.1": (10, 12)},
                                {"F0.0": (1, 3), "B0.0": (3, 5), "F0.1": (5, 7), "B0.1": (7, 10)}]
    assert timeline.makespan == 12
    own = execute(schedule, _OnHost(_OneHost(2, 2)))  # a core each: the plain schedule
    assert _spans(own) == _spans(execute(schedule, UnitCosts())) and own.makespan == 9
    waited = next(e for e in timeline.compute[0] if str(e.op) == "B0.0")
    assert (waited.ready, waited.data_ready, waited.waited_on) == (3, 5, "p2p")


def test_a_process_never_runs_faster_than_one_core_and_replicas_divide_the_cores():
    """Each pipeline rank stands for 2 processes (data-parallel replicas) on 2 cores: alone a stage gets a core per
    process (F0 of rank 0 in 0-1), both stages computing get half a core each (1-3); 4 processes on 1 core: alone
    a stage's processes get half a core each (F0 takes 2)."""
    schedule = lower(ScheduleConfig(2, 1, 2), LoweringOptions(param_sync=False))
    timeline = execute(schedule, _OnHost(_OneHost(2, 2, processes=2)))
    assert _spans(timeline)[0]["F0.0"] == (0, 1) and _spans(timeline)[0]["F0.1"] == (1, 3)
    assert timeline.makespan == 12
    slow = execute(schedule, _OnHost(_OneHost(2, 1, processes=2)))
    assert _spans(slow)[0]["F0.0"] == (0, 2) and slow.makespan == 24


def test_host_copies_on_the_compute_stream_share_the_core_too():
    """A memcpy on the rank's thread is CPU work: rank 0 offloads F0's activations and reloads them (1 each) while
    rank 1 computes, on one core. Hand-computed: 0-1 r0 F0; 1-3 r0 OFFLOAD and r1 F0 at 0.5; 3-5 r0 RELOAD and r1 B0
    at 0.5; 5-7 r0 F1 and the rest of r1's B0; 7-9 r0 B0 and r1 F1; 9-11 the rest of r0's B0 and r1 B1 at 0.5;
    11-12 r1 B1 alone; 12-14 r0 B1: 14, the total work."""
    schedule = lower(ScheduleConfig(2, 1, 2), LoweringOptions(param_sync=False, host_placement=((0, 0, 0),)))
    timeline = execute(schedule, _OnHost(_OneHost(2, 1)))
    assert _spans(timeline) == [{"F0.0": (0, 1), "F0.1": (5, 7), "B0.0": (7, 11), "B0.1": (12, 14)},
                                {"F0.0": (1, 3), "B0.0": (3, 7), "F0.1": (7, 9), "B0.1": (9, 12)}]
    copies = sorted((c.lane, c.start, c.end) for c in timeline.comms if c.lane in ("d2h", "h2d"))
    assert copies == [("d2h", 1, 3), ("h2d", 3, 5)] and timeline.makespan == 14


@pytest.mark.parametrize("config,options,digest,makespan", RECORDED)
def test_links_without_shared_cores_leave_every_event_as_it_was(config, options, digest, makespan):
    """A compute route of None (no shared cores) changes nothing: the recorded events with those links' (own-link)
    transfers, exactly as with no links at all."""
    timeline = execute(lower(config, options), _OnHost(_OneHost(config.pp, 1, shared=False), _UnevenCosts()))
    plain = _UnevenCosts()
    plain.host_copies_on_compute = True
    assert canonical(timeline) == canonical(execute(lower(config, options), plain))
    if not options.host_placement:  # the copies on the compute stream are the only difference to the recording
        assert (hashlib.sha256(canonical(timeline).encode()).hexdigest()[:16], timeline.makespan) == (digest, makespan)


@pytest.mark.parametrize("behind", [False, True])
def test_a_ready_notice_queues_behind_the_receivers_own_transfer_to_the_sender(behind):
    """1F1B, p = 2: rank 1 sends B0.0's gradient to rank 0 and posts the receive of F0.1 from rank 0 at once. With
    one connection per rank pair (gloo under Megatron's batched p2p) the ready notice leaves behind that gradient,
    so the F0.1 transfer starts when the gradient's ends; on a connection of its own it starts with it."""
    config = ScheduleConfig.depth_first(2, 1, 4)
    options = LoweringOptions(megatron_p2p=True, send_wait="posted", notices_behind_data=behind)
    timeline = execute(lower(config, options), UnitCosts(1.0, 2.0, transfer=0.5))
    transfer = {(c.src, str(c.op)): c for c in timeline.comms if c.lane == "p2p"}
    gradient, forward = transfer[1, "B0.0"], transfer[0, "F0.1"]
    assert forward.start == (gradient.end if behind else gradient.start)


def test_a_deadline_counts_each_ranks_tail():
    """execute's tails (what follows a rank's end, the simulator's optimizer step): a schedule whose last rank end plus
    its tail is exactly the deadline runs to its end, event for event; one a tail's worth later is stopped, before
    its clock reaches the deadline (a rank's compute left plus its tail already passes it); a tail per rank is
    required."""
    from megatron_pipemesh.schedule.timeline import DeadlineExceeded

    schedule = lower(ScheduleConfig.breadth_first(4, 2, 8))
    costs = _UnevenCosts()
    free = execute(schedule, costs)
    tails = [0.5 * (rank + 1) for rank in range(4)]
    iteration = max(end + tail for end, tail in zip(free.rank_end, tails))
    again = execute(schedule, costs, deadline=iteration, tails=tails)
    assert canonical(again) == canonical(free)
    with pytest.raises(DeadlineExceeded) as stopped:
        execute(schedule, costs, deadline=iteration - 0.25, tails=tails)
    assert stopped.value.clock > iteration - 0.25
    execute(schedule, costs, deadline=free.makespan)  # without tails the same deadline lets it finish
    with pytest.raises(ValueError, match="one value per pipeline rank"):
        execute(schedule, costs, deadline=iteration, tails=tails[:2])
