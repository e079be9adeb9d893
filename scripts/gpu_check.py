#!/usr/bin/env python
"""What one GPU can check of PipeMesh's GPU path (run through ``scripts/gpu_check.sh``).

Checks (each reports pass/fail/skip with its numbers; the JSON summary goes to ``--out``; a check, or a part of
one, that needs CUDA reports ``skipped: needs CUDA (...)`` without it, never a pass):

* ``executor_<backend>``: the executor's forward/backward/send/receive path for every pipeline rank
  role (first stage, middle stages, last stage with the loss; p=4, V=2, elastic groups) in one
  process. NCCL cannot put two ranks on one GPU, so the ranks run as threads and each gives the
  executor the runtime's in-process loopback transport (``runtime/loopback.py``), which on CUDA behaves like
  NCCL: every thread-rank runs on a compute stream of its own, each copy runs on its link's communication
  stream after an event from each poster, and the waiter's stream waits for the copy's event. Losses and every
  gradient must equal the whole model run by Megatron's no-pipelining schedule (fp32); under the "nccl"
  backend every wait must be untimed (a timed NCCL wait blocks the host), under "gloo" every wait timed.
* ``executor_host``: the executor check again with a placement plan mixing every kind (device, host,
  selective, full recomputation) on every rank role: host placement's OFFLOAD / RELOAD (side
  streams, events, pinned buffer pool on GPU; synchronous copies on CPU) must leave losses and
  gradients unchanged.
* ``executor_delayed_copies`` (CUDA): ``executor_host`` with every side-stream copy (loopback links, offload,
  reload) starting ~1 ms late (``torch.cuda._sleep``): a missing event wait or ``record_stream`` then lets a
  compute stream reuse or read a block before its copy ran, and the comparison fails instead of the race being won.
* ``executor_no_caching`` (CUDA): ``executor_host`` in a child process under ``PYTORCH_NO_CUDA_MEMORY_CACHING=1``
  (every free a ``cudaFree``, every allocation a fresh ``cudaMalloc``): what only worked because the caching
  allocator kept a freed block's bytes or reused blocks in a lucky order fails here. (``cudaFree`` synchronises
  the device, so frees racing a side stream are the delayed-copies check's job.)
* ``megatron_path``: PipeMesh on Megatron's default GPU path, 3 training steps on 2 thread-ranks (V=2): a real
  process group (NCCL on GPU, even at world size 1; one communicator per thread-rank), bf16 chunks in
  ``Float16Module``, Transformer Engine's layer spec when TE imports, Megatron DDP with
  ``--overlap-grad-reduce --overlap-param-gather``, the distributed optimizer, gradient-accumulation fusion (the
  ``main_grad`` path; the torch wgrad kernels where APEX is absent), and train()'s hooks. The same model runs
  plain, with host placement, and with host placement plus ZeRO-3 on chunk 0, ZeRO-2 on chunk 1 and
  ``--overlap-param-gather-with-optimizer-step``; every run must finish (a saved Parameter that reaches the
  fused-wgrad backward as a copy makes DDP's overlap hook assert; a ZeRO-3 release under the optimizer step's
  in-flight gather makes Megatron's next gather assert), the first iteration's losses must be equal, later ones
  within bf16's margin, and a ZeRO-3 chunk's host placement must move what an unsharded one moves. On CUDA also
  the allocator meter runs on every rank, and Megatron's ``max_memory_allocated`` is never lowered. On
  CPU the same code runs with gloo and the local spec (its CUDA-only parts named in the record). One GPU cannot
  show per-bucket expert-parallel groups (MoE needs expert-data-parallel != data-parallel ranks):
  ``tests/runtime/test_sharding.py`` does, on CPU.
* ``meter``: the activation bytes one chunk's forward keeps, measured by the runtime's meter (the
  CUDA caching allocator's counters on GPU, saved-tensor hooks on CPU) against the activation model of
  ``planning/memory.py`` at each recompute level, within 10%; on CUDA the meter's peak must be what the forward
  keeps (not its temporaries) and ``max_memory_allocated`` must keep an earlier, larger peak (no reset).
* ``recompute``: Megatron's recomputation switches (``runtime/recompute.py``) on the device: the
  gradients do not change and the kept bytes fall from none to selective to full.
* ``host_link`` (CUDA): pinned copy bandwidth each direction (``runtime/host_link.py``, the start-up
  measurement of training), one chunk's activations offloaded and reloaded through the runtime's
  offloader (gradients unchanged), and how much of a copy of those bytes hides behind a chunk's forward
  and backward (hidden fraction, bandwidth while overlapping). Prints the ``--pipemesh-host-link-gbps``
  value the planner should use (the slower direction while overlapping compute).
* ``timing`` (CUDA): CUDA-event op times (``runtime/stats.py``) against synchronised wall time.
* ``bench``: the memory-fair CPU benchmark, ``python -m megatron_pipemesh.bench --quick`` with 8
  ranks (pp4xdp2); off unless ``--bench run`` (or ``--bench auto`` on a machine with the cores for 8 ranks):
  it can take the whole time budget.
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
NEEDS_CUDA = "skipped: needs CUDA"
"""How every CUDA-only check (or part of one) is reported on a machine, or a run, without CUDA: never a pass."""


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


def make_batches(count: int, mbs: int, seq: int, vocab: int, device, first: int = 0):
    """``count`` micro-batches, the j-th from seed 4321 + first + j (another ``first`` for each iteration)."""
    import torch

    batches = []
    for j in range(first, first + count):
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
                 placement: Optional[Dict] = None, delay_cycles: int = 0):
    """PipeMesh on ``pp`` thread-ranks vs the whole model (``placement``: the runtime's per (rank, chunk,
    micro-batch) placement plan); returns the check's record. On CUDA every thread-rank runs on a compute stream of
    its own and the loopback copies on communication streams (as NCCL); ``delay_cycles`` > 0 makes every copy on a
    side stream (loopback links, host placement's offload and reload) sleep that many GPU cycles first, so a missing
    wait, event or ``record_stream`` lets the compute streams overwrite or read the bytes before the copy did."""
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

    with megatron_in_threads(), delayed_offload_copies(delay_cycles):
        results, failures = run_ranks(world, rank_main)
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


# Megatron's default GPU path -----------------------------------------------------------------------------
MEGATRON_TOLERANCE = 1e-2
"""Largest relative loss / grad-norm difference accepted between two bf16 runs after optimizer steps (the first
iteration's losses must agree to :data:`TOLERANCE`: nothing before the first step may change them)."""


class StagePosition:
    """A chunk's place in the pipeline for Megatron's ``Float16Module`` (``rank()`` / ``size()``, as it reads its
    ``pg_collection.pp``): the thread-ranks share one process whose parallel state has a pipeline of one."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def transformer_engine_version() -> Optional[str]:
    """Transformer Engine's version when its PyTorch extension imports (then the TE layer spec is used)."""
    try:
        import transformer_engine
        import transformer_engine.pytorch  # noqa: F401 - the extension itself, not only the package
    except Exception:  # noqa: BLE001 - absent or broken: the local spec
        return None
    return str(getattr(transformer_engine, "__version__", "unknown"))


def wgrad_kernels(te: Optional[str]) -> str:
    """Which fused wgrad kernels Megatron's linear layers get; where APEX's CUDA extension is absent, the CPU layer's
    torch implementation (``cpu_compat`` item 12, device-agnostic) so that the main_grad path runs all the same."""
    from megatron.core.tensor_parallel import layers

    from megatron_pipemesh.integration.cpu_compat import TorchWgradKernels, _provide_wgrad_kernels

    _provide_wgrad_kernels()  # nothing where APEX's extension imported
    kernels = ("torch (cpu_compat item 12)" if layers.fused_weight_gradient_mlp_cuda is TorchWgradKernels
               else "apex fused_weight_gradient_mlp_cuda")
    return kernels + ("; Transformer Engine's own in its layers" if te else "")


def _rank_groups(backend: str):
    """One size-1 process group per thread-rank, standing in for every group of Megatron's collection (all are
    [0] in a world of one): each rank's DDP, distributed optimizer and gradient finalization talk over a communicator
    of their own, so no communicator is used by two threads at once."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    mpu = ProcessGroupCollection.use_mpu_process_groups()
    group = dist.new_group([0], backend=backend)
    return ProcessGroupCollection(**{name: group if isinstance(value, dist.ProcessGroup) else value
                                     for name, value in vars(mpu).items()})


def build_megatron_rank(device, backend: str, rank: int, pp: int, vpp: int, layers_per_chunk: int, hidden: int,
                        heads: int, vocab: int, seq: int, te: Optional[str], overlap_with_step: bool):
    """One thread-rank's chunks as Megatron's ``get_model`` / ``setup_model_and_optimizer`` make them for
    ``--bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather`` (and the default
    ``--gradient-accumulation-fusion``): bf16 GPT chunks (TE spec when TE imports), ``Float16Module``, Megatron DDP
    (fp32 gradient buffers), the distributed optimizer, and the config hooks ``train()`` installs."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                          get_gpt_layer_with_transformer_engine_spec)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    groups = _rank_groups(backend)
    config = make_config(layers_per_chunk, hidden=hidden, heads=heads, bf16=True, params_dtype=torch.bfloat16,
                         pipeline_dtype=torch.bfloat16, gradient_accumulation_fusion=True)
    spec = get_gpt_layer_with_transformer_engine_spec() if te else get_gpt_layer_local_spec()
    stages = pp * vpp
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True,
                                               use_distributed_optimizer=True, overlap_param_gather=True,
                                               align_param_gather=True, bucket_size=20000)
    chunks = []
    for c in range(vpp):
        stage = c * pp + rank
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=seq,
                         pre_process=stage == 0, post_process=stage == stages - 1,
                         share_embeddings_and_output_weights=False, position_embedding_type="learned_absolute",
                         pg_collection=groups)
        set_weights(model, stage * layers_per_chunk)
        model.to(device)
        wrapped = Float16Module(config, model)
        # Its first/last-stage casts follow the chunk's real place (the process's parallel state has PP=1).
        wrapped.vp_stage, wrapped.vp_size = c, vpp
        wrapped.pg_collection = SimpleNamespace(pp=StagePosition(rank, pp))
        # Megatron buckets chunk 0 only, and none with --overlap-param-gather-with-optimizer-step.
        chunks.append(DistributedDataParallel(config=config, ddp_config=ddp_config, module=wrapped,
                                              disable_bucketing=c > 0 or overlap_with_step, pg_collection=groups))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.01, bf16=True, params_dtype=torch.bfloat16,
                        use_distributed_optimizer=True, overlap_param_gather=True,
                        overlap_param_gather_with_optimizer_step=overlap_with_step,
                        clip_grad=1.0 if device.type == "cuda" else 0.0),  # CPU: clip_grads asserts CUDA tensors
        chunks, use_gloo_process_groups=False, pg_collection=groups)
    config.no_sync_func = [chunk.no_sync for chunk in chunks]
    config.grad_sync_func = [chunk.start_grad_sync for chunk in chunks]
    config.param_sync_func = [chunk.start_param_sync for chunk in chunks]

    def finalize(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
        # The schedule's collection carries the loopback pipeline; Megatron's finalization gets this rank's groups.
        return finalize_model_grads(model, num_tokens, pg_collection=groups, force_all_reduce=force_all_reduce)

    config.finalize_model_grads_func = finalize
    return SimpleNamespace(chunks=chunks, optimizer=optimizer, config=config, groups=groups)


def run_megatron_path(device, backend: str, host: bool, sharded: bool, pp: int = 2, vpp: int = 2, layers_per_chunk: int = 1,
                      microbatches: int = 4, forward_groups=(4,), backward_groups=(2, 2), iterations: int = 3,
                      hidden: int = 64, heads: int = 4, vocab: int = 256, seq: int = 64, mbs: int = 2,
                      te: Optional[str] = None, delay_cycles: int = 0, timeout_s: float = 60.0) -> dict:
    """``iterations`` training steps of PipeMesh on ``pp`` thread-ranks with Megatron's default GPU path on every
    rank (:func:`build_megatron_rank`); ``host``: half of chunk 0's micro-batches placed on the host; ``sharded``:
    ZeRO-3 on chunk 0 (whose gather the optimizer step starts) and ZeRO-2 on chunk 1, with
    ``--overlap-param-gather-with-optimizer-step``. Returns losses and grad norms per iteration (train()'s first
    iteration without the forward pre-hooks and param_sync_func, as Megatron does)."""
    import torch

    from megatron_pipemesh.integration.cpu_compat import CudaToCpuMode, cpu_compat_active
    from megatron_pipemesh.runtime.executor import PipeMeshOptions, PipeMeshSchedule
    from megatron_pipemesh.runtime.loopback import LoopbackWorld, megatron_in_threads, run_ranks
    from megatron_pipemesh.schedule import ScheduleConfig
    from megatron_pipemesh.schedule.plan import RunPlan

    cuda = device.type == "cuda"
    ranks = [build_megatron_rank(device, backend, r, pp, vpp, layers_per_chunk, hidden, heads, vocab, seq, te,
                                 overlap_with_step=sharded) for r in range(pp)]
    placement = {(r, 0, j): HOST for r in range(pp) for j in range(0, microbatches, 2)} if host else {}
    sharding = ("optim_grads_params", "optim_grads") if sharded else ()
    batches = [make_batches(microbatches, mbs, seq, vocab, device, first=i * microbatches) for i in range(iterations)]
    # A failing rank leaves its peers waiting: ``timeout_s`` bounds that (timed waits on gloo, the world's host
    # timeout for untimed NCCL-policy waits).
    world = LoopbackWorld(pp, "nccl" if cuda else backend, host_timeout_s=timeout_s, copy_delay_cycles=delay_cycles)
    if cuda:
        torch.cuda.synchronize(device)
    peaks_before = raise_allocator_peak(device) if cuda else None

    def rank_main(transport):
        rank = transport.rank()
        if cuda:
            torch.cuda.set_device(device)
        state = ranks[rank]
        collection = SimpleNamespace(pp=world.pipeline_group, tp=state.groups.tp, cp=state.groups.cp)
        # One compute stream for every thread-rank here: Transformer Engine's cuBLAS workspace is one per process.
        schedule = PipeMeshSchedule(RunPlan(ScheduleConfig(pp, vpp, microbatches, tuple(forward_groups),
                                                           tuple(backward_groups)), placement, sharding),
                                    PipeMeshOptions(p2p_timeout_s=timeout_s, measure_memory=cuda), transport=transport)
        out = {"losses": [], "grad_norms": [], "peak_activation_bytes": [], "offloaded_bytes": []}
        param_sync = state.config.param_sync_func
        for chunk in state.chunks:  # train(): the first iteration runs without the forward pre-hooks
            chunk.disable_forward_pre_hook(param_sync=False)
        state.config.param_sync_func = None
        with CudaToCpuMode() if cpu_compat_active() else contextlib.nullcontext():  # torch modes are per thread
            for iteration in range(iterations):
                for chunk in state.chunks:
                    chunk.zero_grad_buffer()
                state.optimizer.zero_grad()
                data = schedule(forward_step_func=forward_step, model=state.chunks,
                                data_iterator=[iter(batches[iteration]) for _ in state.chunks],
                                num_microbatches=microbatches, seq_length=seq, micro_batch_size=mbs,
                                pg_collection=collection)
                _, grad_norm, _ = state.optimizer.step()
                if iteration == 0:
                    for chunk in state.chunks:
                        chunk.enable_forward_pre_hook()
                    state.config.param_sync_func = param_sync
                out["losses"].append([float(x) for d in data for x in d["lm loss"].view(-1)[:1]])
                out["grad_norms"].append(float(grad_norm) if grad_norm is not None else None)
                stats = schedule.last_stats
                out["peak_activation_bytes"].append(int(stats.peak_activation_bytes))
                out["offloaded_bytes"].append(int(sum(stats.offloaded_bytes.values())))
        return out

    with megatron_in_threads(), delayed_offload_copies(delay_cycles):
        results, failures = run_ranks(world, rank_main)
    if cuda:
        torch.cuda.synchronize(device)
    record = {"pp": pp, "vpp": vpp, "microbatches": microbatches, "iterations": iterations,
              "host_placed": len(placement), "sharding": list(sharding),
              "overlap_param_gather_with_optimizer_step": sharded,
              "errors": {r: f"{type(e).__name__}: {e}" for r, e in failures.items()}}
    if failures or len(results) != pp:
        record["errors"] = record["errors"] or {"threads": "did not finish"}
        return record
    record.update(losses=results[pp - 1]["losses"], grad_norms=results[0]["grad_norms"],
                  peak_activation_bytes=[results[r]["peak_activation_bytes"] for r in range(pp)],
                  offloaded_bytes=[results[r]["offloaded_bytes"] for r in range(pp)])
    if cuda:  # the meter never resets the allocator's peak: Megatron's own memory report stays right
        record["max_memory_allocated_never_lowered"] = torch.cuda.max_memory_allocated(device) >= peaks_before
    return record


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def check_megatron_path(device, backend: str, delay_cycles: int = 0, timeout_s: float = 60.0) -> dict:
    """The PipeMesh runtime on Megatron's default GPU path (:func:`run_megatron_path`) with the levers the GPU path
    got wrong, against the same run without them: host placement (saved Parameters must reach the fused-wgrad
    backward as themselves, or DDP's overlap hook asserts), then also ZeRO-3 on chunk 0 with the optimizer step's own
    gather of chunk 0 in flight (Megatron asserts on a second gather) and ZeRO-2 on chunk 1. Every run must finish;
    the first iteration's losses must agree exactly, later ones and the grad norms within bf16's margin; a ZeRO-3
    chunk's host placement must move the same bytes as an unsharded one's (never its parameter buffer)."""
    te = transformer_engine_version() if device.type == "cuda" else None
    wgrad = wgrad_kernels(te)
    runs: Dict[str, dict] = {}
    for name, host, sharded in (("plain", False, False), ("host", True, False), ("host_zero", True, True)):
        runs[name] = run_megatron_path(device, backend, host=host, sharded=sharded, te=te, delay_cycles=delay_cycles,
                                       timeout_s=timeout_s)
        if runs[name].get("errors"):
            break  # the check failed; the other runs would only spend the time budget on their timeouts
    record = {"backend": backend, "device": str(device), "dtype": "bf16",
              "layer_spec": f"transformer-engine {te}" if te else "local", "wgrad_kernels": wgrad,
              "ddp": "Megatron DDP, --overlap-grad-reduce --overlap-param-gather, fp32 grad buffers",
              "optimizer": "distributed (adam)", "runs": runs}
    if device.type != "cuda":
        record["cuda_only_parts"] = ("skipped: needs CUDA (NCCL communicators, Transformer Engine's layers, the "
                                     "allocator meter; here gloo, the local spec and no meter: the CPU saved-tensor "
                                     "meter is refused with --overlap-grad-reduce and the fusion)")
    if len(runs) < 3 or any(run.get("errors") for run in runs.values()):
        return {**record, "status": "fail"}
    plain = runs["plain"]
    first = max(_rel(a, b) for name in ("host", "host_zero") for a, b in zip(runs[name]["losses"][0], plain["losses"][0]))
    later = max(_rel(a, b) for name in ("host", "host_zero")
                for x, y in zip(runs[name]["losses"], plain["losses"]) for a, b in zip(x, y))
    norms = max((_rel(a, b) for name in ("host", "host_zero") for a, b in zip(runs[name]["grad_norms"],
                                                                               plain["grad_norms"])
                 if a is not None and b), default=0.0)
    finite = all(x == x and abs(x) != float("inf") for run in runs.values() for it in run["losses"] for x in it)
    moved = runs["host"]["offloaded_bytes"]
    same_bytes = all(b > 0 for per_rank in moved for b in per_rank) and runs["host_zero"]["offloaded_bytes"] == moved
    ok = finite and same_bytes and first <= TOLERANCE and later <= MEGATRON_TOLERANCE and norms <= MEGATRON_TOLERANCE
    if device.type == "cuda":
        # The allocator meter ran on every rank beside DDP, the fusion and host placement (it installs no saved-tensor
        # hooks). Its numbers are not compared here: the thread-ranks share one allocator, so each rank's deltas
        # include the other's allocations; the meter check measures one forward alone.
        metered = all(len(run["peak_activation_bytes"][r]) == run["iterations"] for run in runs.values()
                      for r in range(run["pp"]))
        untouched = all(run["max_memory_allocated_never_lowered"] for run in runs.values())
        record.update(meter_ran_on_every_rank=metered, megatron_peak_stats_untouched=untouched)
        ok = ok and metered and untouched
    return {**record, "status": "pass" if ok else "fail", "first_iteration_max_rel_loss_diff": first,
            "max_rel_loss_diff": later, "max_rel_grad_norm_diff": norms, "zero3_host_moves_activations_only": same_bytes}


# Memory and recomputation on one chunk ------------------------------------------------------------
def _chunk_setup(device, pp: int, vpp: int, rank: int, chunk: int, layers_per_stage: int, hidden: int, seq: int,
                 mbs: int, vocab: int):
    stage = chunk * pp + rank
    stages = pp * vpp
    model = make_gpt(make_config(layers_per_stage, hidden=hidden), device, vocab, seq, pre=stage == 0,
                     post=stage == stages - 1)
    set_weights(model, stage * layers_per_stage)
    return model


def raise_allocator_peak(device, nbytes: int = 1 << 30) -> int:
    """Allocate and free ``nbytes`` so the allocator's peak counter is above anything a check allocates; returns
    ``max_memory_allocated`` then. A meter that reset the peak counters would leave it lower afterwards."""
    import torch

    torch.empty(nbytes, dtype=torch.uint8, device=device)
    return torch.cuda.max_memory_allocated(device)


def check_meter(device, levels=BASIC_LEVERS, hidden: int = 256, heads: int = 4, seq: int = 128,
                mbs: int = 2, vocab: int = 1024, layers_per_stage: int = 2):
    """A middle stage (pipeline rank 1 of 2, chunk 0) under the runtime's meter vs the activation model: what its
    forward keeps (saved tensors, received input, output) within 10% of ``planning/memory.py`` at each recompute
    level. On CUDA also the meter's semantics: its peak is what the forward keeps (the forward's temporaries, such as
    attention scores and softmax outputs that are not saved, never count) and Megatron's peak statistics are never
    reset (``max_memory_allocated`` after the meter is still the earlier, larger peak)."""
    import torch

    from megatron_pipemesh.planning.memory import ActivationShape, chunk_bytes
    from megatron_pipemesh.runtime.memory import make_memory_meter
    from megatron_pipemesh.runtime.recompute import recompute_scope

    cuda = device.type == "cuda"
    pp, vpp, rank, chunk = 2, 2, 1, 0
    model = _chunk_setup(device, pp, vpp, rank, chunk, layers_per_stage, hidden, seq, mbs, vocab)
    batch = make_batches(1, mbs, seq, vocab, device)[0]
    shape = ActivationShape(seq_length=seq, micro_batch_size=mbs, hidden_size=hidden, num_attention_heads=heads,
                            vocab_size=vocab, ffn_hidden_size=4 * hidden, dtype_bytes=4)
    peak_before = raise_allocator_peak(device) if cuda else None
    rows, ok = [], True
    for level in (DEVICE,) + tuple(levels):  # the first pass warms up kernels and workspaces
        if cuda:  # earlier checks' record_stream frees finish; the forward's first allocation processes them
            torch.cuda.synchronize(device)
        meter = make_memory_meter(device, [*model.parameters(), *model.buffers()])
        meter.begin()
        with recompute_scope(model, level), meter.record("F"):
            received = torch.randn((seq, mbs, hidden), device=device, requires_grad=True)  # what the receive allocates
            model.set_input_tensor(received)
            output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])
        meter.track("F", output)
        measured = meter.saved_bytes["F"] + sum(meter.tracked_bytes.values())
        peak = meter.peak_bytes
        with recompute_scope(model, level):
            output.backward(torch.ones_like(output))
        meter.release("F")
        predicted = chunk_bytes(shape, pp * vpp * layers_per_stage, pp, vpp, rank, chunk, level, keep_outputs=True)
        rows.append({"level": level, "measured_bytes": int(measured), "model_bytes": float(predicted),
                     "ratio": measured / predicted if predicted else None, "meter_peak_bytes": int(peak)})
        del output, received
    rows = rows[1:]
    for row in rows:
        ok = ok and row["ratio"] is not None and abs(row["ratio"] - 1) <= METER_TOLERANCE
    record = {"meter": "cuda-allocator" if cuda else "saved-tensors", "tolerance": METER_TOLERANCE, "levels": rows}
    if cuda:
        excluded = all(row["meter_peak_bytes"] == row["measured_bytes"] for row in rows)
        untouched = torch.cuda.max_memory_allocated(device) >= peak_before
        record.update(temporaries_excluded=excluded, megatron_peak_stats_untouched=untouched)
        ok = ok and excluded and untouched
    else:
        record.update(temporaries_excluded=f"{NEEDS_CUDA} (the CPU meter counts saves only; tests/runtime/test_memory.py "
                                           "drives the CUDA meter with a stand-in of the allocator's counters)",
                      megatron_peak_stats_untouched=f"{NEEDS_CUDA} (see tests/runtime/test_memory.py)")
    return {"status": "pass" if ok else "fail", **record}


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
        return {"status": "skip", "reason": "skipped: needs CUDA (pinned copies on side streams need a GPU; on CPU the "
                                            "executor_host check runs the offloader's synchronous path)"}
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
        return {"status": "skip", "reason": "skipped: needs CUDA (CUDA events need a GPU; on CPU the executor times "
                                            "with perf_counter)"}
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


def needs_cuda(device, why: str) -> Optional[dict]:
    """The skip record of a CUDA-only check on CPU (``why``: what it needs CUDA for), else None."""
    return None if device.type == "cuda" else {"status": "skip", "reason": f"{NEEDS_CUDA} ({why})"}


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
    command = [sys.executable, str(Path(__file__).resolve()), "--only", "executor_host", "--out", str(child),
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


DELAY_CYCLES = 2_000_000
"""GPU cycles every side-stream copy waits before it starts in the delayed-copies check (about 1 ms)."""


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-only", action="store_true",
                        help="run every check on the CPU (the CUDA-only ones report 'skipped: needs CUDA')")
    parser.add_argument("--out", default=None, help="JSON summary path (default: $OUT/gpu_check.json, else ./gpu_check.json)")
    parser.add_argument("--bench", choices=("auto", "run", "skip"), default="skip",
                        help=f"the 8-rank CPU benchmark: skip (default), run, or auto (runs with >= {BENCH_RANKS} cores)")
    parser.add_argument("--budget-s", type=float, default=470.0, help="time budget of the whole check (default 470 s)")
    parser.add_argument("--only", default=None, help="comma-separated check names: run these only")
    parser.add_argument("--delay-cycles", type=int, default=DELAY_CYCLES,
                        help=f"GPU cycles each side-stream copy waits in executor_delayed_copies (default {DELAY_CYCLES})")
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

    cuda = device.type == "cuda"
    only = set(args.only.split(",")) if args.only else None
    checks: Dict[str, dict] = {}

    def run(name: str, function: Callable[[], dict]) -> None:
        if only is None or name in only:
            _timed(name, checks, function)

    backends = ("nccl",) if cuda else ("nccl", "gloo")  # CPU: both wait policies
    for backend in backends:
        run(f"executor_{backend}", lambda backend=backend: run_pipeline(device, backend))
    run("executor_host", lambda: run_pipeline(device, backends[0], placement=mixed_placement(4, 2, 8)))
    run("executor_delayed_copies", lambda: needs_cuda(device, "side streams to delay") or run_pipeline(
        device, "nccl", placement=mixed_placement(4, 2, 8), delay_cycles=args.delay_cycles))
    run("executor_no_caching", lambda: needs_cuda(device, "the CUDA caching allocator to turn off")
        or check_no_caching(out.parent, deadline))
    run("megatron_path", lambda: check_megatron_path(device, "nccl" if cuda else "gloo"))
    run("host_link", lambda: check_host_link(device))
    run("meter", lambda: check_meter(device))
    run("recompute", lambda: check_recompute(device))
    run("timing", lambda: check_timing(device))
    run("bench", lambda: check_bench(out.parent, deadline, args.bench))

    from megatron.core import package_info
    summary = {
        "passed": all(c["status"] in ("pass", "skip") for c in checks.values()),
        "mode": "cpu-only" if args.cpu_only else ("gpu" if cuda else "cpu (no CUDA)"),
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        "cores": _cores(), "torch": torch.__version__, "megatron_core": package_info.__version__,
        "transformer_engine": transformer_engine_version() if cuda else None,
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
