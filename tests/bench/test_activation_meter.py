"""The benchmark's activation meter: log lines, and a real stock run whose measured peaks match the model."""
import sys

from megatron_pipemesh.bench.activation_meter import measure_forward_backward, parse_activation_peaks, peak_per_rank
from megatron_pipemesh.bench.affinity import pin_from_env, stage_cores
from megatron_pipemesh.bench.memory_fair import RunSpec
from megatron_pipemesh.bench.runner import (AutoPlanSettings, ModelSetup, ParallelConfig, bench_gpt, launch_command,
                                            prepare_data, run_env, run_once, training_args)
from megatron_pipemesh.planning.stock import StockRecompute, StockSetting, evaluate


def test_peak_lines_are_parsed_per_rank():
    """Each rank's largest iteration peak; None for a silent rank; None without any line."""
    text = ("[pipemesh-bench] activation peak: rank 1 iteration 1 bytes 10 meter saved-tensors\n"
            "noise\n[pipemesh-bench] activation peak: rank 0 iteration 1 bytes 30 meter saved-tensors\n"
            "[pipemesh-bench] activation peak: rank 1 iteration 2 bytes 12 meter saved-tensors\n")
    assert parse_activation_peaks(text) == {1: [10, 12], 0: [30]}
    assert peak_per_rank(text, 3) == [30, 12, None]
    assert peak_per_rank("nothing", 2) is None


def test_wrapper_measures_saved_tensors_of_a_training_call_only():
    """The wrapper reports the bytes autograd saved inside the call (not parameters), and skips forward-only calls."""
    import torch

    layer = torch.nn.Linear(64, 64)
    lines = []

    def schedule(*, model, forward_only=False, **_):
        x = torch.randn(32, 64)
        y = torch.relu(model[0](x))  # saves x (Linear) and y (ReLU): 2 x 32 x 64 fp32
        if not forward_only:
            y.sum().backward()
        return []

    measured = measure_forward_backward(schedule, lines.append)
    measured(model=[layer], forward_only=True)
    assert lines == []
    measured(model=[layer])
    assert lines == ["[pipemesh-bench] activation peak: rank 0 iteration 1 bytes 16384 meter saved-tensors"]
    assert measure_forward_backward(measured) is measured


def test_state_lines_are_parsed_per_rank():
    """--sharding lines add model state and the peak of state + activations; each rank's largest of each."""
    from megatron_pipemesh.bench.activation_meter import memory_per_rank

    text = ("[pipemesh-bench] activation peak: rank 0 iteration 1 bytes 10 meter saved-tensors state 70 total 95\n"
            "[pipemesh-bench] activation peak: rank 0 iteration 2 bytes 12 meter saved-tensors state 90 total 100\n"
            "[pipemesh-bench] activation peak: rank 1 iteration 1 bytes 12 meter saved-tensors\n")
    assert peak_per_rank(text, 2) == [12, 12]
    assert memory_per_rank(text, 2) == ([90, None], [100, None])
    assert memory_per_rank("[pipemesh-bench] activation peak: rank 0 iteration 1 bytes 1 meter saved-tensors", 1) == \
        (None, None)


def test_wrapper_measures_model_state_with_activations():
    """A distributed-optimizer chunk: the line carries the least model state during the call (a ZeRO-2/3 chunk's
    released buffers) and the peak of state + activations, sampled after each mixed-sharding runtime step (a
    gather while activations are held) and bounded below by the whole buffers the optimizer step holds."""
    import types

    import torch

    from megatron_pipemesh.bench.activation_meter import install_state_sampling
    from megatron_pipemesh.runtime.sharding import ProgramSharding, optimizer_state_bytes

    class Chunk(torch.nn.Module):  # Megatron DDP's shape: ``ddp_config`` and a ``buffers`` list
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(64, 64)
            self.ddp_config = types.SimpleNamespace(use_distributed_optimizer=True)
            self.buffers = [types.SimpleNamespace(param_data=torch.zeros(250), grad_data=torch.zeros(250))]

    class Sharded:  # a ZeRO-2/3 chunk's bytes as the runtime's ChunkSharding reports them
        held = 500

        def held_bytes(self):
            return self.held

    chunk, sharded, lines = Chunk(), Sharded(), []
    install_state_sampling()

    def schedule(*, model, forward_only=False, **_):
        model[0]._pipemesh_sharding = sharded  # the runtime's state, made on the first call, buffers released
        y = torch.relu(model[0].layer(torch.randn(32, 64)))  # 16384 bytes saved
        sharded.held = 3000  # a gather brings whole weights back while the activations are held
        ProgramSharding([], (), {}).begin()  # a runtime step: the meter samples
        y.sum().backward()
        sharded.held = 2500  # whole buffers (and the shard accumulators) back for the optimizer step
        return []

    def idle(*, model, forward_only=False, **_):  # no activations: the step's whole buffers are the peak
        sharded.held = 500
        ProgramSharding([], (), {}).begin()
        sharded.held = 2500
        return []

    measure_forward_backward(schedule, lines.append)(model=[chunk])
    measure_forward_backward(idle, lines.append)(model=[chunk])
    optimizer = optimizer_state_bytes()
    assert lines == [f"[pipemesh-bench] activation peak: rank 0 iteration 1 bytes 16384 meter saved-tensors "
                     f"state {500 + optimizer} total {3000 + 16384 + optimizer}",
                     f"[pipemesh-bench] activation peak: rank 0 iteration 1 bytes 0 meter saved-tensors "
                     f"state {500 + optimizer} total {2500 + optimizer}"]


def test_stage_cores_and_pinning():
    """Ranks of one pipeline stage share its core; pinning without the variable does nothing."""
    assert stage_cores(2, 2, 2) == [0, 0, 1, 1]
    assert stage_cores(4, 1, 2) == [0, 1, 0, 1]
    assert pin_from_env({}) is None


def test_real_stock_run_reports_the_predicted_peak_per_rank(tmp_path):
    """A real 2-rank stock interleaved run (breadth-first, no recomputation): every rank reports its peak each
    iteration, equal to the activation model's prediction within 64 bytes."""
    model = ModelSetup(bench_gpt(hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=1), microbatches=4, vpp=2, warmup_iters=0, measured_iters=2)
    config = ParallelConfig(2)
    setting = StockSetting(2, 2, 4, 4, StockRecompute())
    from megatron_pipemesh.bench.memory_fair import cluster_spec

    predicted = evaluate(setting, model.model_spec(2), cluster_spec(config, AutoPlanSettings(), 1.0)).peak_activation_bytes
    data = prepare_data(str(tmp_path / "data"), python=sys.executable)
    args = training_args(model, config, RunSpec("interleaved-V2-g4", "interleaved", setting), data, str(tmp_path / "run"))
    code, _, _, text = run_once(launch_command(2, args), run_env(1, cores=[0, 1]), str(tmp_path / "log.txt"), 300)
    assert code == 0, text[-3000:]
    peaks = parse_activation_peaks(text)
    assert sorted(peaks) == [0, 1] and all(len(v) == 2 for v in peaks.values())
    for rank in (0, 1):
        assert abs(max(peaks[rank]) - predicted[rank]) <= 64, (peaks, predicted)
