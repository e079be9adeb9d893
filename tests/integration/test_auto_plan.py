"""Plan files (--pipemesh-plan) with placement levels: integration/auto_plan.py's load_plan."""
import json

import pytest

from megatron_pipemesh.integration.auto_plan import load_plan


def _write(tmp_path, entries, pp=2, vpp=2, m=4):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"pp": pp, "vpp": vpp, "microbatches": m, "forward_groups": [4], "backward_groups": [4],
                                "recompute": [{"rank": r, "chunk": c, "microbatch": j, "level": lv}
                                              for (r, c, j), lv in entries.items()]}))
    return str(path)


def test_plan_file_with_host_levels_loads(tmp_path):
    """'host' entries load next to recompute levels, and the summary counts both."""
    plan = {(0, 0, 0): "host", (1, 1, 3): "host", (0, 1, 2): "full"}
    resolved = load_plan(_write(tmp_path, plan), 2, 2, 4)
    assert resolved.placement == plan
    assert "1 recomputed and 2 host-placed chunk-micro-batches" in resolved.describe()


def test_plan_file_levels_and_keys_checked(tmp_path):
    """Unknown levels and entries outside p, V, m are rejected naming the file."""
    with pytest.raises(ValueError, match="unknown placement level.*'disk'.*host"):
        load_plan(_write(tmp_path, {(0, 0, 0): "disk"}), 2, 2, 4)
    with pytest.raises(ValueError, match=r"entries \[\(2, 0, 0\)\].*outside"):
        load_plan(_write(tmp_path, {(2, 0, 0): "host"}), 2, 2, 4)


def test_a_per_layer_profile_prices_the_start_up_plan_and_one_of_another_model_is_refused(tmp_path):
    """--pipemesh-profile with a pipemesh profile file: the run's request carries it and its costs are the measured
    ones; a profile measured for another hidden size stops the start-up with one line naming it."""
    import dataclasses

    import torch

    from megatron_pipemesh.integration import auto_plan as auto
    from megatron_pipemesh.planning.profile import ComputePoint, Profile, shape_of
    from megatron_pipemesh.planning.request import AUTO
    from megatron_pipemesh.schedule.config import ScheduleConfig
    from tests.integration.test_auto_budget import _args

    args = _args(pipemesh_memory_budget_gb=4.0)
    model = auto.megatron_request(args, auto._flags(args, None), AUTO, 4, 2, 12)[0].model
    device = "cuda" if torch.cuda.is_available() else "cpu"
    point = ComputePoint(1, model.micro_batch_size, 0.05, 0.1, {}, {}, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    path = tmp_path / "profile.json"
    path.write_text(Profile(device_kind=device, shape=shape_of(model, "fp32"), compute=(point,)).to_json())
    args = _args(pipemesh_memory_budget_gb=4.0, pipemesh_profile=str(path))
    request = auto.megatron_request(args, auto._flags(args, None), AUTO, 4, 2, 12)[0]
    assert request.profile is not None and request.measured is None
    assert request.costs_for(ScheduleConfig.depth_first(4, 2, 12)).forward_s == pytest.approx(1 * 0.05)  # 1 layer/stage
    other = Profile(device_kind=device, shape=shape_of(dataclasses.replace(model, hidden_size=512), "fp32"),
                    compute=(point,))
    path.write_text(other.to_json())
    with pytest.raises(ValueError) as refused:
        auto.megatron_request(args, auto._flags(args, None), AUTO, 4, 2, 12)
    assert str(refused.value) == (f"--pipemesh-profile {path} was measured for hidden 512, this command has hidden 256: "
                                  "re-run pipemesh profile with this command")
