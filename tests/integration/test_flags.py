"""PipeMesh's Megatron flags: parsing and validation against Megatron-validated args (pure)."""
import argparse
from types import SimpleNamespace

import pytest

from megatron_pipemesh.integration.flags import (PipeMeshArgumentError, add_pipemesh_arguments,
                                                  check_pipemesh_args)


def _args(**overrides):
    base = dict(pipeline_schedule="pipemesh", forward_groups=None, backward_groups=None, pipemesh_recv_lookahead=1,
                pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2, global_batch_size=24,
                micro_batch_size=2, data_parallel_size=1, microbatch_group_size_per_vp_stage=None,
                rampup_batch_size=None, distributed_timeout_minutes=10)
    base.update(overrides)
    return SimpleNamespace(**base)


def test_parser_accepts_groups_and_auto():
    parser = add_pipemesh_arguments(argparse.ArgumentParser())
    add_pipemesh_arguments(parser)  # idempotent
    ns = parser.parse_args(["--pipeline-schedule", "pipemesh", "--forward-groups", "8", "4", "--backward-groups", "auto"])
    assert ns.forward_groups == [8, 4] and ns.backward_groups == ["auto"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--forward-groups", "0"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--pipeline-schedule", "fast"])


def test_valid_elastic_groups():
    settings = check_pipemesh_args(_args(forward_groups=[8, 4], backward_groups=[6, 6]))
    assert settings.enabled and settings.config.forward_groups == (8, 4) and settings.config.backward_groups == (6, 6)
    assert settings.timeout_s == 600


def test_default_groups_follow_megatron_group_size():
    settings = check_pipemesh_args(_args(microbatch_group_size_per_vp_stage=6))
    assert settings.forward_groups is None and settings.config.forward_groups == (6, 6)


def test_default_schedule_untouched_and_rejects_groups():
    assert not check_pipemesh_args(_args(pipeline_schedule="default")).enabled
    with pytest.raises(PipeMeshArgumentError, match="--forward-groups given with --pipeline-schedule default"):
        check_pipemesh_args(_args(pipeline_schedule="default", forward_groups=[12]))


@pytest.mark.parametrize("overrides, needle", [
    (dict(forward_groups=[4, 4], backward_groups=[4]), "--forward-groups 4 4 is invalid: the groups sum to 8"),
    (dict(forward_groups=[8, 4], backward_groups=[4]), "--backward-groups 4 is invalid"),
    (dict(forward_groups=[10, 2], backward_groups=[6, 6]), "smaller than the pipeline size p=4"),
    (dict(forward_groups=[4, 4, 4], backward_groups=[4, 8]), "prefix sum"),
    (dict(forward_groups=["auto"]), "--forward-groups auto is not available"),
    (dict(forward_groups=["auto", 4]), "'auto' stands alone"),
    (dict(virtual_pipeline_model_parallel_size=None), "--num-virtual-stages-per-pipeline-rank 2"),
    (dict(pipeline_model_parallel_size=1), "--pipeline-model-parallel-size 1 is invalid"),
    (dict(rampup_batch_size=[8, 8, 100], forward_groups=[12]), "--rampup-batch-size"),
])
def test_invalid_settings_name_flag_rule_and_example(overrides, needle):
    with pytest.raises(PipeMeshArgumentError) as info:
        check_pipemesh_args(_args(**overrides))
    message = str(info.value)
    assert needle in message
    assert "Example" in message or "e.g." in message or "Drop" in message


def test_error_reports_how_m_was_derived():
    with pytest.raises(PipeMeshArgumentError, match=r"--global-batch-size 24 / \(--micro-batch-size 2 x data-parallel size 1\) = 12"):
        check_pipemesh_args(_args(forward_groups=[8, 8], backward_groups=[8, 8]))
