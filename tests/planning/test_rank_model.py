"""planning/rank_model.py: one rank's estimate of its host copies, exposed waits and device peak against the
simulator."""
import pytest

from megatron_pipemesh.planning.costs import OpCosts
from megatron_pipemesh.schedule import ScheduleConfig

# Breadth-first PP=2 V=2 m=4, F = 1 s, B = 2 s (as tests/planning/test_host_placement.py).
CFG = ScheduleConfig.breadth_first(2, 2, 4)
BYTES = 1e8
HOST = "host"


def _costs(copy_s: float, selective_s: float = 0.2, full_s: float = 1.0) -> OpCosts:
    return OpCosts(forward_s=1.0, backward_s=2.0, p2p_s=0.0,
                   activation_bytes={"none": BYTES, "selective": BYTES / 2, "full": BYTES / 10},
                   recompute_s={"none": 0.0, "selective": selective_s, "full": full_s},
                   host_link_gbps=BYTES * 8 / copy_s / 1e9, static_bytes=(0.0, 0.0))


def test_rank_model_predicts_the_simulated_peak_and_copies():
    """The planner's per-rank estimate (copy windows, exposed wait, device peak) matches the simulator on
    a plan whose copies hide and on one whose reload is late."""
    from megatron_pipemesh.planning.costs import ScheduleCosts
    from megatron_pipemesh.planning.rank_model import RankModel
    from megatron_pipemesh.planning.simulator import simulate

    for copy_s in (0.1, 10.0):
        costs = _costs(copy_s)
        bare = simulate(CFG, costs)
        model = RankModel(bare, ScheduleCosts(CFG, costs), 0, 2)
        plan = {(0, 0, 0): HOST, (0, 0, 1): HOST, (0, 1, 3): "selective"}
        windows, exposed = model.windows({(0, 0), (0, 1)})
        placed = simulate(CFG, costs, plan)
        copies = {(c.op.kind.value, c.op.chunk, c.op.microbatch): (c.start, c.end) for c in placed.timeline.comms
                  if c.src == 0 and c.lane in ("d2h", "h2d")}
        for key, (off_start, off_end, rel_start, rel_end) in windows.items():
            assert copies[("OFFLOAD",) + key] == (pytest.approx(off_start), pytest.approx(off_end))
            assert copies[("RELOAD",) + key] == (pytest.approx(rel_start), pytest.approx(rel_end))
        if copy_s < 1:  # copies hidden: compute times unchanged, so the estimates are exact
            assert exposed == placed.ranks[0].exposed_host_s == 0.0
            assert model.device_peak(plan, windows)[1] == pytest.approx(placed.ranks[0].peak_memory_bytes)
        else:  # B0.0 waits 4 s; B0.1, shifted by them, 8 s more (the simulator: 7.8 s, B1.3 moves too)
            assert exposed == pytest.approx(12.0) and placed.ranks[0].exposed_host_s == pytest.approx(11.8)


def test_rank_model_exposes_copies_on_the_compute_stream_whole():
    """CPU ranks copy on their compute thread: the planner's estimate exposes both copies of every host-placed
    chunk-micro-batch, as the simulator does, even where a link of their own would hide them (copy 0.1 s)."""
    import dataclasses

    from megatron_pipemesh.planning.costs import ScheduleCosts
    from megatron_pipemesh.planning.rank_model import RankModel
    from megatron_pipemesh.planning.simulator import simulate

    costs = dataclasses.replace(_costs(0.1), host_copies_on_compute=True)
    model = RankModel(simulate(CFG, costs), ScheduleCosts(CFG, costs), 0, 2)
    _, exposed = model.windows({(0, 0), (0, 1)})
    placed = simulate(CFG, costs, {(0, 0, 0): HOST, (0, 0, 1): HOST})
    assert exposed == pytest.approx(4 * 0.1) == pytest.approx(placed.ranks[0].exposed_host_s)
    assert RankModel(simulate(CFG, _costs(0.1)), ScheduleCosts(CFG, _costs(0.1)), 0, 2).windows({(0, 0), (0, 1)})[1] == 0.0
