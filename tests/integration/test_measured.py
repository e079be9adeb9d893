"""The measured re-planner inside training (integration/measured.py): what its micro-benchmarks time."""
from types import SimpleNamespace

import torch

from megatron_pipemesh.integration.measured import MeasuredReplanner, Replanning
from megatron_pipemesh.planning.planner import NoFeasiblePlan


class _Group:
    def __init__(self, name: str, size: int):
        self.name, self._size = name, size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


class _Chunk:
    """A DDP chunk as the re-planner sees it: parameters, Megatron's config, a dense and an expert gradient buffer."""

    def __init__(self, numel: int, dense_group, expert_group):
        self.config = SimpleNamespace(sequence_parallel=False, hidden_size=8, pipeline_dtype=torch.float32)
        self.weights = [torch.zeros(numel)]
        self.buffers = [SimpleNamespace(data_parallel_group=dense_group, grad_data=torch.zeros(numel - 8))]
        self.expert_parallel_buffers = [SimpleNamespace(data_parallel_group=expert_group, grad_data=torch.zeros(8))]

    def parameters(self):
        return iter(self.weights)


def test_replan_times_the_groups_megatrons_bucket_groups_reduce_on(monkeypatch, capsys):
    """The all-reduce benchmark runs on each gradient buffer's own group (what Megatron's bucket groups reduce on:
    the distributed-optimizer instance, the expert data-parallel group), with that buffer's elements, for the largest
    chunk -- never on ``get_data_parallel_group()``, which spans every instance and no expert split."""
    import torch.distributed as dist

    from megatron_pipemesh.integration import bootstrap
    bootstrap.prepare_megatron_import()
    from megatron.core import parallel_state

    from megatron_pipemesh.integration import parallel_state as pipemesh_groups
    from megatron_pipemesh.runtime import profiler

    whole_dp, instance, experts = _Group("data-parallel", 16), _Group("instance", 8), _Group("expert", 2)
    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 1)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_group", lambda: _Group("pipeline", 1))
    monkeypatch.setattr(parallel_state, "get_data_parallel_group", lambda *a, **k: whole_dp)
    monkeypatch.setattr(pipemesh_groups, "get_pipemesh_p2p_groups", lambda: {})
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 1)
    monkeypatch.setattr(dist, "get_rank", lambda *a: 0)
    monkeypatch.setattr(dist, "all_gather_object", lambda out, mine, *a, **k: out.__setitem__(0, mine))
    timed = []
    monkeypatch.setattr(profiler, "time_allreduce",
                        lambda numel, dtype, device, group, **k: timed.append((group.name, numel)) or 1e-3)
    request = SimpleNamespace(model=SimpleNamespace(grad_bytes=4), cluster=SimpleNamespace(distributed_optimizer=True),
                              budget_bytes=1.0, pp=1, vpp=2, microbatches=4)
    inputs = Replanning(request=request, measure_iters=1)
    replanner = MeasuredReplanner(None, None, None, inputs)

    def no_plan(**changes):
        raise NoFeasiblePlan("kept")

    monkeypatch.setattr(replanner, "_plan", no_plan)
    model = [_Chunk(40, instance, experts), _Chunk(72, instance, experts)]
    replanner._replan({"model": model, "seq_length": 16, "micro_batch_size": 2})
    assert timed == [("instance", 64), ("expert", 8)]
    printed = capsys.readouterr().out
    assert "dp_reduce_s 0.001000" in printed  # (two all-reduces) / 2: a reduce-scatter moves half


def test_the_profile_file_reads_old_and_new_formats_and_keeps_per_layer_measurements(tmp_path):
    """--pipemesh-profile reads a run's flat per-op times (the format before the schema version) and the profile
    format; a run's times saved next to pipemesh profile's per-layer measurements keep those."""
    import json

    from megatron_pipemesh.integration.measured import load_profile, save_run_times
    from megatron_pipemesh.planning.costs import ModelSpec
    from megatron_pipemesh.planning.profile import RUN_TIME_FIELDS, ComputePoint, Profile, shape_of

    times = {key: 0.5 for key in RUN_TIME_FIELDS}
    old = tmp_path / "old.json"
    old.write_text(json.dumps(times))
    assert load_profile(str(old)).run_times == times and not load_profile(str(old)).compute
    model = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32)
    point = ComputePoint(1, 1, 1e-3, 2e-3, {"full": 1e-3}, {"none": 1e5, "full": 1e4}, 1e-4, 1e-4, 1e3, 3e-4, 4e-4, 1e4)
    new = tmp_path / "profile.json"
    new.write_text(Profile(device_kind="cpu", shape=shape_of(model, "fp32"), compute=(point,)).to_json())
    save_run_times(str(new), times, model, "fp32", "cpu")
    loaded = load_profile(str(new))
    assert loaded.compute == (point,) and loaded.run_times == times
    fresh = tmp_path / "fresh.json"
    save_run_times(str(fresh), times, model, "bf16", "cpu")
    assert load_profile(str(fresh)).run_times == times and load_profile(str(fresh)).shape.dtype == "bf16"
