"""`integration/profile.py`: what ``pipemesh profile`` refuses before it measures (the end-to-end runs are in
tests/cli/test_profile.py; each job of the profile in tests/integration/test_profile_<job>.py)."""
import pytest

from tests.integration.conftest import TINY


def test_an_optimizer_megatron_refuses_here_stops_the_profile_before_it_measures(monkeypatch):
    """--use-precision-aware-optimizer needs the distributed optimizer (the command has it) and Transformer Engine's
    FusedAdam (this machine has none): the profile says so before measuring anything, instead of every rank
    failing in the optimizer after rank 0 measured everything else."""
    from megatron_pipemesh.integration.megatron_command import CommandError
    from megatron_pipemesh.integration.profile import ProfileSettings, measure_profile

    lines = []
    with pytest.raises(CommandError, match="--use-precision-aware-optimizer requires FusedAdam from TransformerEngine"):
        measure_profile(TINY.split() + ["--use-distributed-optimizer", "--use-precision-aware-optimizer"],
                        ProfileSettings(warmup=1, repeats=1, max_seconds=0.0), progress=lines.append)
    assert lines == []
