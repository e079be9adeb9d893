"""Property tests of the schedule layer: random valid group lists build, lower and validate; the
order follows the contract (design doc section 3); peak memory matches the closed form; and
validation rejects hand-corrupted programs with the offending rank and step."""
import json
import re
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pipemesh.planning.costs import OpCosts
from megatron_pipemesh.planning.simulator import simulate
from megatron_pipemesh.schedule import (B, DeadlockError, F, LoweredSchedule, LoweringOptions, OpKind, ScheduleConfig,
                                        ScheduleError, backward_sequence, compute_program, compute_programs, execute,
                                        forward_sequence, lower, parse_op, validate, warmup)

SETTINGS = settings(max_examples=60, deadline=None)


# ---------------------------------------------------------------------------------------------
# Strategies


def _draw_groups(draw, m, pp, limits=None):
    """A partition of m into parts >= p; with ``limits`` (prefix sums of the forward groups) the
    prefix sums of the result never exceed them (queue non-underflow)."""
    groups, done = [], 0
    while done < m:
        rest = m - done
        cap = rest
        if limits is not None:
            cap = min(cap, (limits[len(groups)] if len(groups) < len(limits) else m) - done)
        # Valid sizes leave either nothing or at least p micro-batches for later groups.
        sizes = [g for g in range(pp, cap + 1) if rest - g == 0 or rest - g >= pp]
        size = draw(st.sampled_from(sizes))
        groups.append(size)
        done += size
    return tuple(groups)


@st.composite
def configs(draw, max_pp=6, min_vpp=1, max_vpp=4):
    """Random valid ScheduleConfig: p 2..6, V 1..4, m p..4p, groups >= p, non-underflowing."""
    pp = draw(st.integers(2, max_pp), label="pp")
    vpp = draw(st.integers(min_vpp, max_vpp), label="vpp")
    m = draw(st.integers(pp, 4 * pp), label="m")
    forward = _draw_groups(draw, m, pp)
    prefix = [sum(forward[:i + 1]) for i in range(len(forward))]
    backward = _draw_groups(draw, m, pp, prefix)
    return ScheduleConfig(pp, vpp, m, forward, backward)


UNIT = OpCosts(forward_s=1.0, backward_s=2.0, p2p_s=0.0,
               activation_bytes={"none": 1.0, "selective": 1.0, "full": 1.0})


# ---------------------------------------------------------------------------------------------
# The contract, restated independently


def contract_sequences(cfg):
    """Forward / backward sequences exactly as section 3 words them."""
    fwd, bwd, start = [], [], 0
    for size in cfg.forward_groups:
        fwd += [F(c, j) for c in range(cfg.vpp) for j in range(start, start + size)]
        start += size
    start = 0
    for size in cfg.backward_groups:
        bwd += [B(c, j) for c in reversed(range(cfg.vpp)) for j in range(start, start + size)]
        start += size
    return fwd, bwd


def merge(fwd, bwd, w):
    steady = len(fwd) - w
    order = fwd[:w]
    for k in range(steady):
        order += [fwd[w + k], bwd[k]]
    return order + bwd[steady:]


def backward_after_forward(order):
    seen = set()
    for op in order:
        if op.kind is OpKind.BACKWARD and F(op.chunk, op.microbatch) not in seen:
            return False
        seen.add(op)
    return True


def contract_order(cfg, rank):
    """W_r = (V-1)*f_1 + 2*(p-r-1) (p-r-1 for V=1), raised until every B follows its F, capped at m*V."""
    fwd, bwd = contract_sequences(cfg)
    base = cfg.pp - rank - 1 if cfg.vpp == 1 else (cfg.vpp - 1) * cfg.forward_groups[0] + 2 * (cfg.pp - rank - 1)
    w = min(base, len(fwd))
    while not backward_after_forward(merge(fwd, bwd, w)):
        w += 1
    return merge(fwd, bwd, w), w


# ---------------------------------------------------------------------------------------------
# Properties of valid configurations


@SETTINGS
@given(configs())
def test_lower_and_validate_succeed(cfg):
    """Every valid config lowers and validates; each rank runs every compute op exactly once, B after F."""
    schedule = lower(cfg)
    timeline = validate(schedule)
    expected = Counter([F(c, j) for c in range(cfg.vpp) for j in range(cfg.microbatches)]
                       + [B(c, j) for c in range(cfg.vpp) for j in range(cfg.microbatches)])
    for rank in range(cfg.pp):
        order = schedule.compute_order(rank)
        assert Counter(order) == expected
        assert all(v == 1 for v in Counter(order).values())
        assert backward_after_forward(order)
        assert [e.op for e in timeline.compute[rank]] == order


@SETTINGS
@given(configs())
def test_order_follows_contract(cfg):
    """compute_program == the section-3 merge of the section-3 sequences with the section-3 warm-up."""
    fwd, bwd = contract_sequences(cfg)
    assert [F(c, j) for c, j in forward_sequence(cfg)] == fwd
    assert [B(c, j) for c, j in backward_sequence(cfg)] == bwd
    for rank in range(cfg.pp):
        order, w = contract_order(cfg, rank)
        assert compute_program(cfg, rank) == order
        assert warmup(cfg, rank) == w



def peak_live_closed_form(config: ScheduleConfig, rank: int) -> int:
    """Peak number of chunk-micro-batches whose activations are alive at once on ``rank``.

    After the warm-up W forwards are alive; each steady step adds one before removing one, so the
    peak is W + 1 when a steady phase exists and m*V otherwise.
    """
    total = config.microbatches * config.vpp
    return min(warmup(config, rank) + 1, total)


@SETTINGS
@given(configs())
def test_simulated_peak_live_equals_closed_form(cfg):
    """Peak live chunk-micro-batches in the simulator (F=1, B=2, free comm) == peak_live_closed_form."""
    result = simulate(cfg, UNIT)
    for rank in range(cfg.pp):
        assert result.ranks[rank].peak_live == peak_live_closed_form(cfg, rank), f"rank {rank}"
        assert result.ranks[rank].peak_activation_bytes == peak_live_closed_form(cfg, rank)


@SETTINGS
@given(configs())
def test_lowered_json_round_trip_and_digest(cfg):
    """to_dict -> JSON -> from_dict restores the programs; the digest is stable and survives the trip."""
    schedule = lower(cfg)
    data = json.loads(json.dumps(schedule.to_dict()))
    back = LoweredSchedule.from_dict(data)
    assert back.config == cfg
    assert back.options == schedule.options
    assert back.programs == schedule.programs
    assert back.digest() == schedule.digest() == lower(cfg).digest()
    assert re.fullmatch(r"[0-9a-f]{16}", schedule.digest())


def test_digest_distinguishes_plans():
    """Different groups or lowering options give different digests."""
    digests = {
        lower(ScheduleConfig.depth_first(4, 2, 12)).digest(),
        lower(ScheduleConfig.breadth_first(4, 2, 12)).digest(),
        lower(ScheduleConfig(4, 2, 12, (8, 4), (6, 6))).digest(),
        lower(ScheduleConfig(4, 2, 12, (8, 4), (6, 6)), LoweringOptions(recv_lookahead=2)).digest(),
    }
    assert len(digests) == 4


@SETTINGS
@given(st.integers(2, 6), st.integers(1, 4), st.integers(0, 12))
def test_breadth_first_runs_chunks_in_order(pp, vpp, extra):
    """Breadth-first: on every rank all F c.* come before any F c+1.*, and all B c+1.* before any B c.*."""
    m = pp + extra
    cfg = ScheduleConfig.breadth_first(pp, vpp, m)
    for rank, order in enumerate(compute_programs(cfg)):
        fchunks = [op.chunk for op in order if op.kind is OpKind.FORWARD]
        bchunks = [op.chunk for op in order if op.kind is OpKind.BACKWARD]
        assert fchunks == sorted(fchunks), f"rank {rank}"
        assert bchunks == sorted(bchunks, reverse=True), f"rank {rank}"
        mbs = [op.microbatch for op in order if op.kind is OpKind.FORWARD and op.chunk == 0]
        assert mbs == list(range(m))


@SETTINGS
@given(configs())
def test_dp_sync_points(cfg):
    """Each chunk's PARAM_SYNC precedes its first F, its GRAD_SYNC follows its last B, once per rank."""
    schedule = lower(cfg)
    for rank, program in enumerate(schedule.programs):
        for chunk in range(cfg.vpp):
            params = [i for i, op in enumerate(program) if op.kind is OpKind.PARAM_SYNC and op.chunk == chunk]
            grads = [i for i, op in enumerate(program) if op.kind is OpKind.GRAD_SYNC and op.chunk == chunk]
            first_f = min(i for i, op in enumerate(program) if op.kind is OpKind.FORWARD and op.chunk == chunk)
            last_b = max(i for i, op in enumerate(program) if op.kind is OpKind.BACKWARD and op.chunk == chunk)
            assert len(params) == 1 and params[0] < first_f
            assert len(grads) == 1 and grads[0] > last_b


# ---------------------------------------------------------------------------------------------
# Validation rejects corrupted programs


BASE_CONFIGS = {
    "depth-first": ScheduleConfig.depth_first(4, 2, 8),
    "elastic": ScheduleConfig(4, 3, 12, (8, 4), (6, 6)),
}


def corrupted(cfg, edit):
    """Lower cfg, apply edit(programs) in place, return the schedule."""
    schedule = lower(cfg)
    programs = [list(p) for p in schedule.programs]
    edit(programs)
    return LoweredSchedule(cfg, schedule.options, programs)


def _swap_b_before_f(programs):
    p = programs[1]
    i, j = p.index(parse_op("F0.2")), p.index(parse_op("B0.2"))
    p[i], p[j] = p[j], p[i]


def _drop_compute(programs):
    programs[2].remove(parse_op("B1.3"))


def _drop_recv(programs):
    programs[2].remove(parse_op("RECV_F0.1<1"))


def _drop_send(programs):
    programs[1].remove(parse_op("SEND_F0.1>2"))


def _drop_grad_sync(programs):
    programs[3].remove(parse_op("GRAD_SYNC0"))


def _duplicate_compute(programs):
    p = programs[0]
    p.insert(len(p), parse_op("F1.1"))


def _duplicate_recv(programs):
    p = programs[1]
    i = p.index(parse_op("RECV_F0.3<0"))
    p.insert(i, p[i])


def _duplicate_grad_sync(programs):
    programs[0].append(parse_op("GRAD_SYNC1"))


def _swap_receives_on_link(programs):
    p = programs[1]
    i, j = p.index(parse_op("RECV_F0.0<0")), p.index(parse_op("RECV_F0.1<0"))
    p[i], p[j] = p[j], p[i]


def _recv_after_consumer(programs):
    p = programs[2]
    recv = parse_op("RECV_F0.2<1")
    p.remove(recv)
    p.insert(p.index(parse_op("F0.2")) + 1, recv)


def _wrong_peer(programs):
    p = programs[1]
    p[p.index(parse_op("RECV_F0.2<0"))] = parse_op("RECV_F0.2<3")


def _send_before_producer(programs):
    p = programs[1]
    send = parse_op("SEND_F0.2>2")
    p.remove(send)
    p.insert(p.index(parse_op("F0.2")), send)


def _grad_sync_too_early(programs):
    p = programs[1]
    p.remove(parse_op("GRAD_SYNC1"))
    p.insert(0, parse_op("GRAD_SYNC1"))


def _param_sync_after_forward(programs):
    p = programs[1]
    p.remove(parse_op("PARAM_SYNC1"))
    p.insert(p.index(parse_op("F1.0")) + 1, parse_op("PARAM_SYNC1"))


# (name, edit, rank the error must name, words the message must contain)
CORRUPTIONS = [
    ("b-before-f", _swap_b_before_f, 1, "before its forward"),
    ("drop-compute", _drop_compute, 2, "never run"),
    ("drop-recv", _drop_recv, 2, "never posted"),
    ("drop-send", _drop_send, 2, "link rank 1 -> rank 2"),
    ("drop-grad-sync", _drop_grad_sync, 3, "missing"),
    ("duplicate-compute", _duplicate_compute, 0, "more than once"),
    ("duplicate-recv", _duplicate_recv, 1, "link rank 0 -> rank 1"),
    ("duplicate-grad-sync", _duplicate_grad_sync, 0, "more than once"),
    ("swap-recvs-on-link", _swap_receives_on_link, 1, "link rank 0 -> rank 1"),
    ("recv-after-consumer", _recv_after_consumer, 2, "F0.2"),
    ("wrong-peer", _wrong_peer, 1, "peer 3"),
    ("send-before-producer", _send_before_producer, 1, "before it ran"),
    ("grad-sync-too-early", _grad_sync_too_early, 1, "before the last backward"),
    ("param-sync-after-forward", _param_sync_after_forward, 1, "parameter gather"),
]


@pytest.mark.parametrize("config_name", sorted(BASE_CONFIGS))
@pytest.mark.parametrize("name,edit,rank,words", CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_validate_rejects_corruption(config_name, name, edit, rank, words):
    """A hand-corrupted program raises ScheduleError naming the rank, the step and the problem."""
    schedule = corrupted(BASE_CONFIGS[config_name], edit)
    with pytest.raises(ScheduleError) as info:
        validate(schedule)
    message = str(info.value)
    match = re.search(r"rank (\d+), step (\d+)", message)
    assert match, message
    assert int(match[1]) == rank, message
    assert int(match[2]) < len(schedule.programs[rank])
    assert words in message, message
    assert f"rank {rank}: " in message  # the per-rank order is printed
    assert not isinstance(info.value, DeadlockError)


def test_validate_marks_the_offending_step():
    """The printed order brackets the op at the reported step."""
    schedule = corrupted(BASE_CONFIGS["depth-first"], _swap_b_before_f)
    with pytest.raises(ScheduleError) as info:
        validate(schedule)
    step = int(re.search(r"rank 1, step (\d+)", str(info.value))[1])
    assert f"[{schedule.programs[1][step]}]" in str(info.value)
    assert str(schedule.programs[1][step]) == "B0.2"


def test_validate_rejects_wrong_rank_count():
    """A plan with fewer programs than pipeline ranks is rejected."""
    schedule = lower(BASE_CONFIGS["depth-first"])
    with pytest.raises(ScheduleError, match="4 rank programs"):
        validate(LoweredSchedule(schedule.config, schedule.options, schedule.programs[:3]))


def _drop_param_sync(programs):
    programs[1].remove(parse_op("PARAM_SYNC2"))


def _duplicate_param_sync(programs):
    p = programs[1]
    p.insert(p.index(parse_op("PARAM_SYNC2")), parse_op("PARAM_SYNC2"))


def _drop_all_grad_syncs_on_one_rank(programs):
    programs[1][:] = [op for op in programs[1] if op.kind is not OpKind.GRAD_SYNC]


@pytest.mark.parametrize("edit", [_drop_param_sync, _duplicate_param_sync], ids=["drop", "duplicate"])
def test_validate_rejects_param_sync_corruption(edit):
    """A missing or duplicated PARAM_SYNC of one chunk on one rank is rejected."""
    schedule = corrupted(BASE_CONFIGS["elastic"], edit)
    with pytest.raises(ScheduleError, match=r"rank 1, step \d+"):
        validate(schedule)


def test_validate_rejects_rank_without_grad_sync():
    """A rank whose program lost all GRAD_SYNC ops is rejected when the plan emits gradient syncs."""
    schedule = corrupted(BASE_CONFIGS["elastic"], _drop_all_grad_syncs_on_one_rank)
    assert schedule.options.grad_sync
    with pytest.raises(ScheduleError, match=r"rank 1, step \d+"):
        validate(schedule)


# ---------------------------------------------------------------------------------------------
# Genuine deadlock: consistent links, but a circular wait between rank 0 and rank 1


def _deadlocked_schedule():
    """p=2, V=2, m=2. Rank 1 posts all its receives up front (link order unchanged) and then runs
    F1.0 first, which needs rank 0's F1.0; rank 0's F1.0 needs rank 1's F0.0, which rank 1 only
    runs after F1.0."""
    cfg = ScheduleConfig(2, 2, 2)
    schedule = lower(cfg, LoweringOptions(param_sync=False, grad_sync=False))
    programs = [list(p) for p in schedule.programs]
    rank1 = programs[1]
    recvs = [op for op in rank1 if op.kind in (OpKind.RECV_FORWARD, OpKind.RECV_BACKWARD)]
    rest = [op for op in rank1 if op not in recvs]
    rest.remove(F(1, 0))
    programs[1] = recvs + [F(1, 0)] + rest
    return LoweredSchedule(cfg, schedule.options, programs)


def test_deadlock_detected_by_validate():
    """validate() passes the static checks but the dry run raises DeadlockError naming both ranks."""
    schedule = _deadlocked_schedule()
    with pytest.raises(DeadlockError) as info:
        validate(schedule)
    message = str(info.value)
    assert "deadlock" in message
    assert re.search(r"rank 0, step \d+: F1\.0 waits for its input from rank 1", message), message
    assert re.search(r"rank 1, step \d+: F1\.0 waits for its input from rank 0", message), message
    assert "rank 0: " in message and "rank 1: " in message


def test_deadlock_detected_by_execute():
    """The timeline engine itself raises DeadlockError (a ScheduleError) on the same plan."""
    with pytest.raises(ScheduleError):
        execute(_deadlocked_schedule())


def test_lookahead_zero_and_negative():
    """recv_lookahead=0 still validates; a negative lookahead is rejected."""
    cfg = ScheduleConfig(4, 2, 12, (8, 4), (6, 6))
    validate(lower(cfg, LoweringOptions(recv_lookahead=0)))
    validate(lower(cfg, LoweringOptions(recv_lookahead=3, align_grad_sync=False, align_param_sync=False)))
    with pytest.raises(ValueError):
        lower(cfg, LoweringOptions(recv_lookahead=-1))
