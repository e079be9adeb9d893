#!/usr/bin/env python
"""What one GPU can check of PipeMesh's GPU path (run through ``scripts/gpu_check.sh``).

Checks (each reports pass/fail/skip with its numbers; the JSON summary goes to ``--out``):

* ``executor_<backend>``: the executor's forward/backward/send/receive path for every pipeline rank
  role (first stage, middle stages, last stage with the loss; p=4, V=2, elastic groups) in one
  process. NCCL cannot put two ranks on one GPU, so the ranks run as threads and each gives the
  executor the runtime's in-process loopback transport (``runtime/loopback.py``: it copies device
  tensors and hands CUDA events to the waiting stream). Losses and every gradient must equal the
  whole model run by Megatron's no-pipelining schedule; under the "nccl" backend every wait must be
  untimed (a timed NCCL wait blocks the host), under "gloo" every wait timed.
* ``meter``: the activation bytes one chunk's forward keeps, measured by the runtime's meter (the
  CUDA caching allocator on GPU, saved-tensor hooks on CPU) against the activation model of
  ``planning/memory.py`` at each recompute level, within 10%.
* ``recompute``: Megatron's recomputation switches (``runtime/recompute.py``) on the device: the
  gradients do not change and the kept bytes fall from none to selective to full.
* ``executor_host``: the executor check again with a placement plan mixing every kind (device, host,
  selective, full recomputation) on every rank role: host placement's OFFLOAD / RELOAD (side
  streams, events, pinned buffer pool on GPU; synchronous copies on CPU) must leave losses and
  gradients unchanged.
* ``host_link`` (GPU only): pinned copy bandwidth each direction (``runtime/host_link.py``, the start-up
  measurement of training), one chunk's activations offloaded and reloaded through the runtime's
  offloader (gradients unchanged), and how much of a copy of those bytes hides behind a chunk's forward
  and backward (hidden fraction, bandwidth while overlapping). Prints the ``--pipemesh-host-link-gbps``
  value the planner should use (the slower direction while overlapping compute).
* ``timing`` (GPU only): CUDA-event op times (``runtime/stats.py``) against synchronised wall time.
* ``bench``: the memory-fair CPU benchmark, ``python -m megatron_pipemesh.bench --quick`` with 8
  ranks (pp4xdp2) when the machine has the cores for 8 ranks without oversubscription.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatron_pipemesh.schedule.levers import BASIC_LEVERS, DEVICE, FULL, HOST, SELECTIVE, Lever  # noqa: E402 (pure)

TOLERANCE = 1e-5
"""Largest relative gradient/loss difference accepted against the whole-model reference (fp32)."""
METER_TOLERANCE = 0.10
BENCH_RANKS = 8


# Set-up -----------------------------------------------------------------------------------------
def setup(cpu_only: bool):
    """World of one process (gloo on CPU, NCCL on GPU) and Megatron's parallel state (everything size 1)."""
    from megatron_pipemesh.integration.bootstrap import prepare_megatron_import

    prepare_megatron_import()
    import torch

    use_cuda = torch.cuda.is_available() and not cpu_only
    if not use_cuda:
        from megatron_pipemesh.integration.cpu_compat import apply_cpu_compat
        apply_cpu_compat()
    import torch.distributed as dist

    if use_cuda:
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = False  # exact fp32, for comparing against the reference
        torch.backends.cudnn.allow_tf32 = False
    store = tempfile.NamedTemporaryFile(prefix="pipemesh-gpu-check-", delete=False).name
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method=f"file://{store}", rank=0, world_size=1)
    from megatron.core import parallel_state, tensor_parallel

    # No gloo side groups on GPU: the box may have no usable network interface, and nothing here needs them.
    parallel_state.initialize_model_parallel(create_gloo_process_groups=not use_cuda)
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    return torch.device("cuda", 0) if use_cuda else torch.device("cpu")


def make_config(num_layers: int, hidden: int = 64, heads: int = 4, **overrides):
    import torch
    from megatron.core.transformer import TransformerConfig

    kw = dict(num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=4 * hidden,
              use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
              hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, masked_softmax_fusion=False,
              persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
              gradient_accumulation_fusion=False)
    kw.update(overrides)
    return TransformerConfig(**kw)


def make_gpt(config, device, vocab: int, seq: int, pre: bool, post: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                     max_sequence_length=seq, pre_process=pre, post_process=post,
                     share_embeddings_and_output_weights=False, position_embedding_type="learned_absolute")
    return model.to(device)


def _init_value(name: str, shape):
    import torch

    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    noise = torch.randn(shape, generator=gen)
    if name.endswith("bias"):
        return 0.01 * noise
    if "norm" in name:
        return 1.0 + 0.05 * noise
    return 0.02 * noise


def _global_name(name: str, first_layer: int) -> str:
    if name.startswith("decoder.layers."):
        index, rest = name[len("decoder.layers."):].split(".", 1)
        return f"decoder.layers.{first_layer + int(index)}.{rest}"
    return name


def set_weights(model, first_layer: int) -> None:
    """Weights from the parameter's name in the whole model, so every split holds the same model."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_init_value(_global_name(name, first_layer), tuple(p.shape)))


def make_batches(count: int, mbs: int, seq: int, vocab: int, device):
    import torch

    batches = []
    for j in range(count):
        gen = torch.Generator().manual_seed(4321 + j)
        text = torch.randint(0, vocab, (mbs, seq + 1), generator=gen)
        mask = (torch.rand((mbs, seq), generator=gen) < 0.9).float()
        batches.append({"tokens": text[:, :-1].contiguous().to(device), "labels": text[:, 1:].contiguous().to(device),
                        "loss_mask": mask.to(device),
                        "attention_mask": (torch.tril(torch.ones((1, 1, seq, seq))) < 0.5).to(device),
                        "position_ids": torch.arange(seq).unsqueeze(0).expand(mbs, seq).contiguous().to(device)})
    return batches


def _loss_func(loss_mask, output):
    import torch

    loss = torch.sum(output.view(-1).float() * loss_mask.view(-1))
    tokens = loss_mask.sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), tokens.view(1).float()])}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return output, functools.partial(_loss_func, batch["loss_mask"])


PLACEMENTS = (DEVICE, HOST, SELECTIVE, FULL)


def mixed_placement(pp: int, vpp: int, microbatches: int) -> Dict:
    """Every placement kind on every rank and chunk, varying with the micro-batch."""
    return {(r, c, j): PLACEMENTS[(r + c + j) % len(PLACEMENTS)]
            for r in range(pp) for c in range(vpp) for j in range(microbatches)}


def run_pipeline(device, backend: str, pp: int = 4, vpp: int = 2, layers_per_stage: int = 1, microbatches: int = 8,
                 forward_groups=(8,), backward_groups=(4, 4), mbs: int = 2, seq: int = 32, vocab: int = 128,
                 placement: Optional[Dict] = None):
    """PipeMesh on ``pp`` thread-ranks vs the whole model (``placement``: the runtime's per (rank, chunk,
    micro-batch) placement plan); returns the check's record."""
    import torch

    from megatron.core.pipeline_parallel import schedules as mcore
    from megatron_pipemesh.integration.cpu_compat import CudaToCpuMode, cpu_compat_active
    from megatron_pipemesh.runtime.executor import PipeMeshOptions, PipeMeshSchedule
    from megatron_pipemesh.runtime.loopback import LoopbackWorld, megatron_in_threads, run_ranks
    from megatron_pipemesh.schedule import ScheduleConfig
    from megatron_pipemesh.schedule.plan import RunPlan

    stages = pp * vpp
    batches = make_batches(microbatches, mbs, seq, vocab, device)
    models = []
    for stage in range(stages):
        model = make_gpt(make_config(layers_per_stage), device, vocab, seq, pre=stage == 0, post=stage == stages - 1)
        set_weights(model, stage * layers_per_stage)
        models.append(model)
    whole = make_gpt(make_config(stages * layers_per_stage), device, vocab, seq, pre=True, post=True)
    set_weights(whole, 0)

    # Reference: Megatron's no-pipelining schedule over the whole model.
    whole.zero_grad()
    reference = mcore.forward_backward_no_pipelining(
        forward_step_func=forward_step, data_iterator=iter(batches), model=[whole], num_microbatches=microbatches,
        seq_length=seq, micro_batch_size=mbs)
    reference_losses = [[float(x) for x in d["lm loss"].view(-1)] for d in reference]
    reference_grads = {n: p.grad.detach().float().cpu() for n, p in whole.named_parameters()}

    world = LoopbackWorld(pp, backend)
    tp_cp = mcore._build_default_pg_collection()
    collection = SimpleNamespace(pp=world.pipeline_group, tp=tp_cp.tp, cp=tp_cp.cp)

    def rank_main(transport):
        if device.type == "cuda":
            torch.cuda.set_device(device)
        chunks = [models[c * pp + transport.rank()] for c in range(vpp)]
        for chunk in chunks:
            chunk.zero_grad()
        schedule = PipeMeshSchedule(
            RunPlan(ScheduleConfig(pp, vpp, microbatches, tuple(forward_groups), tuple(backward_groups)), placement or {}),
            PipeMeshOptions(p2p_timeout_s=60.0),
            transport=transport)
        with CudaToCpuMode() if cpu_compat_active() else contextlib.nullcontext():  # torch modes are per thread
            out = schedule(forward_step_func=forward_step, data_iterator=[iter(batches) for _ in chunks], model=chunks,
                           num_microbatches=microbatches, seq_length=seq, micro_batch_size=mbs, pg_collection=collection)
        return [[float(x) for x in d["lm loss"].view(-1)] for d in out], schedule.last_stats, schedule._offloader

    with megatron_in_threads():
        results, failures = run_ranks(world, rank_main)
    errors = {rank: f"{type(error).__name__}: {error}" for rank, error in failures.items()}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    record = {"pp": pp, "vpp": vpp, "microbatches": microbatches, "forward_groups": list(forward_groups),
              "backward_groups": list(backward_groups), "backend": backend, "device": str(device),
              "waits": len(world.waits)}
    if placement:
        hosted = [sum(1 for (r, _, _), level in placement.items() if r == rank and Lever.parse(level).is_host) for rank in range(pp)]
        record.update(host_placed=hosted,
                      offloaded_bytes=[sum(results[r][1].offloaded_bytes.values()) if r in results else 0 for r in range(pp)],
                      peak_host_bytes=[results[r][1].peak_host_bytes if r in results else 0 for r in range(pp)],
                      host_pool_allocations=[getattr(getattr(results[r][2], "pool", None), "allocations", 0)
                                             if r in results else 0 for r in range(pp)])
    if errors or len(results) != pp:
        return {**record, "status": "fail", "errors": errors or {"threads": "did not finish"}}
    losses = results[pp - 1][0]
    loss_diff = max((abs(a - b) / max(abs(b), 1e-30) for x, y in zip(losses, reference_losses) for a, b in zip(x, y)),
                    default=float("inf"))
    grad_diff = 0.0
    for stage, model in enumerate(models):
        for name, p in model.named_parameters():
            ref = reference_grads[_global_name(name, stage * layers_per_stage)]
            got = p.grad.detach().float().cpu()
            grad_diff = max(grad_diff, float((got - ref).abs().max()) / max(float(ref.abs().max()), 1e-30))
    timed = [args for args in world.waits if args]
    waits_ok = (not timed) if backend == "nccl" else len(timed) == len(world.waits)
    stats = results[0][1].resolve()
    ok = len(losses) == microbatches and loss_diff <= TOLERANCE and grad_diff <= TOLERANCE and waits_ok
    if placement:  # every rank moved bytes for each of its host-placed chunk-micro-batches
        ok = ok and all(n == 0 or (moved > 0 and peak > 0) for n, moved, peak in
                        zip(record["host_placed"], record["offloaded_bytes"], record["peak_host_bytes"]))
    return {**record, "status": "pass" if ok else "fail", "max_rel_loss_diff": loss_diff,
            "max_rel_grad_diff": grad_diff, "timed_waits": len(timed), "waits_as_backend_requires": waits_ok,
            "rank0_time_source": stats.time_source, "rank0_forward_s": stats.forward_s,
            "rank0_backward_s": stats.backward_s}


# Memory and recomputation on one chunk ------------------------------------------------------------
def _chunk_setup(device, pp: int, vpp: int, rank: int, chunk: int, layers_per_stage: int, hidden: int, seq: int,
                 mbs: int, vocab: int):
    stage = chunk * pp + rank
    stages = pp * vpp
    model = make_gpt(make_config(layers_per_stage, hidden=hidden), device, vocab, seq, pre=stage == 0,
                     post=stage == stages - 1)
    set_weights(model, stage * layers_per_stage)
    return model


def check_meter(device, levels=BASIC_LEVERS, hidden: int = 256, heads: int = 4, seq: int = 128,
                mbs: int = 2, vocab: int = 1024, layers_per_stage: int = 2):
    """A middle stage (pipeline rank 1 of 2, chunk 0) under the runtime's meter vs the activation model."""
    import torch

    from megatron_pipemesh.planning.memory import ActivationShape, chunk_bytes
    from megatron_pipemesh.runtime.memory import make_memory_meter
    from megatron_pipemesh.runtime.recompute import recompute_scope

    pp, vpp, rank, chunk = 2, 2, 1, 0
    model = _chunk_setup(device, pp, vpp, rank, chunk, layers_per_stage, hidden, seq, mbs, vocab)
    batch = make_batches(1, mbs, seq, vocab, device)[0]
    shape = ActivationShape(seq_length=seq, micro_batch_size=mbs, hidden_size=hidden, num_attention_heads=heads,
                            vocab_size=vocab, ffn_hidden_size=4 * hidden, dtype_bytes=4)
    rows, ok = [], True
    for level in (DEVICE,) + tuple(levels):  # the first pass warms up kernels and workspaces
        meter = make_memory_meter(device, [*model.parameters(), *model.buffers()])
        meter.begin()
        with recompute_scope(model, level), meter.record("F"):
            received = torch.randn((seq, mbs, hidden), device=device, requires_grad=True)  # what the receive allocates
            model.set_input_tensor(received)
            output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])
        meter.track("F", output)
        measured = meter.saved_bytes["F"] + sum(meter.tracked_bytes.values())
        with recompute_scope(model, level):
            output.backward(torch.ones_like(output))
        meter.release("F")
        predicted = chunk_bytes(shape, pp * vpp * layers_per_stage, pp, vpp, rank, chunk, level, keep_outputs=True)
        rows.append({"level": level, "measured_bytes": int(measured), "model_bytes": float(predicted),
                     "ratio": measured / predicted if predicted else None})
        del output, received
    rows = rows[1:]
    for row in rows:
        ok = ok and row["ratio"] is not None and abs(row["ratio"] - 1) <= METER_TOLERANCE
    return {"status": "pass" if ok else "fail", "meter": "cuda-allocator" if device.type == "cuda" else "saved-tensors",
            "tolerance": METER_TOLERANCE, "levels": rows}


def check_recompute(device, hidden: int = 128, seq: int = 64, mbs: int = 2, vocab: int = 256, layers: int = 2):
    """The whole-model chunk (embedding, layers, loss) at each level: same gradients, fewer kept bytes."""
    import torch

    from megatron_pipemesh.runtime.memory import make_memory_meter
    from megatron_pipemesh.runtime.recompute import recompute_scope

    model = make_gpt(make_config(layers, hidden=hidden), device, vocab, seq, pre=True, post=True)
    set_weights(model, 0)
    batch = make_batches(1, mbs, seq, vocab, device)[0]
    grads, kept = {}, {}
    for level in (DEVICE,) + BASIC_LEVERS:  # first pass: warm-up
        model.zero_grad()
        meter = make_memory_meter(device, [*model.parameters(), *model.buffers()])
        meter.begin()
        with recompute_scope(model, level), meter.record("F"):
            loss = (model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
                    * batch["loss_mask"]).sum()
        kept[level] = int(meter.saved_bytes["F"])
        with recompute_scope(model, level):
            loss.backward()
        grads[level] = {n: p.grad.detach().float().cpu().clone() for n, p in model.named_parameters()}
    diff = max(float((grads[level][n] - g).abs().max()) / max(float(g.abs().max()), 1e-30)
               for level in (SELECTIVE, FULL) for n, g in grads[DEVICE].items())
    ok = diff <= TOLERANCE and kept[DEVICE] > kept[SELECTIVE] > kept[FULL]
    return {"status": "pass" if ok else "fail", "max_rel_grad_diff": diff, "kept_bytes": kept}


def check_host_link(device, hidden: int = 1024, heads: int = 16, seq: int = 1024, mbs: int = 2, layers: int = 2,
                    vocab: int = 1024):
    """A middle-stage chunk on the GPU: its activations offloaded and reloaded by the runtime's offloader
    (gradients unchanged), the pinned host link each direction, and how much of a copy of those bytes
    hides behind the chunk's forward and backward."""
    if device.type != "cuda":
        return {"status": "skip", "reason": "pinned copies on side streams need a GPU (on CPU the executor_host check "
                                            "runs the offloader's synchronous path)"}
    import torch

    from megatron_pipemesh.runtime.host_link import measure_host_link, measure_overlap
    from megatron_pipemesh.runtime.offload import ActivationOffloader

    model = make_gpt(make_config(layers, hidden=hidden, heads=heads), device, vocab, seq, pre=False, post=False)
    set_weights(model, 1)
    batch = make_batches(1, mbs, seq, vocab, device)[0]
    generator = torch.Generator(device=device).manual_seed(7)
    received = torch.randn((seq, mbs, hidden), device=device, generator=generator)
    grad_out = torch.randn((seq, mbs, hidden), device=device, generator=generator) * 1e-3

    def forward(hooks=None):
        x = received.clone().requires_grad_(True)
        model.set_input_tensor(x)
        with torch.autograd.graph.saved_tensors_hooks(*hooks) if hooks else contextlib.nullcontext():
            out = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])
        return x, out

    def grads():
        return {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}

    def step():
        model.zero_grad()
        x, out = forward()
        out.backward(grad_out)

    step()  # warm-up: kernels, workspaces
    step()
    reference = grads()
    offloader = ActivationOffloader(device)
    offloader.begin([*model.parameters(), *model.buffers()])
    model.zero_grad()
    x, out = forward(offloader.hooks("c"))
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    moved = offloader.offload("c", keep=(x, out))
    torch.cuda.synchronize(device)
    # Blocks freed with record_stream return to the allocator once their copy's event is processed, which the
    # next allocation does.
    torch.empty(1, device=device)
    freed = before - torch.cuda.memory_allocated(device) + 512  # the probe's own (rounded) block
    offloader.reload("c")
    offloader.wait("c")
    out.backward(grad_out)
    offloader.release("c")
    diff = max(float((g - reference[n]).abs().max()) / max(float(reference[n].abs().max()), 1e-30)
               for n, g in grads().items())
    link = measure_host_link(device)
    overlaps = {d: measure_overlap(device, step, moved, d) for d in ("d2h", "h2d")}
    planner_gbps = min(o.overlapped_gbps for o in overlaps.values())
    print(f"PipeMesh host link: d2h {link.d2h_gbps:.1f} Gbit/s, h2d {link.h2d_gbps:.1f} Gbit/s (pinned, "
          f"{link.nbytes >> 20} MiB); one chunk's activations ({moved / 2**20:.1f} MiB) next to its forward+backward "
          f"({overlaps['d2h'].compute_ms:.2f} ms): offload {100 * overlaps['d2h'].hidden_fraction:.0f}% hidden at "
          f"{overlaps['d2h'].overlapped_gbps:.1f} Gbit/s, reload {100 * overlaps['h2d'].hidden_fraction:.0f}% hidden at "
          f"{overlaps['h2d'].overlapped_gbps:.1f} Gbit/s; planner: --pipemesh-host-link-gbps {planner_gbps:.0f}",
          file=sys.stderr, flush=True)
    ok = diff <= TOLERANCE and moved > 0 and freed >= 0.9 * moved and planner_gbps > 0
    return {"status": "pass" if ok else "fail", "max_rel_grad_diff": diff, "offloaded_bytes": moved,
            "device_bytes_freed_by_offload": freed, "d2h_gbps": link.d2h_gbps, "h2d_gbps": link.h2d_gbps,
            "overlap": {d: {"compute_ms": o.compute_ms, "copy_ms": o.copy_ms, "together_ms": o.together_ms,
                            "hidden_fraction": o.hidden_fraction, "overlapped_gbps": o.overlapped_gbps}
                        for d, o in overlaps.items()},
            "planner_host_link_gbps": planner_gbps, "pool_allocations": offloader.pool.allocations}


def check_timing(device, repeats: int = 20):
    """CUDA-event times of a compute op (as the executor records them) against synchronised wall time."""
    if device.type != "cuda":
        return {"status": "skip", "reason": "CUDA events need a GPU (on CPU the executor times with perf_counter)"}
    import torch

    from megatron_pipemesh.runtime.stats import OpClock, OpRecord, RuntimeStats

    a = torch.randn((4096, 4096), device=device) / 64  # keeps repeated products finite
    clock, stats = OpClock(device), RuntimeStats(0, 0, "check", False)
    (a @ a).sum().item()  # cuBLAS start-up outside the measured window
    wall_start = time.perf_counter()
    launch = 0.0
    for step in range(repeats):
        start, start_event = clock.mark()
        ready, ready_event = clock.mark()
        b = a
        for _ in range(4):
            b = b @ a
        end, end_event = clock.mark()
        launch += end - ready
        stats.records.append(OpRecord(step, f"F0.{step}", start, ready - start, end - ready,
                                      (start_event, ready_event, end_event)))
    torch.cuda.synchronize(device)
    wall = time.perf_counter() - wall_start
    gpu = stats.resolve().forward_s
    ratio = gpu / wall if wall else 0.0
    return {"status": "pass" if 0.85 <= ratio <= 1.02 else "fail", "event_s": gpu, "wall_s": wall,
            "event_over_wall": ratio, "host_launch_s": launch, "time_source": stats.time_source}


# Benchmark ------------------------------------------------------------------------------------------
def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def check_bench(out_dir: Path, deadline: float, mode: str):
    """``python -m megatron_pipemesh.bench --quick`` with 8 ranks (pp4xdp2), memory-fair when the bench
    offers it, within the time left."""
    cores = _cores()
    if mode == "skip":
        return {"status": "skip", "reason": "--bench skip"}
    if mode == "auto" and cores < BENCH_RANKS:
        return {"status": "skip", "reason": f"{BENCH_RANKS} ranks need {BENCH_RANKS} cores without oversubscription; "
                                            f"this machine has {cores} (use --bench run to force)"}
    from megatron_pipemesh.bench.cli import add_bench_args

    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    options = {opt: action for action in parser._actions for opt in action.option_strings}
    json_path = out_dir / "bench.json"
    command = [sys.executable, "-m", "megatron_pipemesh.bench", "--quick", "--configs", "pp4xdp2"]
    notes = []
    if "--json" in options and options["--json"].nargs != 0:
        command += ["--json", str(json_path)]
    else:
        notes.append("this bench has no '--json FILE'; its summary.json is read from --out-dir")
        command += ["--out-dir", str(out_dir / "bench")]
    if "--pin-cores" in options:
        command.append("--pin-cores")  # one rank per core
    if "--activation-budget-mb" in options:
        command += ["--activation-budget-mb", "auto"]
    else:
        notes.append("this bench has no --activation-budget-mb: plain (not memory-fair) rows")
    rootless = os.geteuid() != 0
    if rootless:
        command.append("--unshaped")
        notes.append("not root: no shaped network namespace (--unshaped)")
    left = deadline - time.monotonic()
    if left < 60:
        return {"status": "skip", "reason": f"only {left:.0f} s of the time budget left", "command": command}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p]), OMP_NUM_THREADS="1")
    start = time.monotonic()
    try:
        proc = subprocess.run(command, cwd=str(REPO), env=env, capture_output=True, text=True, timeout=left)
    except subprocess.TimeoutExpired:
        return {"status": "fail", "reason": f"timed out after {left:.0f} s", "command": command, "notes": notes}
    summary = None
    for path in (json_path, out_dir / "bench" / "summary.json"):
        if path.exists():
            summary = json.loads(path.read_text())
            break
    status = "pass" if proc.returncode == 0 and summary is not None else "fail"
    return {"status": status, "seconds": time.monotonic() - start, "command": command, "notes": notes,
            "returncode": proc.returncode, "summary": summary,
            **({} if status == "pass" else {"output_tail": (proc.stdout + proc.stderr)[-3000:]})}


# Main -------------------------------------------------------------------------------------------------
def _timed(name: str, checks: Dict[str, dict], function: Callable[[], dict]) -> None:
    start = time.monotonic()
    try:
        result = function()
    except Exception as error:  # noqa: BLE001 - a crashing check is a failed check, the others still run
        import traceback
        result = {"status": "fail", "error": f"{type(error).__name__}: {error}",
                  "traceback": traceback.format_exc()[-3000:]}
    result["seconds"] = round(time.monotonic() - start, 3)
    checks[name] = result
    print(f"gpu_check: {name}: {result['status']} ({result['seconds']:.1f} s)", file=sys.stderr, flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-only", action="store_true", help="run every check on the CPU (the GPU checks are skipped)")
    parser.add_argument("--out", default=None, help="JSON summary path (default: $OUT/gpu_check.json, else ./gpu_check.json)")
    parser.add_argument("--bench", choices=("auto", "run", "skip"), default="auto",
                        help=f"the 8-rank CPU benchmark: auto runs it with >= {BENCH_RANKS} cores (default)")
    parser.add_argument("--budget-s", type=float, default=470.0, help="time budget of the whole check (default 470 s)")
    args = parser.parse_args(argv)
    # Only the JSON summary goes to stdout; Megatron's logging and prints go to stderr.
    sys.stdout.flush()
    summary_stream = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    begin = time.monotonic()
    deadline = begin + args.budget_s
    out = Path(args.out or (Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else "gpu_check.json"))
    out.parent.mkdir(parents=True, exist_ok=True)

    device = setup(args.cpu_only)
    import torch

    checks: Dict[str, dict] = {}
    backends = ("nccl",) if device.type == "cuda" else ("nccl", "gloo")  # CPU: both wait policies
    for backend in backends:
        _timed(f"executor_{backend}", checks, lambda backend=backend: run_pipeline(device, backend))
    _timed("executor_host", checks, lambda: run_pipeline(device, backends[0], placement=mixed_placement(4, 2, 8)))
    _timed("host_link", checks, lambda: check_host_link(device))
    _timed("meter", checks, lambda: check_meter(device))
    _timed("recompute", checks, lambda: check_recompute(device))
    _timed("timing", checks, lambda: check_timing(device))
    _timed("bench", checks, lambda: check_bench(out.parent, deadline, args.bench))

    from megatron.core import package_info
    summary = {
        "passed": all(c["status"] in ("pass", "skip") for c in checks.values()),
        "mode": "cpu-only" if args.cpu_only else ("gpu" if device.type == "cuda" else "cpu (no CUDA)"),
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu",
        "cores": _cores(), "torch": torch.__version__, "megatron_core": package_info.__version__,
        "seconds": round(time.monotonic() - begin, 1), "checks": checks,
    }
    text = json.dumps(summary, indent=1, default=str)
    out.write_text(text)
    print(text, file=summary_stream, flush=True)
    print(f"gpu_check: {'PASSED' if summary['passed'] else 'FAILED'}; summary in {out}", file=sys.stderr)
    import torch.distributed as dist
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
