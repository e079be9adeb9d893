"""The activation meter under host placement against the plan's prediction (``meter_offload``): a pipeline whose
chunk-micro-batches are kept on the device, placed on the host, or recomputed (selective, full) runs with the
runtime's meter on every rank, and each rank's measured device peak and host peak must be what the simulator
predicts for the same lowered plan from the activation model of ``planning/memory.py``."""
from __future__ import annotations

from typing import Dict

from .common import NEEDS_CUDA
from .executor import mixed_placement, run_pipeline
from .meter import METER_TOLERANCE

from megatron_pipemesh.schedule.levers import BASIC_LEVERS  # noqa: E402 (pure)

OFFLOAD_METER_TOLERANCE = METER_TOLERANCE
"""Largest relative difference between a rank's measured peak (device or host) and the plan's. Why the meter check's
10%: the plan's peaks are sums of the same per chunk-micro-batch activation model the ``meter`` check holds to 10% at
every recompute level; host placement moves those bytes between device and host (whole storages, the input with
them, the output staying), it does not change how many there are. A peak that drifts further means the meter or the
offloader's accounting (bytes reported moved but not freed, a reload counted twice) disagrees with what the planner
budgets."""


def simulated(pp: int, vpp: int, microbatches: int, forward_groups, backward_groups, placement: Dict,
              layers_per_stage: int, hidden: int, heads: int, seq: int, mbs: int, vocab: int):
    """The simulator's result for the plan the runtime runs (the same lowering: its host placement, its reload
    lookahead), with every chunk's bytes from ``planning/memory.py`` (fp32): per rank its peaks and the pinned block
    each chunk's host-placed chunk-micro-batches take."""
    from megatron_pipemesh.planning.costs import OpCosts
    from megatron_pipemesh.planning.memory import ActivationShape, chunk_bytes
    from megatron_pipemesh.planning.simulator import simulate
    from megatron_pipemesh.schedule import ScheduleConfig
    from megatron_pipemesh.schedule.plan import RunPlan

    config = ScheduleConfig(pp, vpp, microbatches, tuple(forward_groups), tuple(backward_groups))
    plan = RunPlan(config, placement)
    shape = ActivationShape(seq_length=seq, micro_batch_size=mbs, hidden_size=hidden, num_attention_heads=heads,
                            vocab_size=vocab, ffn_hidden_size=4 * hidden, dtype_bytes=4)
    layers = pp * vpp * layers_per_stage

    def stage_bytes(stage: int, level: str) -> float:
        return chunk_bytes(shape, layers, pp, vpp, stage % pp, stage // pp, level, keep_outputs=True)

    middle = {level: stage_bytes(1, level) for level in BASIC_LEVERS}
    # Compute times only order the ops here (no time is compared); the host copies take microseconds next to them,
    # as they do on the device for these sizes.
    costs = OpCosts(forward_s=1.0, backward_s=2.0, p2p_s=0.0, activation_bytes=middle,
                    first_stage_activation_bytes={lv: stage_bytes(0, lv) - middle[lv] for lv in BASIC_LEVERS},
                    last_stage_activation_bytes={lv: stage_bytes(pp * vpp - 1, lv) - middle[lv] for lv in BASIC_LEVERS},
                    recompute_s=dict.fromkeys(BASIC_LEVERS, 0.0), static_bytes=tuple(0.0 for _ in range(pp)))
    levels = {key: str(level) for key, level in placement.items()}
    return simulate(config, costs, levels, schedule=plan.lower(param_sync=False, grad_sync=False))


def predicted_peaks(*plan_and_shape):
    """Per rank: the simulator's device activation peak, host peak and pinned blocks' peak (:func:`simulated`'s
    arguments)."""
    result = simulated(*plan_and_shape)
    return ([float(r.peak_memory_bytes) for r in result.ranks], [float(r.peak_host_bytes) for r in result.ranks],
            [float(r.peak_pinned_bytes) for r in result.ranks])


def _ratio(measured: float, predicted: float) -> float:
    return measured / predicted if predicted else float("inf") if measured else 1.0


def check_meter_offload(device, pp: int = 2, vpp: int = 2, microbatches: int = 8, forward_groups=(6, 2),
                        backward_groups=(4, 4), layers_per_stage: int = 2, hidden: int = 128, heads: int = 4,
                        seq: int = 64, mbs: int = 2, vocab: int = 512) -> dict:
    """Every placement kind on every rank and chunk (:func:`~.executor.mixed_placement`), the runtime's meter on
    (saved-tensor hooks on CPU, the allocator's counters on CUDA with the ranks taking turns so that each rank's
    readings are its own; the call measured is the second, after one that allocated the one-off workspaces), losses
    and gradients against the whole model as ``executor_host``; then each rank's measured device peak and host peak
    against the simulator's within :data:`OFFLOAD_METER_TOLERANCE`, and the host blocks' peak (the pinned bytes)
    against the plan's."""
    placement = mixed_placement(pp, vpp, microbatches)
    run = run_pipeline(device, "nccl", pp=pp, vpp=vpp, layers_per_stage=layers_per_stage, microbatches=microbatches,
                       forward_groups=forward_groups, backward_groups=backward_groups, mbs=mbs, seq=seq, vocab=vocab,
                       hidden=hidden, placement=placement, measure_memory=True, one_at_a_time=True, warmup=True)
    record = {"tolerance": OFFLOAD_METER_TOLERANCE, "run": run}
    if run["status"] != "pass":
        return {**record, "status": "fail", "reason": "the metered run failed (see run)"}
    device_peaks, host_peaks, block_peaks = predicted_peaks(
        pp, vpp, microbatches, forward_groups, backward_groups, placement, layers_per_stage, hidden, heads, seq, mbs,
        vocab)
    ranks = []
    for rank in range(pp):
        ranks.append({"measured_device_peak": run["peak_activation_bytes"][rank],
                      "predicted_device_peak": device_peaks[rank],
                      "device_ratio": _ratio(run["peak_activation_bytes"][rank], device_peaks[rank]),
                      "measured_host_peak": run["peak_host_bytes"][rank], "predicted_host_peak": host_peaks[rank],
                      "host_ratio": _ratio(run["peak_host_bytes"][rank], host_peaks[rank]),
                      "measured_block_peak": run["peak_block_bytes"][rank], "predicted_block_peak": block_peaks[rank]})
    within = all(abs(r[name] - 1) <= OFFLOAD_METER_TOLERANCE for r in ranks for name in ("device_ratio", "host_ratio"))
    # Both sides round each key's bytes up to the same power-of-two block class; a class boundary between a
    # measured and a predicted key could still split them, so the blocks get the bytes' tolerance doubled.
    blocks = all(abs(_ratio(r["measured_block_peak"], r["predicted_block_peak"]) - 1) <= 2 * OFFLOAD_METER_TOLERANCE
                 for r in ranks)
    hosted = all(r["predicted_host_peak"] > 0 for r in ranks)  # the plan does place something on every rank
    record.update(meter=run["memory_source"], ranks=ranks, peaks_within_tolerance=within, blocks_as_planned=blocks)
    if device.type != "cuda":
        record["cuda_only_parts"] = (f"{NEEDS_CUDA} (the allocator meter with pinned copies on side streams; here "
                                     "the saved-tensor meter and synchronous copies)")
    return {**record, "status": "pass" if within and blocks and hosted else "fail"}
