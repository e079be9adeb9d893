"""PipeMesh on Megatron's default GPU path (``megatron_path``): thread-ranks each with a real process group, bf16
chunks in ``Float16Module``, Transformer Engine's layer spec when TE imports, Megatron DDP with overlapped reduction
and gathers, the distributed optimizer, gradient-accumulation fusion, host placement and ZeRO-2/3."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Dict, Optional, Sequence

from .common import (TOLERANCE, forward_step, make_batches, make_config, raise_allocator_peak, rel_diff,
                     set_weights)
from .executor import delayed_offload_copies

from megatron_pipemesh.schedule.levers import HOST  # noqa: E402 (pure)

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


def host_placement(pp: int, vpp: int, microbatches: int) -> Dict:
    """Where the Megatron-path runs place activations on the host: half of chunk 0's micro-batches on every rank (the
    first stage's and a middle stage's layers: with TE, TE's linears, which reach ``main_grad`` through a weakref to
    the Parameter and so work even when handed a copy of it) and the other half of the last stage's last chunk's,
    which holds Megatron's own fused-wgrad output layer (``ColumnParallelLinear`` whatever the layer spec): where a
    saved Parameter reaching the backward as a copy fails whether or not Transformer Engine imports."""
    placement = {(r, 0, j): HOST for r in range(pp) for j in range(0, microbatches, 2)}
    placement.update({(pp - 1, vpp - 1, j): HOST for j in range(1, microbatches, 2)})
    return placement


def run_megatron_path(device, backend: str, host: bool, sharding: Sequence[str] = (), overlap_with_step: bool = False,
                      pp: int = 2, vpp: int = 2, layers_per_chunk: int = 1, microbatches: int = 4, forward_groups=(4,),
                      backward_groups=(2, 2), iterations: int = 3, hidden: int = 64, heads: int = 4, vocab: int = 256,
                      seq: int = 64, mbs: int = 2, te: Optional[str] = None, delay_cycles: int = 0,
                      timeout_s: float = 60.0) -> dict:
    """``iterations`` training steps of PipeMesh on ``pp`` thread-ranks with Megatron's default GPU path on every
    rank (:func:`build_megatron_rank`); ``host``: :func:`host_placement`; ``sharding``: the ZeRO level per chunk
    (e.g. ZeRO-3 on chunk 0, whose gather the optimizer step starts, and ZeRO-2 on chunk 1); ``overlap_with_step``:
    ``--overlap-param-gather-with-optimizer-step`` (Megatron then buckets no chunk). Returns losses and grad norms per
    iteration (train()'s first iteration without the forward pre-hooks and param_sync_func, as Megatron does)."""
    import torch

    from megatron_pipemesh.integration.cpu_compat import CudaToCpuMode, cpu_compat_active
    from megatron_pipemesh.runtime.executor import PipeMeshOptions, PipeMeshSchedule
    from megatron_pipemesh.runtime.loopback import LoopbackWorld, megatron_in_threads, run_ranks
    from megatron_pipemesh.schedule import ScheduleConfig
    from megatron_pipemesh.schedule.plan import RunPlan

    cuda = device.type == "cuda"
    ranks = [build_megatron_rank(device, backend, r, pp, vpp, layers_per_chunk, hidden, heads, vocab, seq, te,
                                 overlap_with_step=overlap_with_step) for r in range(pp)]
    placement = host_placement(pp, vpp, microbatches) if host else {}
    sharding = tuple(sharding)
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
        out = {"losses": [], "grad_norms": [], "peak_activation_bytes": [], "offloaded_bytes": [],
               "last_chunk_offloaded_bytes": []}
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
                out["last_chunk_offloaded_bytes"].append(int(sum(nbytes for (chunk, _), nbytes in
                                                                 stats.offloaded_bytes.items() if chunk == vpp - 1)))
        return out

    with megatron_in_threads(), delayed_offload_copies(delay_cycles):
        results, failures = run_ranks(world, rank_main)
    if cuda:
        torch.cuda.synchronize(device)
    record = {"pp": pp, "vpp": vpp, "microbatches": microbatches, "iterations": iterations,
              "forward_groups": list(forward_groups), "backward_groups": list(backward_groups),
              "host_placed": len(placement),
              "host_placed_last_stage": sum(1 for (r, c, _) in placement if r == pp - 1 and c == vpp - 1),
              "sharding": list(sharding), "overlap_param_gather_with_optimizer_step": overlap_with_step,
              "errors": {r: f"{type(e).__name__}: {e}" for r, e in failures.items()}}
    if failures or len(results) != pp:
        record["errors"] = record["errors"] or {"threads": "did not finish"}
        return record
    record.update(losses=results[pp - 1]["losses"], grad_norms=results[0]["grad_norms"],
                  peak_activation_bytes=[results[r]["peak_activation_bytes"] for r in range(pp)],
                  offloaded_bytes=[results[r]["offloaded_bytes"] for r in range(pp)],
                  last_stage_offloaded_bytes=results[pp - 1]["last_chunk_offloaded_bytes"])
    if cuda:  # the meter never resets the allocator's peak: Megatron's own memory report stays right
        record["max_memory_allocated_never_lowered"] = torch.cuda.max_memory_allocated(device) >= peaks_before
    return record


def check_megatron_path(device, backend: str, delay_cycles: int = 0, timeout_s: float = 60.0) -> dict:
    """The PipeMesh runtime on Megatron's default GPU path (:func:`run_megatron_path`) with the levers the GPU path
    got wrong, against the same run without them: host placement (saved Parameters must reach the fused-wgrad
    backward as themselves, or DDP's overlap hook asserts; :func:`host_placement` places chunk-micro-batches of the
    last stage's last chunk, whose output layer is Megatron's own fused-wgrad linear, too), then also ZeRO-3 on
    chunk 0 with the optimizer step's own gather of chunk 0 in flight (Megatron asserts on a second gather) and
    ZeRO-2 on chunk 1. Every run must finish; the first iteration's losses must agree exactly, later ones and the
    grad norms within bf16's margin; a ZeRO-3 chunk's host placement must move the same bytes as an unsharded one's
    (never its parameter buffer)."""
    te = transformer_engine_version() if device.type == "cuda" else None
    wgrad = wgrad_kernels(te)
    runs: Dict[str, dict] = {}
    zero = ("optim_grads_params", "optim_grads")
    for name, host, sharding in (("plain", False, ()), ("host", True, ()), ("host_zero", True, zero)):
        runs[name] = run_megatron_path(device, backend, host=host, sharding=sharding, overlap_with_step=bool(sharding),
                                       te=te, delay_cycles=delay_cycles, timeout_s=timeout_s)
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
    first = max(rel_diff(a, b) for name in ("host", "host_zero") for a, b in zip(runs[name]["losses"][0], plain["losses"][0]))
    later = max(rel_diff(a, b) for name in ("host", "host_zero")
                for x, y in zip(runs[name]["losses"], plain["losses"]) for a, b in zip(x, y))
    norms = max((rel_diff(a, b) for name in ("host", "host_zero") for a, b in zip(runs[name]["grad_norms"],
                                                                               plain["grad_norms"])
                 if a is not None and b), default=0.0)
    finite = all(x == x and abs(x) != float("inf") for run in runs.values() for it in run["losses"] for x in it)
    moved = runs["host"]["offloaded_bytes"]
    same_bytes = all(b > 0 for per_rank in moved for b in per_rank) and runs["host_zero"]["offloaded_bytes"] == moved
    # The last stage's last chunk moved bytes in every iteration of both host runs: its output layer's backward ran
    # on what host placement handed it.
    last_stage = all(b > 0 for name in ("host", "host_zero") for b in runs[name]["last_stage_offloaded_bytes"])
    record["last_stage_host_placed"] = last_stage
    ok = finite and same_bytes and last_stage and first <= TOLERANCE and later <= MEGATRON_TOLERANCE and norms <= MEGATRON_TOLERANCE
    if device.type == "cuda":
        # The allocator meter ran on every rank beside DDP, the fusion and host placement (it installs no saved-tensor
        # hooks). Its numbers are not compared here: the thread-ranks run at once and share one allocator, so each
        # rank's deltas include the other's allocations. meter_offload compares the meter under host placement
        # with the plan, its ranks taking turns; the meter check measures one forward alone.
        metered = all(len(run["peak_activation_bytes"][r]) == run["iterations"] for run in runs.values()
                      for r in range(run["pp"]))
        untouched = all(run["max_memory_allocated_never_lowered"] for run in runs.values())
        record.update(meter_ran_on_every_rank=metered, megatron_peak_stats_untouched=untouched)
        ok = ok and metered and untouched
    return {**record, "status": "pass" if ok else "fail", "first_iteration_max_rel_loss_diff": first,
            "max_rel_loss_diff": later, "max_rel_grad_norm_diff": norms, "zero3_host_moves_activations_only": same_bytes}


