"""The upstream fix of the node scope (integration/hierarchical_distopt.py), on a stand-in bucket group."""
from types import SimpleNamespace

from megatron_pipemesh.integration.bootstrap import prepare_megatron_import


def test_grad_sync_starts_once_per_iteration_with_several_instances(monkeypatch):
    """With several distributed-optimizer instances and overlapped reduction, the second start_grad_sync of an
    iteration (finish_grad_sync's, in Megatron's first batch) is a no-op until reset(); one instance is untouched."""
    prepare_megatron_import()
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup as BucketGroup
    from megatron_pipemesh.integration.hierarchical_distopt import start_grad_sync_once_per_iteration

    calls = []
    monkeypatch.setattr(BucketGroup, "start_grad_sync", lambda self, *a, **k: calls.append(self.name))
    monkeypatch.setattr(BucketGroup, "reset", lambda self: None)
    start_grad_sync_once_per_iteration()
    start_grad_sync_once_per_iteration()  # idempotent: wraps once
    config = lambda n: SimpleNamespace(num_distributed_optimizer_instances=n, overlap_grad_reduce=True)  # noqa: E731
    node, single = SimpleNamespace(name="node", ddp_config=config(2)), SimpleNamespace(name="single", ddp_config=config(1))
    for group in (node, node, single, single):
        BucketGroup.start_grad_sync(group)
    assert calls == ["node", "single", "single"]
    BucketGroup.reset(node)
    BucketGroup.start_grad_sync(node)
    assert calls[-1] == "node" and len(calls) == 4
