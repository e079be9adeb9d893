"""The executor's own path for every pipeline rank role in one process (``executor_*`` checks): thread-ranks over
the runtime's loopback transport against Megatron's no-pipelining run of the whole model, with every placement kind,
with delayed side-stream copies, and without the caching allocator."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, Optional

from .common import ENTRY, REPO, TOLERANCE, forward_step, global_name, make_batches, make_config, make_gpt, set_weights

from megatron_pipemesh.schedule.levers import DEVICE, FULL, HOST, SELECTIVE, Lever  # noqa: E402 (pure)

DELAY_CYCLES = 2_000_000
"""GPU cycles every side-stream copy waits before it starts in the delayed-copies check (about 1 ms)."""

PLACEMENTS = (DEVICE, HOST, SELECTIVE, FULL)


def mixed_placement(pp: int, vpp: int, microbatches: int) -> Dict:
    """Every placement kind on every rank and chunk, varying with the micro-batch."""
    return {(r, c, j): PLACEMENTS[(r + c + j) % len(PLACEMENTS)]
            for r in range(pp) for c in range(vpp) for j in range(microbatches)}


@contextlib.contextmanager
def one_rank_at_a_time(device):
    """While inside, the thread-ranks take turns: a rank runs alone until it must wait for a peer (a loopback wait
    not matched yet, a collective), then hands the turn on. Yields ``turns(target)``, the rank function to give
    :func:`~megatron_pipemesh.runtime.loopback.run_ranks` (it takes the turn first and gives it back at the end).
    Why: the CUDA meter reads the allocator's counters, which are the device's, not a thread's; taking turns, a
    rank's forward runs with no other rank allocating. On CUDA a rank hands over only once the device finished its
    work and the allocator processed the events of blocks freed under ``record_stream`` (an allocation does that),
    so no rank's still-pending blocks show in another's readings. The schedule is unchanged: a rank only ever
    waited where it now hands over."""
    import threading

    import torch

    from megatron_pipemesh.runtime import loopback

    turn = threading.Lock()

    def hand_over() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.empty(1, device=device)  # processes finished copies' events; freed at once
        turn.release()

    def blocking(method, ready):
        def call(self, *args, **kwargs):
            if ready(self):
                return method(self, *args, **kwargs)
            hand_over()
            try:
                return method(self, *args, **kwargs)
            finally:
                turn.acquire()
        return call

    def turns(target):
        def rank_main(transport):
            turn.acquire()
            try:
                return target(transport)
            finally:
                hand_over()
        return rank_main

    wait, gather = loopback.LoopbackWork.wait, loopback.LoopbackWorld._all_gather
    loopback.LoopbackWork.wait = blocking(wait, lambda work: work._matched.is_set())
    loopback.LoopbackWorld._all_gather = blocking(gather, lambda world: False)
    try:
        yield turns
    finally:
        loopback.LoopbackWork.wait, loopback.LoopbackWorld._all_gather = wait, gather


@contextlib.contextmanager
def delayed_offload_copies(cycles: int):
    """While inside, every host-placement copy (``ActivationOffloader.offload`` / ``reload``) starts after ``cycles``
    GPU cycles of sleep on its side stream (nothing on CPU or with 0 cycles). The streams are the offloader's own
    (``_d2h`` / ``_h2d``): the delay goes where the copies run."""
    if cycles <= 0:
        yield
        return
    import torch

    from megatron_pipemesh.runtime.offload import ActivationOffloader

    def delayed(method, stream_name):
        def call(self, *args, **kwargs):
            stream = getattr(self, stream_name, None)
            if stream is not None:
                with torch.cuda.stream(stream):
                    torch.cuda._sleep(cycles)
            return method(self, *args, **kwargs)
        return call

    offload, reload = ActivationOffloader.offload, ActivationOffloader.reload
    ActivationOffloader.offload, ActivationOffloader.reload = delayed(offload, "_d2h"), delayed(reload, "_h2d")
    try:
        yield
    finally:
        ActivationOffloader.offload, ActivationOffloader.reload = offload, reload


def run_pipeline(device, backend: str, pp: int = 4, vpp: int = 2, layers_per_stage: int = 1, microbatches: int = 8,
                 forward_groups=(8,), backward_groups=(4, 4), mbs: int = 2, seq: int = 32, vocab: int = 128,
                 placement: Optional[Dict] = None, delay_cycles: int = 0, hidden: int = 64,
                 measure_memory: bool = False, one_at_a_time: bool = False, warmup: bool = False,
                 host_blocks: Optional[Dict] = None):
    """PipeMesh on ``pp`` thread-ranks vs the whole model (``placement``: the runtime's per (rank, chunk,
    micro-batch) placement plan); returns the check's record. On CUDA every thread-rank runs on a compute stream of
    its own and the loopback copies on communication streams (as NCCL); ``delay_cycles`` > 0 makes every copy on a
    side stream (loopback links, host placement's offload and reload) sleep that many GPU cycles first, so a missing
    wait, event or ``record_stream`` lets the compute streams overwrite or read the bytes before the copy did.
    ``measure_memory``: the runtime's activation meter on every rank (its peaks per rank in the record);
    ``one_at_a_time``: the ranks take turns (:func:`one_rank_at_a_time`), so that on CUDA each rank's allocator
    readings are its own; ``warmup``: the same call once before the one the record is of (on CUDA the first forward
    on a rank's stream allocates cuBLAS's workspace, which the allocator meter would count as that forward's);
    ``host_blocks``: the plan's pinned block per (rank, chunk), from which each rank's pool is sized at its first
    call (the record then has each rank's pool: blocks, bytes and those allocated late, inside an OFFLOAD)."""
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
        model = make_gpt(make_config(layers_per_stage, hidden=hidden), device, vocab, seq, pre=stage == 0,
                         post=stage == stages - 1)
        set_weights(model, stage * layers_per_stage)
        models.append(model)
    whole = make_gpt(make_config(stages * layers_per_stage, hidden=hidden), device, vocab, seq, pre=True, post=True)
    set_weights(whole, 0)

    # Reference: Megatron's no-pipelining schedule over the whole model.
    whole.zero_grad()
    reference = mcore.forward_backward_no_pipelining(
        forward_step_func=forward_step, data_iterator=iter(batches), model=[whole], num_microbatches=microbatches,
        seq_length=seq, micro_batch_size=mbs)
    reference_losses = [[float(x) for x in d["lm loss"].view(-1)] for d in reference]
    reference_grads = {n: p.grad.detach().float().cpu() for n, p in whole.named_parameters()}

    world = LoopbackWorld(pp, backend, copy_delay_cycles=delay_cycles)
    tp_cp = mcore._build_default_pg_collection()
    collection = SimpleNamespace(pp=world.pipeline_group, tp=tp_cp.tp, cp=tp_cp.cp)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)  # weights and batches were written on the default stream

    def rank_main(transport):
        if not cuda:
            return rank_schedule(transport)
        torch.cuda.set_device(device)
        with torch.cuda.stream(torch.cuda.Stream(device=device)):  # this rank's compute stream
            return rank_schedule(transport)

    def rank_schedule(transport):
        chunks = [models[c * pp + transport.rank()] for c in range(vpp)]
        schedule = PipeMeshSchedule(
            RunPlan(ScheduleConfig(pp, vpp, microbatches, tuple(forward_groups), tuple(backward_groups)), placement or {},
                    host_blocks=host_blocks or {}),
            PipeMeshOptions(p2p_timeout_s=60.0, measure_memory=measure_memory),
            transport=transport)
        for _ in range(2 if warmup else 1):
            for chunk in chunks:
                chunk.zero_grad()
            with CudaToCpuMode() if cpu_compat_active() else contextlib.nullcontext():  # torch modes are per thread
                out = schedule(forward_step_func=forward_step, data_iterator=[iter(batches) for _ in chunks],
                               model=chunks, num_microbatches=microbatches, seq_length=seq, micro_batch_size=mbs,
                               pg_collection=collection)
        return [[float(x) for x in d["lm loss"].view(-1)] for d in out], schedule.last_stats, schedule._offloader

    with megatron_in_threads(), delayed_offload_copies(delay_cycles), (
            one_rank_at_a_time(device) if one_at_a_time else contextlib.nullcontext(lambda f: f)) as turns:
        results, failures = run_ranks(world, turns(rank_main))
    errors = {rank: f"{type(error).__name__}: {error}" for rank, error in failures.items()}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    record = {"pp": pp, "vpp": vpp, "microbatches": microbatches, "forward_groups": list(forward_groups),
              "backward_groups": list(backward_groups), "backend": backend, "device": str(device),
              "waits": len(world.waits), "rank_streams": "own compute stream per rank" if cuda else "none (CPU)",
              "copy_delay_cycles": delay_cycles}
    if placement:
        hosted = [sum(1 for (r, _, _), level in placement.items() if r == rank and Lever.parse(level).is_host) for rank in range(pp)]
        record.update(host_placed=hosted,
                      offloaded_bytes=[sum(results[r][1].offloaded_bytes.values()) if r in results else 0 for r in range(pp)],
                      peak_host_bytes=[results[r][1].peak_host_bytes if r in results else 0 for r in range(pp)],
                      host_pool_allocations=[_pool(results, r, "allocations") for r in range(pp)],
                      host_pool_late_allocations=[_pool(results, r, "late_allocations") for r in range(pp)],
                      host_pool_bytes=[_pool(results, r, "allocated_bytes") for r in range(pp)])
    if errors or len(results) != pp:
        return {**record, "status": "fail", "errors": errors or {"threads": "did not finish"}}
    if measure_memory:
        record.update(memory_source=results[0][1].memory_source,
                      peak_activation_bytes=[results[r][1].peak_activation_bytes for r in range(pp)],
                      peak_block_bytes=[results[r][1].peak_block_bytes for r in range(pp)])
    losses = results[pp - 1][0]
    loss_diff = max((abs(a - b) / max(abs(b), 1e-30) for x, y in zip(losses, reference_losses) for a, b in zip(x, y)),
                    default=float("inf"))
    grad_diff = 0.0
    for stage, model in enumerate(models):
        for name, p in model.named_parameters():
            ref = reference_grads[global_name(name, stage * layers_per_stage)]
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


def _pool(results: Dict, rank: int, counter: str) -> int:
    """A counter of ``rank``'s pinned host pool (0 where the rank has none or did not finish)."""
    return getattr(getattr(results[rank][2], "pool", None), counter, 0) if rank in results else 0


def check_no_caching(out_dir: Path, deadline: float) -> dict:
    """``executor_host`` again in a child process under ``PYTORCH_NO_CUDA_MEMORY_CACHING=1``: every free is a
    ``cudaFree`` and every allocation a fresh ``cudaMalloc`` (``record_stream`` does nothing), so a result that only
    held because the caching allocator kept a freed block's bytes, or handed a block back to the same stream in a
    lucky order, changes. (``cudaFree`` synchronises the device, so a free racing a side-stream copy is the
    delayed-copies check's job.)"""
    left = deadline - time.monotonic()
    if left < 60:
        return {"status": "skip", "reason": f"only {left:.0f} s of the time budget left"}
    child = out_dir / "gpu_check_no_caching.json"
    command = [sys.executable, str(ENTRY), "--only", "executor_host", "--out", str(child),
               "--budget-s", str(int(left - 10))]
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    try:
        proc = subprocess.run(command, cwd=str(REPO), env=env, capture_output=True, text=True, timeout=left)
    except subprocess.TimeoutExpired:
        return {"status": "fail", "reason": f"timed out after {left:.0f} s"}
    if not child.exists():
        return {"status": "fail", "returncode": proc.returncode, "output_tail": (proc.stdout + proc.stderr)[-3000:]}
    result = json.loads(child.read_text())["checks"].get("executor_host", {"status": "fail"})
    return {**result, "env": "PYTORCH_NO_CUDA_MEMORY_CACHING=1", "returncode": proc.returncode}

