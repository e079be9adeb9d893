"""``pipemesh profile`` of a small GPT (``profile``): every piece measured, and on CUDA the bytes each piece keeps,
read from the caching allocator, against the saved-tensor meter's count of the same pieces; the timer's lead hides
the host's Python time behind queued kernels."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from .common import NEEDS_CUDA, REPO

SMALL_GPT = ("--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256 "
             "--micro-batch-size 2 --global-batch-size 8 --train-iters 3 --lr 1e-3 --mock-data --tokenizer-type "
             "NullTokenizer --vocab-size 1024 --bf16 --use-distributed-optimizer "
             "--no-create-attention-mask-in-dataloader")
"""The command profiled: bf16 with the distributed optimizer, as on a GPU cluster, and no loader mask (with one,
full recomputation saves that mask, made before the forward, with each layer's input: the meter counts it, the
allocator's window does not, and the two would differ by the mask rather than by what they are checked for)."""
KEPT_TOLERANCE = 0.10
"""Largest relative difference between a piece's kept bytes read from the allocator and the saved-tensor meter's."""
UNMEASURED = ("recompute level", "micro-batch size", "data loader was not measured",
              "schedule step beyond the pieces was not measured")
"""Notes that say a piece was not measured (the TP and network notes are about what one process cannot measure)."""


def run_profile(out_dir: Path, deadline: float) -> dict:
    """``pipemesh profile`` of :data:`SMALL_GPT` in a child process (it starts a process group of its own); the
    profile as a dict, or the failure."""
    from megatron_pipemesh.planning.profile import load

    left = deadline - time.monotonic()
    if left < 90:
        return {"error": f"only {left:.0f} s of the time budget left"}
    path = out_dir / "gpu_check_profile.json"
    # The check is that every piece is measured, not that its median is stable: a 1 s cap per group of pieces.
    command = [sys.executable, "-m", "megatron_pipemesh", "profile", "--megatron-args", SMALL_GPT, "--output",
               str(path), "--repeats", "2", "--warmup", "1", "--max-seconds", "1", "--quiet"]
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    try:
        done = subprocess.run(command, cwd=str(REPO), env=env, capture_output=True, text=True,
                              timeout=min(left - 30, 400))
    except subprocess.TimeoutExpired:
        return {"error": "pipemesh profile did not finish in the time budget"}
    if done.returncode != 0 or not path.exists():
        return {"error": f"pipemesh profile exited {done.returncode}", "output_tail": done.stderr[-3000:]}
    return {"profile": load(str(path))}


def unmeasured(profile) -> list:
    """What the profile did not measure, in words (empty: every piece)."""
    from megatron_pipemesh.integration.profile_pieces import micro_batch_sizes
    from megatron_pipemesh.planning.costs import STAGE_KINDS, planning_levels
    from megatron_pipemesh.schedule.levers import Lever

    missing = [note for note in profile.notes if note.startswith(UNMEASURED) or " not measured: " in note
               and not note.startswith(("TP > 1", "the network"))]
    levels = [str(level) for level in planning_levels(_planned_model())]
    sizes = [point.micro_batch_size for point in profile.compute]
    if sizes != micro_batch_sizes(_planned_model().micro_batch_size):
        missing.append(f"micro-batch sizes {sizes}")
    for point in profile.compute:
        where = f"micro-batch {point.micro_batch_size}"
        missing += [f"{where}: layer at {level}" for level in levels
                    if not point.layer_activation_bytes.get(level, 0) > 0]
        missing += [f"{where}: recompute extra of {level}" for level in levels
                    if Lever.parse(level).recomputes and level not in point.recompute_extra_s]
        times = {"layer forward": point.layer_forward_s, "layer backward": point.layer_backward_s,
                 "embedding forward": point.embedding_forward_s, "embedding backward": point.embedding_backward_s,
                 "output forward": point.output_forward_s, "output backward": point.output_backward_s,
                 "embedding bytes": point.embedding_activation_bytes, "output bytes": point.output_activation_bytes,
                 "data loader": point.batch_s or 0.0}
        missing += [f"{where}: {name}" for name, value in times.items() if not value > 0]
        missing += [f"{where}: schedule step on a {kind} chunk" for kind in STAGE_KINDS
                    if kind not in point.step_forward_s or kind not in point.step_backward_s]
    if not profile.optimizer_s_per_param or profile.optimizer_s_per_param <= 0:
        missing.append("the optimizer")
    if profile.device_kind == "cuda" and not (profile.host_link_gbps or 0) > 0:
        missing.append("the pinned host link")
    return missing


def _planned_model():
    from megatron_pipemesh.integration.megatron_command import read_command

    return read_command(SMALL_GPT.split(), world_size=1).model


def kept_against_meter(device) -> list:
    """Per micro-batch size and piece of :data:`SMALL_GPT`: the kept bytes the profile reads from the CUDA allocator
    and the saved-tensor meter's count of the same forward, measured in this process (its one-rank world)."""
    import torch

    from megatron_pipemesh.integration import profile_kept
    from megatron_pipemesh.integration.profile import ProfileSettings, command_args
    from megatron_pipemesh.integration.profile_models import gpt, level_args, with_main_grads
    from megatron_pipemesh.integration.profile_pieces import attention_mask, micro_batch_sizes, point
    from megatron_pipemesh.integration.profile_timing import Timer
    from megatron_pipemesh.planning.costs import planning_levels
    from megatron_pipemesh.schedule.levers import DEVICE

    args, planned, run = command_args(SMALL_GPT.split(), device.type == "cuda")
    settings = ProfileSettings(warmup=1, repeats=1, max_seconds=0.0)  # bytes, not times: no repeats for stable medians
    cuda = device.type == "cuda"
    layers = {str(level): gpt(level_args(args, str(level)), run.model.layer_spec, settings, cuda, False, False)
              for level in planning_levels(planned.model)}
    ends, config = gpt(level_args(args, str(DEVICE)), run.model.layer_spec, settings, cuda, True, True)
    exclude = [t for model, _ in layers.values() for t in with_main_grads(model)] + with_main_grads(ends)
    mask = attention_mask(args, device)
    rows = []
    for b in micro_batch_sizes(args.micro_batch_size):
        def measured():
            return point(b, args.seq_length, args.hidden_size, args.padded_vocab_size, layers, ends,
                         config.params_dtype, device, Timer(cuda), settings, exclude, lambda line: None, mask)
        allocator = measured()
        reading = profile_kept.allocated_bytes
        profile_kept.allocated_bytes = lambda: None  # the CPU path: the saved-tensor meter
        try:
            meter = measured()
        finally:
            profile_kept.allocated_bytes = reading
        pieces = {f"layer {level}": (allocator.layer_activation_bytes[level], meter.layer_activation_bytes[level])
                  for level in allocator.layer_activation_bytes}
        pieces["embedding"] = (allocator.embedding_activation_bytes, meter.embedding_activation_bytes)
        pieces["output"] = (allocator.output_activation_bytes, meter.output_activation_bytes)
        for name, (read, counted) in pieces.items():
            rows.append({"micro_batch_size": b, "piece": name, "allocator_bytes": read, "meter_bytes": counted,
                         "ratio": read / counted if counted else None})
    del layers, ends, exclude
    torch.cuda.empty_cache()
    return rows


def timer_hides_host_time(device, host_s: float = 0.005, device_s: float = 0.020) -> dict:
    """The profile's CUDA timer on a block of ``host_s`` of Python before ``device_s`` of device work: as in training,
    the Python hides behind queued work and the block costs the device's time."""
    import torch

    from megatron_pipemesh.integration.profile_timing import Timer, medians

    timer = Timer(True)
    cycles = int(device_s * timer._device_cycles_per_s())

    def block():
        time.sleep(host_s)
        torch.cuda._sleep(cycles)

    seconds = medians({"block": lambda: (timer(block)[1],)}, warmup=2, repeats=5)["block"][0]
    return {"host_s": host_s, "device_s": device_s, "timed_s": seconds,
            "hidden": abs(seconds - device_s) <= 0.1 * device_s}


def check_profile(device, out_dir: Path, deadline: float) -> dict:
    """``pipemesh profile`` of :data:`SMALL_GPT` measures every piece (every micro-batch size, recompute level, end,
    schedule step, the loader, the optimizer, on CUDA the host link); on CUDA each piece's kept bytes from the
    allocator within :data:`KEPT_TOLERANCE` of the saved-tensor meter's, and the timer's lead hiding host time."""
    found = run_profile(out_dir, deadline)
    if "error" in found:
        return {"status": "fail", **found}
    profile = found["profile"]
    missing = unmeasured(profile)
    record = {"command": SMALL_GPT, "device_kind": profile.device_kind, "method": profile.method,
              "notes": list(profile.notes), "unmeasured": missing,
              "micro_batch_sizes": [point.micro_batch_size for point in profile.compute]}
    ok = not missing
    if device.type != "cuda":
        record["kept_bytes_against_meter"] = (f"{NEEDS_CUDA} (on CPU the profile counts the bytes kept with the "
                                              "saved-tensor meter itself; tests/integration/test_profile_kept.py "
                                              "compares the two with the allocator's counters faked)")
        record["timer_lead"] = f"{NEEDS_CUDA} (tests/integration/test_profile_timing.py fakes a CUDA stream)"
        return {**record, "status": "pass" if ok else "fail"}
    rows = kept_against_meter(device)
    within = all(row["ratio"] is not None and abs(row["ratio"] - 1) <= KEPT_TOLERANCE for row in rows)
    lead = timer_hides_host_time(device)
    record.update(kept_bytes_against_meter=rows, kept_within_tolerance=within, timer_lead=lead)
    return {**record, "status": "pass" if ok and within and lead["hidden"] else "fail"}
