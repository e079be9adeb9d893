"""`integration/profile_optimizer.py`: Megatron's optimizer measured as the command builds it."""
from tests.integration.conftest import TINY, profile_args_of


def test_the_optimizer_is_measured_as_the_command_builds_it(one_rank, monkeypatch):
    """--use-distributed-optimizer: the step timed is the distributed optimizer's (not a plain optimizer standing in
    for it), over groups of this rank alone, so that its shard is every parameter and it gathers nothing."""
    from megatron.core import optimizer as mcore_optimizer

    from megatron_pipemesh.integration.profile import ProfileSettings
    from megatron_pipemesh.integration.profile_optimizer import optimizer_s_per_param

    built = []
    real = mcore_optimizer.get_megatron_optimizer

    def spy(config, chunks, **kwargs):
        built.append((config, kwargs.get("pg_collection")))
        return real(config, chunks, **kwargs)

    monkeypatch.setattr(mcore_optimizer, "get_megatron_optimizer", spy)
    args = profile_args_of(TINY.split() + ["--use-distributed-optimizer"])
    seconds = optimizer_s_per_param(args, "local", ProfileSettings(warmup=1, repeats=1), False)
    (config, groups), = built
    assert seconds > 0 and config.use_distributed_optimizer
    assert groups is not None and groups.dp.size() == 1
