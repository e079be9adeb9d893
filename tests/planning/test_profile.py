"""A measured profile (planning/profile.py): the file round-trips and older files read, a profile of another model is
refused with one line naming the difference, its costs reach the simulator unchanged through costs_for, and a
slower measured layer raises a fixed plan's predicted time by what the simulator's rules say."""
import dataclasses
import json

import pytest

from megatron_pipemesh.planning.clusters import costs_for, flat_cluster
from megatron_pipemesh.planning.costs import ModelSpec, ScheduleCosts
from megatron_pipemesh.planning.profile import (RUN_TIME_FIELDS, ComputePoint, Profile, ProfileError, at_pace,
                                                coverage, from_dict, load, mismatch, shape_of)
from megatron_pipemesh.planning.profile_network import (ALL_RANKS, BETWEEN_NODES, WITHIN_NODE, LinkPoint,
                                                        NetworkProfile, chosen_rate, link_gbps, network_rates)
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
    with pytest.raises(ProfileError, match="schema version 1; this pipemesh reads versions 2, 3"):
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
    # Where the profile has no measurement at the TP, the costs stay analytic, and say so.
    wide = dataclasses.replace(cluster(), tp=2)
    assert costs_for(MODEL, wide, config, profile=dataclasses.replace(measured, optimizer_s_per_param=None)) == \
        costs_for(MODEL, wide, config)
    found, assumed = coverage(measured, 2, 2)
    assert found == ["optimizer step"] and any("not measured at TP 2, micro-batch 2" in a for a in assumed)


def test_the_data_loaders_time_is_taken_once_per_micro_batch_by_the_first_and_the_last_stage():
    """A measured batch time adds to the forward of the first and the last stage's chunks (interleaved: rank 0's
    chunk 0 and the last rank's last chunk, not the chunks between), once where one stage is both (no pipeline); a
    size not measured takes the nearest size's batch time unscaled; the report names it measured or assumed."""
    measured = profile(dataclasses.replace(point(), batch_s=3e-3), point(mbs=1))
    config = ScheduleConfig.depth_first(2, 2, 4)  # V = 2: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3
    engine = ScheduleCosts(config, costs_for(MODEL, cluster(), config, profile=measured))
    plain = ScheduleCosts(config, costs_for(MODEL, cluster(), config, profile=profile(point(), point(mbs=1))))
    forward = lambda costs, rank, chunk: costs.compute(rank, Op(OpKind.FORWARD, chunk, 0))
    assert [forward(engine, r, c) - forward(plain, r, c) for r, c in ((0, 0), (1, 0), (0, 1), (1, 1))] == \
        pytest.approx([3e-3, 0.0, 0.0, 3e-3])
    assert engine.compute(0, Op(OpKind.BACKWARD, 0, 0)) == plain.compute(0, Op(OpKind.BACKWARD, 0, 0))
    alone = ScheduleConfig.depth_first(1, 1, 4)
    one = lambda p: ScheduleCosts(alone, costs_for(MODEL, cluster(), alone, profile=p)).compute(0, Op(OpKind.FORWARD, 0, 0))
    assert one(measured) - one(profile(point(), point(mbs=1))) == pytest.approx(3e-3)
    assert measured.point_for(1, 8).batch_s == 3e-3
    assert "data loader" in coverage(measured, 1, 2)[0] and "data loader" in coverage(measured, 1, 1)[1]
    assert "data loader (as at micro-batch 2)" in coverage(measured, 1, 8)[0]


def test_the_schedule_steps_own_time_lands_on_each_chunk_by_its_kind():
    """The schedule step's time beyond the pieces adds to every chunk-micro-batch by the kind of its stage: the
    first stage's chunk the 'first' time, the last stage's the 'last', the chunks between the 'middle' (interleaved:
    rank 0's chunk 1 and rank 1's chunk 0), the chunk of a run without pipeline the 'only'; forward and backward
    apart; a size not measured keeps the nearest size's times unscaled; the report names it measured."""
    forward = {"only": 4e-3, "first": 1e-3, "middle": 2e-4, "last": 3e-3}
    backward = {"only": 5e-4, "first": 2e-4, "middle": 1e-4, "last": 1e-3}
    measured = profile(dataclasses.replace(point(), step_forward_s=forward, step_backward_s=backward), point(mbs=1))
    plain_profile = profile(point(), point(mbs=1))
    config = ScheduleConfig.depth_first(2, 2, 4)  # V = 2: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3
    engine = ScheduleCosts(config, costs_for(MODEL, cluster(), config, profile=measured))
    plain = ScheduleCosts(config, costs_for(MODEL, cluster(), config, profile=plain_profile))
    for kind, expected in ((OpKind.FORWARD, forward), (OpKind.BACKWARD, backward)):
        added = [engine.compute(r, Op(kind, c, 0)) - plain.compute(r, Op(kind, c, 0))
                 for r, c in ((0, 0), (1, 0), (0, 1), (1, 1))]
        assert added == pytest.approx([expected["first"], expected["middle"], expected["middle"], expected["last"]])
    alone = ScheduleConfig.depth_first(1, 1, 4)
    one = lambda p, kind: ScheduleCosts(alone, costs_for(MODEL, cluster(), alone, profile=p)).compute(0, Op(kind, 0, 0))
    assert one(measured, OpKind.FORWARD) - one(plain_profile, OpKind.FORWARD) == pytest.approx(forward["only"])
    assert one(measured, OpKind.BACKWARD) - one(plain_profile, OpKind.BACKWARD) == pytest.approx(backward["only"])
    assert measured.point_for(1, 8).step_forward_s == forward
    assert "schedule step" in coverage(measured, 1, 2)[0] and "schedule step" in coverage(measured, 1, 1)[1]
    assert "schedule step (as at micro-batch 2)" in coverage(measured, 1, 8)[0]


def test_a_micro_batch_size_not_measured_is_scaled_from_the_nearest_measured():
    """The advice prices micro-batch sizes the profile may not have measured: at such a size the analytic costs
    (linear in the micro-batch size) calibrated at the nearest size measured (the largest below, else the smallest
    above): that point's times and bytes times the ratio of the sizes; the report says which size it scaled."""
    measured = profile(point(mbs=1, forward_ms=3.0), point(mbs=2))
    config = ScheduleConfig.depth_first(2, 2, 4)
    at = lambda b: costs_for(dataclasses.replace(MODEL, micro_batch_size=b), cluster(), config, profile=measured)
    assert at(2).forward_s == pytest.approx(2 * 4e-3)  # measured at 2
    assert at(1).forward_s == pytest.approx(2 * 3e-3)  # measured at 1
    assert at(8).forward_s == pytest.approx(4 * at(2).forward_s)  # scaled from 2, the largest below
    assert at(8).activation_bytes["selective"] == pytest.approx(4 * at(2).activation_bytes["selective"])
    assert at(8).last_stage_backward_extra_s == pytest.approx(4 * 2.5e-3)
    only_large = profile(point(mbs=4))
    assert only_large.point_for(1, 2).layer_backward_s == pytest.approx(3e-3)  # the smallest above, halved
    assert only_large.point_for(2, 2) is None
    found, assumed = coverage(measured, 1, 8)
    assert "layer forward/backward (scaled from micro-batch 2)" in found and "optimizer step" in found
    assert not any(name.startswith("layer forward/backward") for name in assumed)


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


def network(nic_points=True) -> NetworkProfile:
    """Two nodes of two ranks: a flow between nodes alone, two flows sharing the NIC, one flow inside a node, an
    all-reduce; each at a small and a large message."""
    points = []
    for nbytes, seconds in ((1000, 1e-4), (10 ** 6, 0.1)):
        shapes = [("p2p", BETWEEN_NODES, (0, 1), ((0, 1),), 1.0), ("shared NIC", BETWEEN_NODES, (0, 1, 2, 3),
                                                                     ((0, 1), (2, 3)), 1.6),
                  ("p2p", WITHIN_NODE, (0, 2), ((0, 2),), 0.1), ("all-reduce", ALL_RANKS, (0, 1, 2, 3), (), 1.5)]
        for pattern, scope, ranks, flows, scale in shapes:
            if not nic_points and scope == BETWEEN_NODES:
                continue
            took = seconds * scale
            points.append(LinkPoint(pattern, scope, ranks, flows, nbytes, (took, took * 2, took / 2),
                                    link_gbps(pattern, nbytes, took, len(ranks))))
    nic, nic_from, intra = network_rates(points)
    return NetworkProfile(nic_gbps=nic, nic_from=nic_from, intra_node_gbps=intra, backend="gloo",
                          node_of_rank=(0, 1, 0, 1), sizes={"activation": 1000, "bucket": 10 ** 6}, warmup=1,
                          points=tuple(points))


def test_the_network_round_trips_and_a_file_without_it_reads():
    """A profile with the links measured reads back the same; a file of this version written before the network
    was measured (links holding the host link only) reads with no network."""
    measured = dataclasses.replace(profile(), network=network(), host_link_gbps=200.0)
    assert from_dict(json.loads(measured.to_json())) == measured
    older = profile().to_dict()
    assert older["links"] == {"host_link_gbps": None}
    assert from_dict(older).network is None and from_dict(older) == profile()
    with pytest.raises(ProfileError, match="is not a pipemesh profile"):
        from_dict({**older, "links": {"network": {"nic_gbps": 1.0}}}, "x.json")


def test_the_rates_the_planner_takes_from_the_links():
    """The NIC is the shared flows' sum at the largest message (1e6 bytes in 0.16 s: 0.05 Gbit/s each, 0.1 both),
    else one flow alone (0.08); the intra-node rate one flow inside a node (0.8); collectives report the bus
    bandwidth (all-reduce over 4: 2 * 3/4 of the algorithm bandwidth); without points, None."""
    measured = network()
    assert measured.nic_gbps == pytest.approx(2 * 1e6 * 8 / 0.16 / 1e9)
    assert measured.nic_from == "2 flows sharing a NIC, summed (1000000 bytes each)"
    assert measured.intra_node_gbps == pytest.approx(1e6 * 8 / 0.01 / 1e9)
    alone = [p for p in measured.points if p.pattern != "shared NIC"]
    assert network_rates(alone)[:2] == (pytest.approx(0.08), "one flow between nodes alone (1000000 bytes)")
    assert network_rates([])[0] is None and network(nic_points=False).nic_gbps is None
    assert link_gbps("all-reduce", 10 ** 9, 1.0, 4) == pytest.approx(8 * 2 * 3 / 4)
    assert link_gbps("all-gather", 10 ** 9, 1.0, 2) == pytest.approx(4.0)
    assert measured.points[0].median_s == 1e-4


def test_the_flag_wins_over_the_measurement_and_the_output_says_which():
    """A given flag is used and the measurement named beside it; else the measurement; else the default; else
    missing. The coverage lists the measured link with the measured costs, the others with the assumed."""
    assert chosen_rate("NIC", "--nic-gbps", None, 0.0962, None).describe() == "NIC 0.0962 Gbit/s measured (profile)"
    given = chosen_rate("NIC", "--nic-gbps", 25.0, 0.0962, None)
    assert given.gbps == 25.0 and given.describe() == "NIC 25 Gbit/s (--nic-gbps, given; the profile measured 0.0962)"
    assert chosen_rate("NIC", "--nic-gbps", 25.0, None, None).describe() == "NIC 25 Gbit/s (--nic-gbps, given)"
    default = chosen_rate("intra-node link", "--intra-node-gbps", None, None, 100.0)
    assert (default.gbps, default.source) == (100.0, "default")
    assert chosen_rate("NIC", "--nic-gbps", None, None, None).gbps is None
    rates = [chosen_rate("NIC", "--nic-gbps", None, 0.5, None), default]
    measured, assumed = coverage(profile(), 1, 2, rates)
    assert measured[-1] == "NIC 0.5 Gbit/s measured (profile)"
    assert assumed[-1] == "intra-node link 100 Gbit/s (--intra-node-gbps default, not measured)"
    assert coverage(profile(), 1, 2)[1][-1] == "pipeline and data-parallel links (--nic-gbps)"


def test_spreads_and_the_load_record_round_trip_and_a_version_2_file_still_reads(tmp_path):
    """A point's spreads and the profile's load record are written and read back as they were; a file of the
    previous version (no spreads, no load) reads with both None and says its version."""
    from megatron_pipemesh.planning.profile_quality import LoadRecord, pace_of, spread_of

    spread = {"layer_forward_s": spread_of([0.004, 0.0041, 0.0039, 0.004, 0.0042], True),
              "recompute_extra_s:full": spread_of([0.001, 0.002, 0.0015, 0.001, 0.003], False)}
    load_record = LoadRecord(cores=2, loadavg_before=(1.0, 0.5, 0.2), loadavg_after=(1.5, 0.6, 0.2),
                             others_cores={"layers mbs 2": 0.8})
    pace = pace_of("the block", [(0.0, 0.002), (1.0, 0.0022), (11.0, 0.0021)])
    written = dataclasses.replace(profile(dataclasses.replace(point(), spread=spread)), load=load_record, pace=pace)
    path = tmp_path / "profile.json"
    path.write_text(written.to_json())
    assert load(str(path)) == written
    old = written.to_dict()
    old["schema_version"] = 2
    del old["load"], old["pace"]
    for found in old["compute"]:
        del found["spread"]
    read = from_dict(old, "old.json")
    assert read.load is None and read.pace is None and read.compute[0].spread is None and read.schema_version == 2


def test_a_point_at_another_pace_has_every_time_and_spread_scaled_and_its_bytes_kept():
    """``at_pace``: the layer, recompute extras, ends, data loader and schedule step times and each spread's
    seconds times the factor; activation bytes and the samples' count as they were."""
    from megatron_pipemesh.planning.profile_quality import spread_of

    measured = dataclasses.replace(point(), batch_s=0.002, step_forward_s={"only": 0.001}, step_backward_s={"only": 0.003},
                                   spread={"layer_forward_s": spread_of([0.004, 0.0041, 0.0039], True)})
    found = at_pace(measured, 1.5)
    assert found.layer_forward_s == pytest.approx(0.006) and found.layer_backward_s == pytest.approx(0.009)
    assert found.recompute_extra_s == pytest.approx({"selective": 0.0015, "full": 0.006})
    assert (found.embedding_forward_s, found.output_backward_s, found.batch_s) == pytest.approx((0.00075, 0.00375,
                                                                                                 0.003))
    assert found.step_forward_s == pytest.approx({"only": 0.0015}) and found.step_backward_s["only"] == pytest.approx(
        0.0045)
    assert found.layer_activation_bytes == measured.layer_activation_bytes
    assert found.output_activation_bytes == measured.output_activation_bytes
    spread = found.spread["layer_forward_s"]
    assert (spread.median_s, spread.low_s, spread.high_s) == pytest.approx((0.006, 0.00585, 0.00615))
    assert spread.samples == 3 and spread.stable
