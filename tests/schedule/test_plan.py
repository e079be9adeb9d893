"""RunPlan: the one plan object from flags, planner and plan files to the runtime (schedule/plan.py)."""
import contextlib
import io
import json

import pytest

from megatron_pipemesh.schedule import ScheduleConfig, ScheduleConfigError, lower
from megatron_pipemesh.schedule.lower import LoweringOptions
from megatron_pipemesh.schedule.plan import RunPlan, RunPlanError

CONFIG = ScheduleConfig(2, 2, 8, (6, 2), (4, 4))

# The plan-file examples of README.md, docs/launching.md and docs/sharding.md (plus host placement), and the
# digests the runtime checks for their plans under three sets of Megatron's sync flags, as main computed them
# before the plan became one object: none, --overlap-grad-reduce, and that with --overlap-param-gather.
EXAMPLES = {
    "readme": ("--pp 4 --vpp 2 -m 12 --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 "
               "--dp 2 --device-memory-gb 12", ["a1b6dd6381ed6b21", "0b93e8daba3c7b13", "e4a7b3ea46116186"]),
    "launching": ("--pp 4 --vpp 2 -m 32 --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 "
                  "--micro-batch-size 1 --tp 1 --dp 2 --device-tflops 362 --device-memory-gb 48 --dp-gbps 20 "
                  "--p2p-gbps 20", ["db64f79f32a72740", "fecfb46374d9b6df", "818f6c5aebb51586"]),
    "sharding": ("--pp 4 --vpp 2 -m 16 --dp 4 --num-layers 32 --hidden-size 4096 --num-attention-heads 32 "
                 "--memory-budget-gb 30 --sharding auto", ["97204a6cb29d447d", "f104f86d7150a13d", "ce6b20f8f99704d4"]),
    "placement-auto": ("--pp 4 --vpp 2 -m 12 --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --dp 2 "
             "--device-memory-gb 12 --activation-placement auto --host-memory-gb 8",
             ["bc8928282d9160de", "c97460761efc9440", "71a9645290d247d9"]),
}
SYNCS = [dict(param_sync=False, grad_sync=False), dict(param_sync=False, grad_sync=True),
         dict(param_sync=True, grad_sync=True)]


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_plan_files_round_trip_byte_identically_with_their_digests(tmp_path, name):
    """`pipemesh plan --output` writes RunPlan.to_json; reading it back gives the same text and the same digests."""
    from megatron_pipemesh.command import main

    flags, digests = EXAMPLES[name]
    path = tmp_path / "plan.json"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["plan", *flags.split(), "--output", str(path)]) == 0
    text = path.read_text()
    plan = RunPlan.from_json(text)
    assert plan.to_json() == text
    assert [plan.lower(**syncs).digest() for syncs in SYNCS] == digests
    if name == "sharding":
        assert len(plan.sharding) == 2 and json.loads(text)["sharding"] == list(plan.sharding)


def test_lowering_is_the_one_rule_for_training_and_evaluation():
    """Training lowers the plan's lookaheads, host placement and sharding with Megatron's sync points; evaluation
    lowers forwards only, without syncs, placement or sharding."""
    plan = RunPlan(CONFIG, {(0, 0, 0): "host", (1, 1, 2): "full"}, ("optim", "optim_grads_params"), recv_lookahead=2,
                   reload_lookahead=3)
    training = plan.lowering(param_sync=True, grad_sync=False)
    assert training == LoweringOptions(recv_lookahead=2, param_sync=True, grad_sync=False, host_placement=((0, 0, 0),),
                                       reload_lookahead=3, sharding=("optim", "optim_grads_params"))
    evaluation = plan.lowering(param_sync=True, grad_sync=True, forward_only=True)
    assert evaluation == LoweringOptions(recv_lookahead=2, param_sync=False, grad_sync=False, forward_only=True,
                                         reload_lookahead=3)
    assert plan.lower(param_sync=True, grad_sync=False).digest() == lower(CONFIG, training).digest()


def test_config_for_a_call():
    """A training call runs the plan's groups (another m is an error naming ramp-up); an evaluation call with another
    batch, and a plan without groups, use Megatron's group size (p where it is out of range)."""
    plan = RunPlan(CONFIG)
    assert plan.config_for(2, 2, 8) is CONFIG
    with pytest.raises(ScheduleConfigError, match="this iteration has 6 micro-batches.*ramp-up"):
        plan.config_for(2, 2, 6)
    assert plan.config_for(2, 2, 6, forward_only=True).forward_groups == (2, 2, 2)
    assert RunPlan().config_for(2, 2, 8, group_size=4).forward_groups == (4, 4)
    assert RunPlan().config_for(2, 2, 8, group_size=9).forward_groups == (2, 2, 2, 2)


def test_placement_is_typed_and_checked():
    """Levers are parsed once (device entries dropped), keys and levels are checked with messages naming them."""
    plan = RunPlan(CONFIG, {(1, 1, 2): "full", (0, 0, 0): "none", (0, 0, 1): "host"})
    assert list(plan.placement) == [(0, 0, 1), (1, 1, 2)]
    assert plan.host_placement == ((0, 0, 1),) and list(plan.recomputed) == [(1, 1, 2)]
    assert plan.placement[(1, 1, 2)].recomputes and plan.placement[(0, 0, 1)].is_host
    assert "1 recomputed and 1 host-placed chunk-micro-batches" in plan.describe()
    assert RunPlan.from_json(plan.to_json()) == plan
    with pytest.raises(RunPlanError, match="unknown placement level.*'disk'"):
        RunPlan(CONFIG, {(0, 0, 0): "disk"})
    with pytest.raises(RunPlanError, match="unknown level 'uniform:2'"):  # stock-only: a chunk is recomputed whole
        RunPlan(CONFIG, {(0, 0, 0): "uniform:2"})
    with pytest.raises(RunPlanError, match=r"\(0, 0\) is not \(pipeline rank, chunk, micro-batch\)"):
        RunPlan(CONFIG, {(0, 0): "full"})
    with pytest.raises(RunPlanError, match=r"entries \[\(2, 0, 0\)\].*outside"):
        RunPlan(CONFIG, {(2, 0, 0): "full"})
    with pytest.raises(RunPlanError, match="3 levels for 2 virtual chunks"):
        RunPlan(CONFIG, sharding=("optim",) * 3)
    with pytest.raises(RunPlanError, match="reload_lookahead 0 must be an integer >= 1"):
        RunPlan(CONFIG, reload_lookahead=0)


def test_plan_files_of_earlier_versions_load_and_bad_ones_are_named():
    """A file without lookaheads, with the placement under its earlier key 'recompute', loads with the defaults and
    is written back under 'placement'; unknown or missing keys are named."""
    entries = [{"rank": 0, "chunk": 1, "microbatch": 3, "level": "selective"}]
    old = {"pp": 2, "vpp": 2, "microbatches": 8, "forward_groups": [6, 2], "backward_groups": [4, 4],
           "recompute": entries, "fits": True}
    plan = RunPlan.from_dict(old)
    assert plan.reload_lookahead == 2 and plan.recv_lookahead == 1 and plan.predicted == {"fits": True}
    assert plan.placement == {(0, 1, 3): "selective"}
    written = plan.to_dict()
    assert "recompute" not in written and written["placement"] == entries
    assert RunPlan.from_dict(written) == plan
    with pytest.raises(RunPlanError, match="both 'placement' and its earlier name 'recompute'"):
        RunPlan.from_dict({**written, "recompute": entries})
    with pytest.raises(RunPlanError, match=r"unknown key\(s\) \['groups'\]"):
        RunPlan.from_dict({**old, "groups": 2})
    with pytest.raises(RunPlanError, match=r"missing key\(s\) \['backward_groups'\]"):
        RunPlan.from_dict({k: v for k, v in old.items() if k != "backward_groups"})
    with pytest.raises(RunPlanError, match="not JSON"):
        RunPlan.from_json("{")
    with pytest.raises(RunPlanError, match="no groups to save"):
        RunPlan().to_dict()


def test_flags_given_groups_auto_and_plan_file_all_make_a_run_plan(tmp_path):
    """Every way of making a plan ends in a RunPlan that the runtime runs as it is."""
    from megatron_pipemesh.integration.flags import check_pipemesh_args
    from tests.integration.test_flags import _args

    given = check_pipemesh_args(_args(forward_groups=[8, 4], backward_groups=[6, 6], pipemesh_recv_lookahead=2))
    assert given.plan == RunPlan(ScheduleConfig(4, 2, 12, (8, 4), (6, 6)), recv_lookahead=2)
    auto = check_pipemesh_args(_args(forward_groups=["auto"], backward_groups=["auto"], pipemesh_memory_budget_gb=1.0,
                                     pipemesh_device_tflops=1.0))
    path = tmp_path / "plan.json"
    path.write_text(auto.plan.to_json())
    loaded = check_pipemesh_args(_args(pipemesh_plan=str(path)))
    assert loaded.plan == auto.plan


def test_host_blocks_travel_in_the_plan_file_and_are_checked():
    """The pinned block sizes per (rank, chunk) round-trip through the plan file; a size that is not a power of two
    (the pool's classes) or a malformed key is refused naming the entry."""
    plan = RunPlan(CONFIG, {(0, 1, 2): "host"}, host_blocks={(0, 1): 1 << 20})
    again = RunPlan.from_json(plan.to_json())
    assert again.host_blocks == {(0, 1): 1 << 20} and again.to_json() == plan.to_json()
    assert "host_blocks" not in RunPlan(CONFIG).to_dict()
    with pytest.raises(RunPlanError, match=r"host block entry \(0, 1\): 1000"):
        RunPlan(CONFIG, host_blocks={(0, 1): 1000})
    with pytest.raises(RunPlanError, match="host block entry"):
        RunPlan(CONFIG, host_blocks={(0, 1, 2): 1 << 20})
