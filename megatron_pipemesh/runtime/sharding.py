"""Mixed sharding at run time: ZeRO-2/3 per chunk on Megatron's own DDP buffers and distributed optimizer.

Why own code (findings in :mod:`megatron_pipemesh.planning.sharding`): Megatron-FSDP, which has these
levels, is CUDA-only and applies one level to every chunk, and the distributed optimizer takes its
mode from the first chunk; Megatron's DDP path (``optim``, ZeRO-1) keeps whole parameter and gradient
buffers. So a chunk stays a Megatron ``DistributedDataParallel`` chunk under the distributed optimizer
(its buckets, their shard layout, ``start_param_sync`` / ``finish_param_sync``, ``finish_grad_sync``),
and this module frees and re-allocates the *storage* of its buffers around the schedule's groups:

* ``optim_grads_params`` (ZeRO-3): the rank's shard of each bucket is copied into a shard tensor and
  the parameter buffer's storage is freed (``untyped_storage().resize_(0)``: every view -- the
  parameters, the buckets, the optimizer's fp32 shard -- stays valid and works again once the storage
  is back). ``GATHER c.k`` re-allocates it, copies the shard into its slot (freeing the shard tensor's
  storage, so the shard is held once) and launches Megatron's own bucket all-gathers
  (``start_param_sync``); the chunk's next compute op waits on them (``finish_param_sync``).
  ``RELEASE c.k`` keeps the shard and frees the rest. At the end of the program the buffer comes
  back with the shard in place (zeros elsewhere) for the optimizer step, which updates the shard
  in place; the next program starts by releasing it again -- after any all-gather Megatron launched into
  it finished: with ``--overlap-param-gather-with-optimizer-step`` the optimizer step gathers the first
  chunk itself, and the program then keeps that gathered buffer for the chunk's first GATHER.
* ``optim_grads`` (ZeRO-2, also ZeRO-3): the gradient buffer's storage is freed at the start of the
  program (it was zeroed) and re-allocated (zeroed) at the first backward of each backward group;
  ``REDUCE c.k`` scales each bucket by Megatron's ``gradient_scaling_factor`` and reduce-scatters it
  (sum) over the bucket's own group, adds the reduced shard to a shard accumulator and frees the
  buffer; the last group's reduction is the chunk's ordinary ``GRAD_SYNC``: its ``start_grad_sync``
  first scales the buffer and adds the accumulator into this rank's slot, then runs Megatron's own
  reduction with the factor set to 1 for that call. So the earlier groups' shards ride the final
  reduce-scatter (each rank adds only its own slot, which the reduce-scatter returns to it alone) and,
  with several distributed-optimizer instances, Megatron's inter-instance all-reduce of the shard:
  every gradient crosses the instance boundary exactly once per iteration.

Scope (``--pipemesh-shard-scope``): every shard spans the bucket's own group, Megatron's
distributed-optimizer instance. ``data-parallel`` is one instance (all data-parallel ranks); ``node``
is Megatron's hierarchical distributed optimizer (``--num-distributed-optimizer-instances``, set by
the integration to the number of nodes a data-parallel group spans): gathers, per-group reductions
and the optimizer state stay inside a node, and Megatron all-reduces the node shard of the gradients
across the nodes once per iteration (on CUDA on its communication stream, ordered after the current
stream). :func:`check_node_groups` verifies at start-up that each instance is exactly the
data-parallel ranks of one node.

Limits (checked at parse time): no checkpoint saving, parameter norms or weight hashes with ZeRO-3
chunks (between iterations their buffers hold only the shard, as Megatron's own buffers hold stale
values until the next gather); no ``--ddp-param-name-patterns-for-fp32-local-accumulation`` with ZeRO-2/3
chunks (its separate main gradients live outside the freed buffer; also refused when a chunk state is built). On CUDA the copies, resizes and collectives
are ordered on the current stream like Megatron's own gathers; the shard tensors are allocated once
and only their storage is resized (no per-micro-batch allocation).

The runtime also counts the bytes every data-parallel op of the program gathers, reduces or all-reduces
across nodes and the bytes held by parameters, gradients and optimizer state while no group runs, for
comparison with the planning model (:func:`format_report`).

Step observers (:func:`add_step_observer`): callbacks run after each step of a :class:`ProgramSharding`
(program start, before an op, a GATHER / RELEASE / REDUCE), the moments ZeRO-2/3 buffers are freed or come
back, so that a memory meter outside the runtime (the bench's) samples model state there. None by default.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..schedule.ops import Op, OpKind

_OPTIMIZERS: List[object] = []
"""Megatron optimizers built in this process (registered by the integration), for the memory report."""

StepObserver = Callable[[], None]
_STEP_OBSERVERS: List[StepObserver] = []
"""Called, in order, after each :class:`ProgramSharding` step (see the module docstring)."""


def add_step_observer(observer: StepObserver) -> None:
    """Call ``observer()`` after every :class:`ProgramSharding` step of this process (once, however often added)."""
    if observer not in _STEP_OBSERVERS:
        _STEP_OBSERVERS.append(observer)


def remove_step_observer(observer: StepObserver) -> None:
    """Stop calling ``observer`` (no-op if it was not added)."""
    if observer in _STEP_OBSERVERS:
        _STEP_OBSERVERS.remove(observer)


def _notify_step_observers() -> None:
    for observer in _STEP_OBSERVERS:  # empty unless a meter registered: the loop is the whole cost
        observer()


def register_optimizer(optimizer) -> None:
    """Remember ``optimizer`` (Megatron's, possibly chained) so its state counts in the memory report."""
    _OPTIMIZERS.append(optimizer)


def optimizer_state_bytes() -> int:
    """Bytes of optimizer state (Adam moments, fp32 main copies) of the registered optimizers."""
    total, seen = 0, set()

    def tensors(optimizer):
        for inner in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
            torch_optimizer = getattr(inner, "optimizer", None)
            for state in getattr(torch_optimizer, "state", {}).values():
                yield from (v for v in state.values() if torch.is_tensor(v))
            for group in getattr(inner, "shard_fp32_from_float16_groups", None) or []:
                yield from group

    for optimizer in _OPTIMIZERS:
        for tensor in tensors(optimizer):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen and tensor.numel() > 1:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def _shard(tensor: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    numel = tensor.numel() // size
    return tensor.view(-1)[rank * numel:(rank + 1) * numel]


def _free(tensor: torch.Tensor) -> None:
    tensor.untyped_storage().resize_(0)


def _alloc(tensor: torch.Tensor) -> None:
    tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())


class ChunkSharding:
    """The ZeRO-2/3 state of one Megatron DDP chunk."""

    def __init__(self, chunk: int, ddp, level: str):
        self.chunk, self.ddp, self.level = chunk, ddp, level
        self.zero3 = level == "optim_grads_params"
        self.buffers = list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", []))
        self.bucket_groups = list(ddp.bucket_groups) + list(getattr(ddp, "expert_parallel_bucket_groups", []))
        self.buckets = [bucket for buffer in self.buffers for bucket in buffer.buckets]
        # Each bucket is sharded over its own buffer's group: Megatron's distributed-optimizer instance, the
        # expert data-parallel one for expert buffers (a different size under expert parallelism).
        self.groups = [buffer.data_parallel_group for buffer in self.buffers for _ in buffer.buckets]
        # Shard tensors, allocated once; their storage is freed while the whole buffer holds the shard.
        self.param_shards = ([torch.empty_like(self._mine(i, b.param_data)) for i, b in enumerate(self.buckets)]
                             if self.zero3 else [])
        self.grad_accum = [torch.zeros_like(self._mine(i, b.grad_data)) for i, b in enumerate(self.buckets)]
        self.params_out = self.grads_out = False
        self.gathering = False
        self.current = False
        """The whole buffer holds the current parameters, gathered by Megatron's optimizer step."""
        self.pending: List[Tuple[object, int]] = []
        self.to_add: set = set()
        """Bucket groups whose final reduction still has to carry the accumulated shards of earlier groups."""
        if any(bucket.params_with_extra_main_grads for bucket in self.buckets):
            raise ValueError(f"--pipemesh-sharding {level} (chunk {chunk}) with "
                             f"--ddp-param-name-patterns-for-fp32-local-accumulation is not supported: those parameters "
                             f"accumulate in separate main gradients outside the gradient buffer this level frees")
        for index, bucket_group in enumerate(self.bucket_groups):
            bucket_group.start_grad_sync = self._folding_start(index, bucket_group, bucket_group.start_grad_sync)

    def _mine(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slot of bucket ``index``'s ``tensor`` (its parameter or gradient data)."""
        group = self.groups[index]
        return _shard(tensor, group.size(), group.rank())

    # Parameters (ZeRO-3) -----------------------------------------------------------------------
    def release_params(self, keep_current: bool = False) -> None:
        """Keep only this rank's shard of the parameters, once every all-gather into the buffer finished (ours and
        Megatron's). ``keep_current`` (program start): when Megatron's optimizer step gathered the whole chunk
        (``--overlap-param-gather-with-optimizer-step`` does for the first chunk), the buffer holds the current
        parameters: keep it for the first GATHER instead of freeing it and gathering again."""
        if self.params_out:
            return
        self.wait_gather()
        if self._finish_megatron_gathers() and keep_current:
            self.current = True
            return
        self.current = False
        for index, (shard, bucket) in enumerate(zip(self.param_shards, self.buckets)):
            _alloc(shard)
            shard.copy_(self._mine(index, bucket.param_data))
        for buffer in self.buffers:
            _free(buffer.param_data)
        self.params_out = True

    def restore_params(self) -> None:
        """Bring the parameter buffer back with the shard in its slot (zeros elsewhere), shard tensors freed."""
        if not self.params_out:
            return
        for buffer in self.buffers:
            _alloc(buffer.param_data)
            buffer.param_data.zero_()
        for index, (shard, bucket) in enumerate(zip(self.param_shards, self.buckets)):
            self._mine(index, bucket.param_data).copy_(shard)
            _free(shard)
        self.params_out = False

    def _finish_megatron_gathers(self) -> bool:
        """Wait for the all-gathers Megatron launched into this chunk's buffer itself (the optimizer step's, see
        :meth:`release_params`): freeing the storage under one would let it write freed memory, and the next
        GATHER would trip Megatron's assertion on the handle in flight. True if every bucket group had one."""
        launched = [group for group in self.bucket_groups if getattr(group, "param_gather_handle", None) is not None]
        for bucket_group in launched:
            bucket_group.finish_param_sync(skip_next_bucket_dispatch=True)
        return bool(launched) and len(launched) == len(self.bucket_groups)

    def gather(self) -> int:
        """GATHER: restore the buffer and launch Megatron's bucket all-gathers (none when the buffer was kept
        current at the program's start); returns the bytes gathered."""
        if self.current:
            self.current = False
        else:
            self.restore_params()
            for bucket_group in self.bucket_groups:
                bucket_group.start_param_sync()
            self.gathering = True
        return sum(b.param_data.numel() * b.param_data.element_size() for b in self.buckets)

    def wait_gather(self) -> None:
        if not self.gathering:
            return
        for bucket_group in self.bucket_groups:
            if bucket_group.ddp_config.overlap_param_gather:
                bucket_group.finish_param_sync(skip_next_bucket_dispatch=True)
        self.gathering = False

    # Gradients (ZeRO-2/3) ----------------------------------------------------------------------
    def release_grads(self) -> None:
        if not self.grads_out:
            for buffer in self.buffers:
                _free(buffer.grad_data)
            self.grads_out = True

    def restore_grads(self) -> None:
        """Before a backward of this chunk: finish a reduction in flight, bring the (zeroed) buffer back."""
        self.finish_reduce()
        if self.grads_out:
            for buffer in self.buffers:
                _alloc(buffer.grad_data)
                buffer.grad_data.zero_()
            self.grads_out = False

    def reduce(self) -> int:
        """REDUCE: scale each bucket as Megatron's ``start_grad_sync`` does and reduce-scatter it (sum; an
        averaging configuration has the factor 1 and averages once, in the final reduction); returns bytes."""
        self.restore_grads()  # (a chunk without backwards since the last reduction has a zero buffer)
        total = 0
        with torch.no_grad():
            for index, bucket in enumerate(self.buckets):
                if bucket.gradient_scaling_factor != 1.0:
                    bucket.grad_data *= bucket.gradient_scaling_factor
                work = dist.reduce_scatter_tensor(self._mine(index, bucket.grad_data), bucket.grad_data,
                                                  op=dist.ReduceOp.SUM, group=self.groups[index], async_op=True)
                self.pending.append((work, index))
                total += bucket.grad_data.numel() * bucket.grad_data.element_size()
        return total

    def finish_reduce(self) -> None:
        """Wait for a REDUCE, add its shard to the accumulator and free the gradient buffer."""
        if not self.pending:
            return
        for work, _ in self.pending:
            work.wait()
        with torch.no_grad():
            for _, index in self.pending:
                self.grad_accum[index] += self._mine(index, self.buckets[index].grad_data)
        self.pending = []
        self.to_add = set(range(len(self.bucket_groups)))
        self.release_grads()

    def _folding_start(self, group_index: int, bucket_group, original):
        """``start_grad_sync`` of one bucket group that, once per iteration, scales the buffer itself, adds
        the accumulated shards of the earlier backward groups into this rank's slot and lets Megatron
        reduce with the factor 1 (so its reduce-scatter and, across instances, its all-reduce carry them)."""
        indices = [self.buckets.index(bucket) for bucket in bucket_group.buckets]

        def start_grad_sync(*args, **kwargs):
            if group_index not in self.to_add:
                return original(*args, **kwargs)
            if kwargs.get("force_all_reduce"):
                raise RuntimeError("--pipemesh-sharding optim_grads*: Megatron's force_all_reduce gradient sync would "
                                   "all-reduce the shard accumulator of this rank's slot only")
            self.to_add.discard(group_index)
            buckets = [self.buckets[index] for index in indices]
            factors = [bucket.gradient_scaling_factor for bucket in buckets]
            with torch.no_grad():
                for index, bucket in zip(indices, buckets):
                    if bucket.gradient_scaling_factor != 1.0:
                        bucket.grad_data *= bucket.gradient_scaling_factor
                    self._mine(index, bucket.grad_data).add_(self.grad_accum[index])
                    self.grad_accum[index].zero_()
                    bucket.gradient_scaling_factor = 1.0
            try:
                return original(*args, **kwargs)
            finally:
                for bucket, factor in zip(buckets, factors):
                    bucket.gradient_scaling_factor = factor

        return start_grad_sync

    # Accounting --------------------------------------------------------------------------------
    def held_bytes(self) -> int:
        """Bytes of parameters and gradients this chunk holds now (buffers, shard tensors, accumulators)."""
        tensors = [b.param_data for b in self.buffers] + [b.grad_data for b in self.buffers]
        tensors += self.param_shards + self.grad_accum
        return sum(t.untyped_storage().nbytes() for t in tensors)


def _buffers(ddp) -> list:
    return list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", []))


def cross_node_bytes(ddp) -> int:
    """Payload of Megatron's inter-instance all-reduce in one ``GRAD_SYNC`` of ``ddp`` (each rank's slot of
    every gradient bucket; 0 with one distributed-optimizer instance)."""
    if getattr(ddp.ddp_config, "num_distributed_optimizer_instances", 1) <= 1:
        return 0
    return sum(b.grad_data.numel() * b.grad_data.element_size() // b.data_parallel_group.size() for b in _buffers(ddp))


def whole_chunk_bytes(ddp) -> int:
    """Bytes of a ZeRO-1 chunk's parameter and gradient buffers."""
    return sum(b.param_data.untyped_storage().nbytes() + b.grad_data.untyped_storage().nbytes() for b in _buffers(ddp))


class ProgramSharding:
    """Per call of the schedule: dispatches GATHER/RELEASE/REDUCE, waits before compute, counts traffic."""

    def __init__(self, model: Sequence, levels: Sequence[str], states: Dict[int, ChunkSharding]):
        self.model, self.levels, self.states = model, tuple(levels), states
        self.traffic: Dict[Tuple[str, int], int] = {}
        self.resident_bytes: Optional[int] = None

    def _count(self, what: str, chunk: int, nbytes: int) -> None:
        self.traffic[(what, chunk)] = self.traffic.get((what, chunk), 0) + nbytes

    def begin(self, measure: bool = False) -> None:
        """Program start (after Megatron zeroed the gradients and stepped the optimizer): free what the
        levels do not keep; with ``measure``, count what parameters, gradients and optimizer state hold
        (host-side bookkeeping over the optimizer state: only for the report, not every iteration)."""
        for state in self.states.values():
            state.release_grads()
            if state.zero3:
                state.release_params(keep_current=True)
        if measure:
            held = 0
            for chunk, ddp in enumerate(self.model):
                held += self.states[chunk].held_bytes() if chunk in self.states else whole_chunk_bytes(ddp)
            self.resident_bytes = held + optimizer_state_bytes()
        _notify_step_observers()

    def before(self, op: Op) -> None:
        """Before ``op`` runs: count Megatron's own syncs; a compute op waits for its chunk's gather and a
        backward gets its chunk's gradient buffer back."""
        state = self.states.get(op.chunk)
        kind = op.kind
        if kind is OpKind.PARAM_SYNC:
            self._count("gather", op.chunk, sum(b.param_data.numel() * b.param_data.element_size()
                                                for b in _buffers(self.model[op.chunk])))
        elif kind is OpKind.GRAD_SYNC:
            if state is not None:
                state.restore_grads()
            self._count("reduce", op.chunk, sum(b.grad_data.numel() * b.grad_data.element_size()
                                                for b in _buffers(self.model[op.chunk])))
            self._count("cross", op.chunk, cross_node_bytes(self.model[op.chunk]))
        elif state is not None and kind.is_compute:
            state.wait_gather()
            if kind is OpKind.BACKWARD:
                state.restore_grads()
        _notify_step_observers()

    def run(self, op: Op) -> None:
        """Dispatch a GATHER / RELEASE / REDUCE op."""
        state = self.states[op.chunk]
        if op.kind is OpKind.GATHER:
            self._count("gather", op.chunk, state.gather())
        elif op.kind is OpKind.RELEASE:
            state.release_params()
        else:
            self._count("reduce", op.chunk, state.reduce())
        _notify_step_observers()

    def end(self) -> None:
        """Program end, before Megatron's finalize and optimizer step: reductions done, buffers whole."""
        for state in self.states.values():
            if state.pending or state.grads_out:
                state.restore_grads()
            state.restore_params()


class ShardingRuntime:
    """The per-chunk states of one model (built on first use, kept across calls)."""

    def __init__(self, levels: Sequence[str]):
        self.levels = tuple(levels)
        self.states: Optional[Dict[int, ChunkSharding]] = None

    def program(self, model: Sequence) -> ProgramSharding:
        if self.states is None:
            if len(model) != len(self.levels):
                raise ValueError(f"--pipemesh-sharding gives {len(self.levels)} levels for {len(model)} model chunks")
            for chunk, ddp in enumerate(model):
                if not getattr(getattr(ddp, "ddp_config", None), "use_distributed_optimizer", False):
                    raise ValueError(f"--pipemesh-sharding needs every chunk wrapped by Megatron's DDP with the distributed "
                                     f"optimizer; chunk {chunk} is {type(ddp).__name__}")
                if self.levels[chunk] != "optim" and getattr(ddp.ddp_config, "nccl_ub", False):
                    from .unsupported import unsupported_message  # the parse-time refusal, for configs built by code
                    raise ValueError(unsupported_message(SimpleNamespace(nccl_ub=True), SimpleNamespace(sharding=self.levels)))
            self.states = {}
            for chunk, (ddp, level) in enumerate(zip(model, self.levels)):
                if level == "optim":
                    continue
                # One state per DDP chunk for the whole run (a re-planned schedule reuses it: its hooks wrap once).
                state = getattr(ddp, "_pipemesh_sharding", None)
                if state is None or state.level != level:
                    state = ChunkSharding(chunk, ddp, level)
                    ddp._pipemesh_sharding = state
                self.states[chunk] = state
        return ProgramSharding(model, self.levels, self.states)


def _buffers_with_dp(ddp) -> List[Tuple[object, int]]:
    """Every buffer of ``ddp`` (dense and expert-parallel) with the size of the data-parallel group its gradients
    are averaged over: dense buffers over ``dp_cp_group``, expert ones over ``expt_dp_group`` (each shards over its
    own ``data_parallel_group``, the distributed-optimizer instance of that group; without the attribute, one)."""
    def size(name: str, buffer) -> int:
        group = getattr(ddp, name, None)
        return group.size() if group is not None else buffer.data_parallel_group.size()

    return ([(buffer, size("dp_cp_group", buffer)) for buffer in ddp.buffers]
            + [(buffer, size("expt_dp_group", buffer)) for buffer in getattr(ddp, "expert_parallel_buffers", [])])


def predicted_report(program: ProgramSharding, config, pp_rank: int, lookahead: int = 1) -> Dict[str, object]:
    """What the planning model predicts for this rank's chunks (their real buffer sizes, the real data-parallel
    and instance sizes): bytes held by parameters, gradients and optimizer state while no group runs, and the
    bytes each chunk gathers, reduces and all-reduces across nodes per iteration
    (:func:`megatron_pipemesh.planning.sharding.chunk_traffic`). Every buffer counts with its own group and
    element sizes: under expert parallelism the expert buffers shard over the expert data-parallel group, and a
    chunk may hold buffers of several dtypes."""
    from ..planning.sharding import bytes_per_param, chunk_traffic

    held, gather, reduce, cross = 0.0, {}, {}, {}
    for chunk, ddp in enumerate(program.model):
        level = program.levels[chunk]
        gather[chunk] = reduce[chunk] = cross[chunk] = 0.0
        for buffer, dp in _buffers_with_dp(ddp):
            shard = buffer.data_parallel_group.size()  # Megatron's distributed-optimizer instance of this buffer
            numel = buffer.param_data.numel()
            w, g = buffer.param_data.element_size(), buffer.grad_data.element_size()
            held += numel * bytes_per_param(level, shard, w, g).resident
            traffic = chunk_traffic(config, pp_rank, chunk, level, numel, dp, shard, w, g, lookahead)
            gather[chunk] += traffic.gathers * traffic.gather_bytes
            reduce[chunk] += traffic.reduces * traffic.reduce_bytes
            cross[chunk] += traffic.cross_node_bytes
    return {"held": held, "gather": gather, "reduce": reduce, "cross": cross}


def format_report(program: ProgramSharding, config, rank: int, pp_rank: int) -> str:
    """One line per rank: measured vs predicted memory and traffic (printed once, at the second iteration)."""
    predicted = predicted_report(program, config, pp_rank)
    measured = program.resident_bytes or 0
    chunks = range(len(program.model))
    counted = {what: {c: program.traffic.get((what, c), 0) for c in chunks} for what in ("gather", "reduce", "cross")}
    simulated = {what: {c: int(v) for c, v in predicted[what].items()} for what in ("gather", "reduce", "cross")}
    ratio = measured / predicted["held"] if predicted["held"] else float("nan")
    return (f"PipeMesh sharding rank {rank} (pipeline rank {pp_rank}) [{' '.join(program.levels)}]: parameters + gradients "
            f"+ optimizer state held outside groups: measured {measured} B, predicted {predicted['held']:.0f} B "
            f"({100 * ratio:.1f}%); per iteration gathered {counted['gather']} B (simulator {simulated['gather']}), "
            f"reduced {counted['reduce']} B (simulator {simulated['reduce']}), all-reduced across nodes "
            f"{counted['cross']} B (simulator {simulated['cross']})")


def node_group_error(rank: int, ranks_per_node: int, data_parallel: Sequence[int], instance: Sequence[int]) -> Optional[str]:
    """Why ``instance`` (this rank's distributed-optimizer instance, global ranks) is not exactly the ranks of
    ``data_parallel`` (its data-parallel group) on this rank's node, with nodes of ``ranks_per_node``
    consecutive global ranks (torchrun and Slurm number the ranks node by node); None when it is."""
    node = rank // ranks_per_node
    local = sorted(r for r in data_parallel if r // ranks_per_node == node)
    if sorted(instance) == local:
        return None
    return (f"--pipemesh-shard-scope node: on rank {rank} (node {node} of {ranks_per_node} ranks) Megatron's "
            f"distributed-optimizer instance holds ranks {sorted(instance)} but the data-parallel ranks of this node are "
            f"{local}: the node's ranks must be whole data-parallel blocks (Megatron's rank order puts tensor, then "
            f"data parallelism fastest: --use-tp-pp-dp-mapping breaks it) and every node must hold the same number of "
            f"them. Fix --pipemesh-ranks-per-node / the launcher's ranks per node, or use --pipemesh-shard-scope "
            f"data-parallel")


def check_node_groups(ranks_per_node: int) -> None:
    """Start-up check of the node scope (after Megatron created its groups, on every rank): all ranks agree on
    the node size and each distributed-optimizer instance is exactly the data-parallel ranks of one node.
    Raises ValueError naming the rank."""
    from megatron.core import parallel_state

    rank = dist.get_rank()
    sizes: List[Optional[int]] = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, ranks_per_node)
    if len(set(sizes)) != 1:
        other = next(r for r, size in enumerate(sizes) if size != ranks_per_node)
        raise ValueError(f"--pipemesh-shard-scope node: rank {rank} counts {ranks_per_node} ranks per node but rank "
                         f"{other} counts {sizes[other]}: every node must run the same number of ranks "
                         f"(--pipemesh-ranks-per-node, or the launcher's LOCAL_WORLD_SIZE / SLURM_NTASKS_PER_NODE)")
    data_parallel = dist.get_process_group_ranks(parallel_state.get_data_parallel_group(with_context_parallel=True))
    instance = dist.get_process_group_ranks(
        parallel_state.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True))
    error = node_group_error(rank, ranks_per_node, data_parallel, instance)
    if error:
        raise ValueError(error)
