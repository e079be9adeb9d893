"""planning/host_placement.py: the planner with activation placement ('auto': host memory and recomputation chosen jointly; 'device':
no memory lever): offload where the host link hides the copy, recompute where it cannot, respect the
host budget, never be slower than recomputation alone, and the `pipemesh plan` / `simulate` output."""
import json

import pytest
from hypothesis import given, settings, strategies as st

from megatron_pipemesh.command import main
from megatron_pipemesh.planning.costs import GB, OpCosts
from megatron_pipemesh.planning.planner import (NoFeasiblePlan, PlannerOptions, fit_with_placement, fit_with_recompute,
                                                 plan_schedule)
from megatron_pipemesh.schedule import ScheduleConfig

# Breadth-first PP=2 V=2 m=4, F = 1 s, B = 2 s: rank 0 holds 7 chunk-micro-batches of 1e8 bytes at its peak
# (t = 6..7); F0.0's activations wait from t = 1 to t = 19 for B0.0 (see test_simulator_host.py).
CFG = ScheduleConfig.breadth_first(2, 2, 4)
BYTES = 1e8
AUTO = PlannerOptions(activation_placement="auto")


def _costs(copy_s: float, selective_s: float = 0.2, full_s: float = 1.0) -> OpCosts:
    return OpCosts(forward_s=1.0, backward_s=2.0, p2p_s=0.0,
                   activation_bytes={"none": BYTES, "selective": BYTES / 2, "full": BYTES / 10},
                   recompute_s={"none": 0.0, "selective": selective_s, "full": full_s},
                   host_link_gbps=BYTES * 8 / copy_s / 1e9, static_bytes=(0.0, 0.0))


def _levels(plan, rank):
    return sorted(level for (r, _, _), level in plan.placement.items() if r == rank)


def test_tight_budget_offloads_where_recomputation_was_forced():
    """Budget 6.5e8 on rank 0: recompute-only recomputes; auto with a fast link offloads instead, for free."""
    costs = _costs(0.1)
    alone = fit_with_recompute(CFG, costs, 6.5 * BYTES)
    placed = fit_with_recompute(CFG, costs, 6.5 * BYTES, AUTO)
    assert alone.fits and placed.fits
    assert _levels(alone, 0) and HOST not in _levels(alone, 0)
    assert _levels(placed, 0) == [HOST] and placed.recompute_share == 0.0
    bare = fit_with_recompute(CFG, costs, 100 * BYTES)
    assert placed.result.iteration_s == bare.result.iteration_s < alone.result.iteration_s
    assert placed.result.ranks[0].peak_memory_bytes <= 6.5 * BYTES
    assert placed.placement_counts()[0] == {"device": 7, "host": 1, "selective": 0, "full": 0}
    assert placed.to_dict()["peak_host_gb"][0] == pytest.approx(BYTES / GB)


HOST = "host"


def test_slow_link_recomputes_instead():
    """Copies of 10 s would delay B0.0 by 4 s: a 0.2 s recomputation frees the bytes cheaper."""
    placed = fit_with_recompute(CFG, _costs(10.0), 6.5 * BYTES, AUTO)
    assert placed.fits and HOST not in _levels(placed, 0) and _levels(placed, 0)
    assert placed.result.exposed_host_s == 0.0


def test_host_move_is_chosen_when_its_exposed_wait_is_cheaper_than_recomputation():
    """Copies of 5 s reloaded one op ahead (16..21) delay B0.0 (due at 19) by 2 s: cheaper than 3 s of recompute."""
    costs = _costs(5.0, selective_s=3.0, full_s=3.0)
    options = PlannerOptions(activation_placement="auto", reload_lookahead=1)
    placed = fit_with_recompute(CFG, costs, 6.5 * BYTES, options)
    assert placed.fits and _levels(placed, 0) == [HOST] and placed.reload_lookahead == 1
    assert placed.result.ranks[0].exposed_host_s == pytest.approx(2.0)
    alone = fit_with_recompute(CFG, costs, 6.5 * BYTES)
    assert placed.result.iteration_s < alone.result.iteration_s


def test_host_budget_is_respected():
    """No host memory: auto recomputes like recompute-only; one chunk-micro-batch of host memory: one offload."""
    costs = _costs(0.1)
    none = fit_with_recompute(CFG, costs, 5.5 * BYTES, PlannerOptions(activation_placement="auto", host_budget_bytes=0.0))
    assert none.fits and all(r.peak_host_bytes == 0 for r in none.result.ranks)
    one = fit_with_recompute(CFG, costs, 5.5 * BYTES, PlannerOptions(activation_placement="auto", host_budget_bytes=BYTES))
    assert one.fits and max(r.peak_host_bytes for r in one.result.ranks) <= BYTES
    free = fit_with_recompute(CFG, costs, 5.5 * BYTES, AUTO)
    assert free.result.ranks[0].peak_host_bytes >= one.result.ranks[0].peak_host_bytes
    assert free.result.iteration_s <= one.result.iteration_s <= none.result.iteration_s


def test_device_placement_uses_no_lever_and_fails_clearly():
    """'device' keeps everything on the device: over budget the planner says so and names the alternatives."""
    device = PlannerOptions(activation_placement="device")
    plan = fit_with_recompute(CFG, _costs(0.1), 6.5 * BYTES, device)
    assert not plan.fits and not plan.placement
    with pytest.raises(NoFeasiblePlan, match="activation-placement device keeps every activation on the device.*auto"):
        plan_schedule(2, 2, 4, lambda cfg: _costs(0.1), 4.5 * BYTES, device)
    best, _ = plan_schedule(2, 2, 4, lambda cfg: _costs(0.1), 100 * BYTES, device)
    assert best.fits and not best.placement
    with pytest.raises(ValueError, match="activation placement 'host'"):
        PlannerOptions(activation_placement="host")


@settings(max_examples=25, deadline=None)
@given(copy_s=st.sampled_from([0.05, 1.0, 4.0, 12.0]), budget=st.floats(3.0, 7.5), selective_s=st.sampled_from([0.1, 1.5]),
       groups=st.sampled_from([((4,), (4,)), ((2, 2), (2, 2)), ((4,), (2, 2))]), host_budget=st.sampled_from([None, 1.0, 3.0]))
def test_auto_never_slower_than_recompute_only(copy_s, budget, selective_s, groups, host_budget):
    """Whatever the link, budgets and schedule: auto fits whenever recompute-only does, and is at least as fast."""
    config = ScheduleConfig(2, 2, 4, *groups)
    costs = _costs(copy_s, selective_s)
    host = None if host_budget is None else host_budget * BYTES
    alone = fit_with_recompute(config, costs, budget * BYTES)
    placed = fit_with_placement(config, costs, budget * BYTES, PlannerOptions(activation_placement="auto", host_budget_bytes=host))
    if alone.fits:
        assert placed.fits and placed.result.iteration_s <= alone.result.iteration_s + 1e-9
    if placed.fits:
        assert all(r.peak_memory_bytes <= budget * BYTES for r in placed.result.ranks)
        assert host is None or all(r.peak_host_bytes <= host for r in placed.result.ranks)


PLAN = ["--pp", "2", "--vpp", "2", "-m", "4", "--forward-ms", "1000", "--activation-mb", str(BYTES / 1024 ** 2)]


def test_plan_and_simulate_commands_show_the_placement(capsys):
    """`pipemesh plan/simulate --activation-placement auto` print per-rank placement counts and host memory."""
    budget = str(6.5 * BYTES / GB)
    assert main(["plan", *PLAN, "--memory-budget-gb", budget, "--activation-placement", "auto",
                 "--host-link-gbps", str(BYTES * 8 / 0.1 / 1e9)]) == 0
    out = capsys.readouterr().out
    assert "placement per rank (device/host/selective/full)" in out and "host memory GiB per rank" in out
    assert main(["plan", *PLAN, "--memory-budget-gb", budget, "--activation-placement", "auto", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["placement_counts"]) == 2 and "peak_host_gb" in data and data["reload_lookahead"] == 2
    assert main(["simulate", *PLAN, "--forward-groups", "4", "--backward-groups", "4", "--memory-budget-gb", budget,
                 "--activation-placement", "auto", "--host-link-gbps", str(BYTES * 8 / 0.1 / 1e9)]) == 0
    out = capsys.readouterr().out
    assert "given          placement per rank (device/host/selective/full) 7/1/0/0" in out
    assert main(["plan", *PLAN, "--memory-budget-gb", str(4.5 * BYTES / GB), "--activation-placement", "device"]) == 2
    assert "activation-placement device" in capsys.readouterr().err


def test_host_budget_counts_the_pinned_blocks():
    """A chunk-micro-batch's host copy takes a pinned block of its bytes rounded up to a power of two (torch's caching
    host allocator; 1e8 bytes -> 2**27 = 1.34e8): a host budget of 1.2e8 fits its activations but not its block, so
    nothing is offloaded; a budget of exactly one block offloads one; the plan reports both sizes."""
    costs = _costs(0.1)
    block = 1 << 27
    short = fit_with_recompute(CFG, costs, 6.5 * BYTES, PlannerOptions(activation_placement="auto",
                                                                      host_budget_bytes=1.2 * BYTES))
    assert short.fits and HOST not in _levels(short, 0) and _levels(short, 0)
    assert all(r.peak_pinned_bytes == 0 for r in short.result.ranks)
    one = fit_with_recompute(CFG, costs, 6.5 * BYTES,
                             PlannerOptions(activation_placement="auto", host_budget_bytes=block))
    assert one.fits and _levels(one, 0) == [HOST]
    assert one.result.ranks[0].peak_host_bytes == BYTES and one.result.ranks[0].peak_pinned_bytes == block


def test_the_run_plan_carries_the_pinned_block_of_each_host_placed_chunk():
    """The plan tells the runtime the pinned block each host-placed chunk-micro-batch takes, per (rank, chunk), so its
    pool is allocated before the first call: 1e8 bytes of activations -> one 2**27-byte block."""
    one = fit_with_recompute(CFG, _costs(0.1), 6.5 * BYTES,
                             PlannerOptions(activation_placement="auto", host_budget_bytes=1 << 27))
    (rank, chunk, _), = [key for key, level in one.placement.items() if level == HOST]
    assert one.run_plan().host_blocks == {(rank, chunk): 1 << 27}
    assert fit_with_recompute(CFG, _costs(0.1), 100 * BYTES, AUTO).run_plan().host_blocks == {}


def test_the_host_budget_holds_the_runtime_pool_of_blocks_of_several_sizes():
    """The first stage's chunk-micro-batches carry the embedding's activations too, so rank 0 offloads blocks of two
    sizes. The runtime's pool never gives a block back and serves a key only from its own size, so it holds, per
    size, the most blocks held at once -- more than the blocks held together at any one time. The simulator's pinned
    peak (what the host budget limits) is that pool, block for block."""
    from megatron_pipemesh.schedule.host_blocks import pool_blocks, pool_bytes

    config = ScheduleConfig.depth_first(4, 2, 8)
    costs = OpCosts(forward_s=1.0, backward_s=2.0, p2p_s=0.0,
                    activation_bytes={"none": BYTES, "selective": BYTES / 2, "full": BYTES / 10},
                    first_stage_activation_bytes={"none": 0.4 * BYTES, "selective": 0.2 * BYTES, "full": 0.0},
                    recompute_s={"none": 0.0, "selective": 0.5, "full": 1.0}, host_link_gbps=BYTES * 8 / 0.1 / 1e9,
                    static_bytes=(0.0,) * 4)
    plan = fit_with_recompute(config, costs, 4 * BYTES, AUTO)
    run = plan.run_plan()
    assert set(run.host_blocks[(0, c)] for c in range(2)) == {1 << 28, 1 << 27}  # 1.4e8 and 1e8 bytes
    programs = run.lower(param_sync=False, grad_sync=True).programs
    for rank, program in enumerate(programs):
        blocks = pool_blocks(program, {c: size for (r, c), size in run.host_blocks.items() if r == rank})
        assert plan.result.ranks[rank].peak_pinned_bytes == pool_bytes(blocks), rank
    assert plan.result.ranks[0].peak_pinned_bytes == 2 * (1 << 28) + 12 * (1 << 27)
