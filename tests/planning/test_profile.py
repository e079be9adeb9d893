"""A measured profile (planning/profile.py): the file round-trips and older files read, a profile of another model is
refused with one line naming the difference, its costs reach the simulator unchanged through costs_for, and a
slower measured layer raises a fixed plan's predicted time by what the simulator's rules say."""
import dataclasses
import json

import pytest

from megatron_pipemesh.planning.clusters import costs_for, flat_cluster
from megatron_pipemesh.planning.costs import ModelSpec, ScheduleCosts
from megatron_pipemesh.planning.profile import (RUN_TIME_FIELDS, ComputePoint, Profile, ProfileError, coverage,
                                                from_dict, load, mismatch, shape_of)
from megatron_pipemesh.planning.simulator import simulate
from megatron_pipemesh.schedule.config import ScheduleConfig
from megatron_pipemesh.schedule.ops import Op, OpKind

MODEL = ModelSpec(num_layers=8, hidden_size=128, num_attention_heads=4, seq_length=128, micro_batch_size=2,
                  vocab_size=384, dtype_bytes=4)


def point(forward_ms=4.0, backward_ms=6.0, mbs=2, embedding_ms=(0.5, 0.25), output_ms=(1.5, 2.5)) -> ComputePoint:
    return ComputePoint(tp=1, micro_batch_size=mbs, layer_forward_s=forward_ms / 1e3, layer_backward_s=backward_ms / 1e3,
                        recompute_extra_s={"selective": 0.001, "full": 0.004},
                        layer_activation_bytes={"none": 4e6, "selective": 2.5e6, "full": 1.5e5},
                        embedding_forward_s=embedding_ms[0] / 1e3, embedding_backward_s=embedding_ms[1] / 1e3,
                        embedding_activation_bytes=1.3e5, output_forward_s=output_ms[0] / 1e3,
                        output_backward_s=output_ms[1] / 1e3, output_activation_bytes=6.6e5)


def profile(*points, model=MODEL, dtype="fp32", optimizer=5e-9) -> Profile:
    return Profile(device_kind="cpu", device_name="test CPU", torch_version="2.13", megatron_core_version="0.19.2",
                   shape=shape_of(model, dtype), compute=points or (point(),), optimizer_s_per_param=optimizer,
                   method={"timer": "wall clock"}, notes=("TP > 1 needs CUDA",))


def cluster(**changes):
    fields = dict(tp=1, dp=1, device_tflops=0.1, dp_gbps=1e6, p2p_gbps=1e6, latency_us=0.0)
    fields.update(changes)
    return flat_cluster(**fields)


def test_the_file_round_trips_and_older_files_read(tmp_path):
    """Written and read back, a profile is the same; a run's flat per-op times (the format before the schema
    version) read as a profile of run times only; another schema version is refused naming both versions."""
    written = dataclasses.replace(profile(point(), point(mbs=1)), run_times=dict.fromkeys(RUN_TIME_FIELDS, 0.5))
    path = tmp_path / "profile.json"
    path.write_text(written.to_json())
    assert load(str(path)) == written
    old = {key: 0.25 for key in RUN_TIME_FIELDS}
    path.write_text(json.dumps(old))
    assert load(str(path)) == Profile(run_times=old)
    with pytest.raises(ProfileError, match="lacks"):
        from_dict({"forward_s": 1.0}, "x.json")
    with pytest.raises(ProfileError, match="schema version 1; this pipemesh reads version 2"):
        from_dict({**written.to_dict(), "schema_version": 1}, "x.json")


def test_a_profile_of_another_model_is_refused_in_one_line():
    """The first difference is named, with both values and what to do."""
    measured = profile(model=dataclasses.replace(MODEL, hidden_size=256))
    assert mismatch(measured, MODEL, "fp32", "cpu", "profile.json") == (
        "profile.json was measured for hidden 256, this command has hidden 128: re-run pipemesh profile with this "
        "command")
    assert mismatch(profile(), MODEL, "bf16", "cpu", "p.json") == (
        "p.json was measured for dtype fp32, this command has dtype bf16: re-run pipemesh profile with this command")
    assert mismatch(profile(), MODEL, "fp32", "cuda", "p.json").startswith("p.json was measured on cpu, this plan is "
                                                                         "for cuda")
    assert mismatch(profile(), dataclasses.replace(MODEL, num_layers=24, micro_batch_size=4), "fp32", None) is None
    assert "holds no per-layer measurements" in mismatch(Profile(run_times={}), MODEL, "fp32", "cpu")


def test_the_profile_costs_reach_the_simulator_unchanged():
    """costs_for with a profile: a chunk's forward/backward are its layers' measured sums, the recompute extras and
    activation bytes per layer times its layers, the embedding/output times and bytes as measured (backward as
    measured, not twice the forward), and each rank's optimizer step its parameters times the measured rate."""
    config = ScheduleConfig.depth_first(2, 2, 4)
    measured = profile()
    p = measured.compute[0]
    costs = costs_for(MODEL, cluster(), config, profile=measured)
    layers = 2  # 8 layers on 2 x 2 stages
    assert costs.forward_s == pytest.approx(layers * p.layer_forward_s)
    assert costs.backward_s == pytest.approx(layers * p.layer_backward_s)
    assert costs.recompute_s["full"] == pytest.approx(layers * 0.004)
    assert costs.activation_bytes["selective"] == pytest.approx(layers * 2.5e6)
    assert costs.first_stage_activation_bytes["none"] == 1.3e5 and costs.last_stage_activation_bytes["full"] == 6.6e5
    analytic = costs_for(MODEL, cluster(), config)
    params = [static / (6 + 12) for static in analytic.static_bytes]  # distributed optimizer at DP 1: 18 B/param
    assert costs.optimizer_s == pytest.approx(tuple(n * 5e-9 for n in params))
    engine = ScheduleCosts(config, costs)
    first, last = Op(OpKind.FORWARD, 0, 0), Op(OpKind.BACKWARD, 1, 0)
    assert engine.compute(0, first) == pytest.approx(layers * p.layer_forward_s + p.embedding_forward_s)
    assert engine.compute(1, last) == pytest.approx(layers * p.layer_backward_s + p.output_backward_s)
    assert engine.compute(1, Op(OpKind.FORWARD, 0, 0)) == pytest.approx(layers * p.layer_forward_s)
    # Where the profile has no measurement (another micro-batch size), the costs stay analytic, and say so.
    other = dataclasses.replace(MODEL, micro_batch_size=4)
    assert costs_for(other, cluster(), config, profile=dataclasses.replace(measured, optimizer_s_per_param=None)) == \
        costs_for(other, cluster(), config)
    found, assumed = coverage(measured, 1, 4)
    assert found == ["optimizer step"] and any("not measured at TP 1, micro-batch 4" in a for a in assumed)


def test_a_slower_measured_layer_raises_the_prediction_by_the_expected_amount():
    """1F1B on p = 2 stages of 4 layers, m = 6 micro-batches, free links, no embedding/output/optimizer time: every
    stage costs f + b per micro-batch and the simulator's iteration is (m + p - 1)(f + b). A profile whose layer is
    1 ms slower forward and 2 ms slower backward adds (m + p - 1) * 4 layers * 3 ms."""
    config = ScheduleConfig.depth_first(2, 1, 6)
    zero = dict(embedding_ms=(0.0, 0.0), output_ms=(0.0, 0.0))
    base = profile(point(**zero), optimizer=0.0)
    slower = profile(point(forward_ms=5.0, backward_ms=8.0, **zero), optimizer=0.0)
    times = [simulate(config, costs_for(MODEL, cluster(), config, profile=p)).iteration_s for p in (base, slower)]
    f, b = 4 * 4e-3, 4 * 6e-3
    assert times[0] == pytest.approx((6 + 2 - 1) * (f + b), rel=1e-6)
    assert times[1] - times[0] == pytest.approx((6 + 2 - 1) * 4 * 3e-3, rel=1e-6)
