"""Features of Megatron's interleaved schedule that PipeMesh would ignore are refused with a clear error."""
from types import SimpleNamespace

import pytest

from megatron_pipemesh.integration.flags import PipeMeshArgumentError, check_pipemesh_args
from megatron_pipemesh.runtime.unsupported import UNSUPPORTED, check_model_config, unsupported_message
from megatron_pipemesh.runtime.executor import PipeMeshRuntimeError

ENABLED = {"cuda_graph_impl": "transformer_engine", "overlap_moe_expert_parallel_comm": True,
           "fine_grained_activation_offloading": True, "moe_paged_stash": True,
           "num_microbatches_with_partial_activation_checkpoints": 3, "variable_seq_lengths": True}
DEFAULTS = {"cuda_graph_impl": "none", "overlap_moe_expert_parallel_comm": False,
            "fine_grained_activation_offloading": False, "moe_paged_stash": False,
            "num_microbatches_with_partial_activation_checkpoints": None, "variable_seq_lengths": False}


def _args(**changes):
    base = dict(pipeline_schedule="pipemesh", forward_groups=None, backward_groups=None, pipemesh_recv_lookahead=1,
                pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, global_batch_size=16,
                micro_batch_size=2, data_parallel_size=1, distributed_timeout_minutes=10, **DEFAULTS)
    base.update(changes)
    return SimpleNamespace(**base)


def test_table_covers_every_feature_tested():
    """Each refused feature has an entry (so the parametrised cases below cover the whole table)."""
    assert {item.attribute for item in UNSUPPORTED} == set(ENABLED)


@pytest.mark.parametrize("attribute", sorted(ENABLED))
def test_each_feature_is_refused_at_validation_naming_flag_reason_and_fix(attribute):
    """check_pipemesh_args (the validation Megatron's validate_args runs) refuses the feature."""
    item = next(i for i in UNSUPPORTED if i.attribute == attribute)
    with pytest.raises(PipeMeshArgumentError) as info:
        check_pipemesh_args(_args(**{attribute: ENABLED[attribute]}))
    text = str(info.value)
    assert item.flag in text and "not supported by --pipeline-schedule pipemesh" in text and "Instead:" in text


@pytest.mark.parametrize("attribute", sorted(ENABLED))
def test_each_feature_is_refused_on_the_model_config(attribute):
    """Programs that build TransformerConfig themselves get the same refusal at the schedule's first call."""
    with pytest.raises(PipeMeshRuntimeError):
        check_model_config(SimpleNamespace(**{**DEFAULTS, attribute: ENABLED[attribute]}))


def test_defaults_and_the_default_schedule_pass():
    """Megatron's defaults are accepted; with --pipeline-schedule default nothing is refused."""
    assert unsupported_message(_args()) is None
    check_model_config(SimpleNamespace(**DEFAULTS))
    assert check_pipemesh_args(_args(pipeline_schedule="default", cuda_graph_impl="local")).enabled is False
