"""PipeMesh's forward-backward function for Megatron: runs this rank's lowered program.

:class:`PipeMeshSchedule` is called exactly like megatron-core 0.19's schedule functions
(``forward_backward_pipelining_with_interleaving``) and reuses Megatron's ``forward_step`` /
``backward_step``, so loss scaling, token counting, MoE/MTP auxiliary losses and the
data-parallel hooks behave as in the stock schedule. What differs is only the order of work,
which comes from the validated plan:

* receives are posted where the program says (one compute op ahead by default) and waited just
  before their consumer; sends are asynchronous and their output tensors are deallocated (as
  Megatron's ``deallocate_output_tensor``) once the send completed;
* ``PARAM_SYNC c`` calls ``param_sync_func[c]``; ``GRAD_SYNC c`` calls ``grad_sync_func[c]``;
  without ``grad_sync_func``, Megatron's ``no_sync_func`` is lifted for each chunk's last backward
  so that DDP's own hooks reduce its gradients; ``finalize_model_grads_func`` runs at the end;
* transfers go through the schedule's :class:`~.transport.PipelineTransport` (torch.distributed by
  default; an in-process loopback for thread-ranks): waits on gloo (CPU) have a timeout and failures
  name the rank, the step, the op and the plan; on NCCL a wait takes no timeout (``work.wait(timeout)``
  blocks the host until the transfer is done, which would stop the CPU from running ahead of the GPU):
  the link groups carry the distributed timeout and NCCL's watchdog ends a stuck job, as with
  Megatron's own schedules;
* every transfer uses its link's own process group (the caller's provider, e.g.
  ``integration.parallel_state``'s); a missing link group is an error, never a fall-back to the shared
  pipeline group;
* each call tags its transfers with a call counter (gloo matches tags; NCCL ignores them), so the
  receives a failed call left posted can never take a later call's data; an exception leaves
  Megatron usable: ``no_sync`` exited, the ``forward-backward`` timer stopped (on NCCL, where posted
  receives cannot be cancelled, the next call fails naming the links instead of mismatching data);
* every op runs inside ``torch.profiler.record_function("PipeMesh <op>")`` so profiler traces show
  the plan; on CUDA, compute ops are also timed with CUDA events (GPU time, read lazily);
* the plan's ``placement`` chooses per (pipeline rank, chunk, micro-batch) whether a training
  forward keeps its activations, recomputes a module set or recomputes the whole chunk
  (:mod:`.recompute`); ``PipeMeshOptions.measure_memory`` measures what each forward keeps alive
  (:mod:`.memory`);
* the placement's lever ``host`` keeps a chunk-micro-batch's activations whole but in host memory
  between its forward and its backward: the lowering adds ``OFFLOAD c.j`` after the forward and
  ``RELOAD c.j`` before the backward, which launch the copies (:mod:`.offload`, asynchronous on CUDA
  side streams); the backward waits for its reload.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import torch

from ..schedule.config import BACKWARD_FLAG, FORWARD_FLAG, ScheduleConfig
from ..schedule.host_blocks import pool_blocks
from ..schedule.levers import DEVICE
from ..schedule.lower import LoweredSchedule, LoweringOptions, lower
from ..schedule.ops import F, Op, OpKind
from ..schedule.plan import RunPlan
from ..schedule.validate import validate
from .errors import PipeMeshRuntimeError
from .memory import SavedTensorMeter, ambient_meter, make_memory_meter, model_tensors
from .offload import ActivationOffloader
from .recompute import recompute_scope
from .stats import OpClock, OpRecord, RuntimeStats
from .transport import DistTransport, LinkGroups, LinkKey, PipelineTransport
from .unsupported import check_model_config


@dataclass(frozen=True)
class PipeMeshOptions:
    """How the runtime runs plans (what it runs is the :class:`~..schedule.plan.RunPlan`)."""

    p2p_timeout_s: Optional[float] = None
    """Timeout of every wait on a gloo pipeline transfer (NCCL waits use the link group's timeout); None uses
    30 minutes."""
    check_plan_across_ranks: bool = True
    """Compare the plan digest across all ranks on first use (one all-gather) and fail on mismatch."""
    measure_memory: bool = False
    """Measure the activation bytes each training forward keeps until its backward (saved-tensor hooks on
    CPU, allocator statistics on CUDA) into ``RuntimeStats``."""


@dataclass
class _CallState:
    """What one call's program carries from op to op."""

    total_num_tokens: torch.Tensor
    """Tokens of the call's forwards (Megatron's per-token loss)."""
    inputs: Dict[Op, Optional[torch.Tensor]] = field(default_factory=dict)
    """Per forward: its received input, kept for its backward."""
    outputs: Dict[Op, torch.Tensor] = field(default_factory=dict)
    """Per forward: its output, kept for its send and its backward."""
    input_grads: Dict[Op, torch.Tensor] = field(default_factory=dict)
    """Per backward: the gradient of its input, kept for its send."""
    forward_data_store: List = field(default_factory=list)
    synced: set = field(default_factory=set)
    """Chunks whose gradient reduction was launched."""


def _device_of(module: torch.nn.Module) -> torch.device:
    for parameter in module.parameters():
        return parameter.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class PipeMeshSchedule:
    """Callable with the keyword signature of megatron-core's schedule functions."""

    def __init__(self, plan: RunPlan = RunPlan(), options: PipeMeshOptions = PipeMeshOptions(),
                 p2p_groups: Optional[LinkGroups] = None, transport: Optional[PipelineTransport] = None):
        """``p2p_groups``: provider of the per-link process groups of the default (torch.distributed) transport,
        e.g. ``integration.parallel_state.get_pipemesh_p2p_groups``; ``transport``: another transport (it brings
        its own links), e.g. :class:`~.loopback.LoopbackTransport`."""
        if not isinstance(plan, RunPlan) or not isinstance(options, PipeMeshOptions):
            raise TypeError(f"PipeMeshSchedule(plan: RunPlan, options: PipeMeshOptions), got "
                            f"({type(plan).__name__}, {type(options).__name__})")
        if transport is not None and p2p_groups is not None:
            raise ValueError("give PipeMeshSchedule either a transport or the p2p_groups of the default one")
        self.plan, self.options = plan, options
        self.transport = transport if transport is not None else DistTransport(p2p_groups)
        """This rank's pipeline transfers (pending transfers, tags, wait policy, failure state across calls)."""
        self._plans: Dict[tuple, LoweredSchedule] = {}
        self._checked: set = set()
        self.last_stats: Optional[RuntimeStats] = None
        from .sharding import ShardingRuntime
        self.sharding = ShardingRuntime(plan.sharding) if plan.sharding else None
        self.training_calls = 0
        self._offloader: Optional[ActivationOffloader] = None
        """Host placement's copy engine (pool of host buffers, side streams), kept across calls."""

    def offloader(self, device: torch.device) -> ActivationOffloader:
        """The schedule's :class:`ActivationOffloader` for ``device`` (created once: its buffers are reused)."""
        if self._offloader is None or self._offloader.device != torch.device(device):
            self._offloader = ActivationOffloader(device)
        return self._offloader

    @property
    def abandoned_receives(self) -> int:
        """Receives failed calls left posted (:attr:`.PipelineTransport.abandoned_receives`)."""
        return self.transport.abandoned_receives

    @property
    def abandoned_sends(self) -> list:
        """Sends failed calls left in flight, kept until they complete (:attr:`.PipelineTransport.abandoned_sends`)."""
        return self.transport.abandoned_sends

    def continue_from(self, previous: "PipeMeshSchedule") -> "PipeMeshSchedule":
        """Take over ``previous``'s call counter (transfer tags) and failure state, when this schedule
        replaces it mid-run (re-planning), so stale receives of its failed calls still cannot match."""
        self.transport.continue_from(previous.transport)
        return self

    # Planning ------------------------------------------------------------------------------
    def lowered(self, config: ScheduleConfig, lowering: LoweringOptions) -> LoweredSchedule:
        key = (config, lowering)
        if key not in self._plans:
            schedule = lower(config, lowering)
            validate(schedule)
            self._plans[key] = schedule
        return self._plans[key]

    def _check_same_plan(self, schedule: LoweredSchedule, rank: int) -> None:
        digest = schedule.digest()
        if not self.options.check_plan_across_ranks or digest in self._checked:
            return
        gathered = self.transport.all_gather_object(f"{digest} {schedule.config.describe()}")
        if len(set(gathered)) > 1:
            lines = "\n".join(f"  rank {r}: plan {g}" for r, g in enumerate(gathered))
            raise PipeMeshRuntimeError(
                f"rank {rank}: ranks disagree on the PipeMesh plan; every rank must get the same "
                f"--pipeline-schedule, {FORWARD_FLAG}, {BACKWARD_FLAG} and batch flags:\n{lines}")
        self._checked.add(digest)

    # Execution -----------------------------------------------------------------------------
    def __call__(self, *, forward_step_func, data_iterator, model, num_microbatches: int, seq_length: int,
                 micro_batch_size: int, decoder_seq_length: Optional[int] = None, forward_only: bool = False,
                 collect_non_loss_data: bool = False, first_val_step: Optional[bool] = None,
                 adjust_tensor_shapes_fn: Optional[Callable] = None, p2p_communicator=None, pg_collection=None,
                 force_all_reduce: Optional[bool] = False):
        from megatron.core.pipeline_parallel import schedules as mcore
        from megatron.core.utils import get_model_config

        if not isinstance(model, list) or not isinstance(data_iterator, list):
            raise PipeMeshRuntimeError("the PipeMesh schedule needs virtual pipeline chunks: model and data_iterator "
                                       "must be lists (set --num-virtual-stages-per-pipeline-rank >= 2)")
        if adjust_tensor_shapes_fn is not None:
            raise PipeMeshRuntimeError("adjust_tensor_shapes_fn is not supported with interleaved chunks (as in Megatron)")
        config = get_model_config(model[0])
        check_model_config(config, self.plan)  # features the stock interleaved schedule handles and this one does not
        if pg_collection is None:
            pg_collection = mcore._build_default_pg_collection()
        pp_group = p2p_communicator.pp_group if p2p_communicator is not None else pg_collection.pp
        run = _Run(self, config, mcore, model, data_iterator, forward_step_func, num_microbatches, seq_length,
                   micro_batch_size, forward_only, collect_non_loss_data, first_val_step, pg_collection, pp_group,
                   force_all_reduce)
        return run.execute()


class _Run:
    """State of one call: this rank's program and its tensors (its transfers: the schedule's transport)."""

    def __init__(self, owner: PipeMeshSchedule, config, mcore, model, data_iterator, forward_step_func, num_microbatches,
                 seq_length, micro_batch_size, forward_only, collect_non_loss_data, first_val_step, pg_collection,
                 pp_group, force_all_reduce):
        self.owner, self.config, self.mcore, self.model = owner, config, mcore, model
        self.data_iterator, self.forward_step_func = data_iterator, forward_step_func
        self.m, self.forward_only, self.collect_non_loss_data = num_microbatches, forward_only, collect_non_loss_data
        self.first_val_step, self.pg_collection, self.pp_group = first_val_step, pg_collection, pp_group
        self.force_all_reduce = force_all_reduce
        self.transport = owner.transport
        self.rank = self.transport.rank()
        self.pp_ranks = self.transport.group_ranks(pp_group)
        self.pp_rank, self.pp = self.pp_ranks.index(self.rank), len(self.pp_ranks)
        self.vpp = len(model)
        cp = pg_collection.cp.size() if getattr(pg_collection, "cp", None) is not None else 1
        self.cp_size = cp
        tp = pg_collection.tp.size() if getattr(pg_collection, "tp", None) is not None else 1
        seq = seq_length // cp
        if config.sequence_parallel:
            seq //= tp
        self.shape = (seq, micro_batch_size, config.hidden_size)
        self.device = _device_of(model[0])
        self.dtype = config.pipeline_dtype or torch.float32
        timeout = owner.options.p2p_timeout_s
        self.timeout = timedelta(seconds=timeout if timeout is not None else 30 * 60)
        self.clock = OpClock(self.device)
        self.timer_started = False

        # Megatron disables the DP hooks entirely for forward-only passes.
        self.grad_sync_func = None if forward_only else config.grad_sync_func
        self.param_sync_func = None if forward_only else config.param_sync_func
        if self.grad_sync_func is not None and not isinstance(self.grad_sync_func, list):
            self.grad_sync_func = [self.grad_sync_func for _ in model]
        if self.param_sync_func is not None and not isinstance(self.param_sync_func, list):
            self.param_sync_func = [self.param_sync_func for _ in model]
        no_sync = config.no_sync_func
        if isinstance(no_sync, list):
            funcs = no_sync

            @contextlib.contextmanager
            def no_sync():
                with contextlib.ExitStack() as stack:
                    for func in funcs:
                        stack.enter_context(func())
                    yield
        self.no_sync_func = no_sync or contextlib.nullcontext
        self.no_sync_context = None

        plan = owner.plan
        schedule_config = plan.config_for(self.pp, self.vpp, num_microbatches,
                                          getattr(config, "microbatch_group_size_per_vp_stage", None), forward_only)
        lowering = plan.lowering(param_sync=self.param_sync_func is not None, grad_sync=self.grad_sync_func is not None,
                                 forward_only=forward_only)
        self.schedule = owner.lowered(schedule_config, lowering)
        self.program = self.schedule.programs[self.pp_rank]
        self.sent = {op.compute for op in self.program if op.kind is OpKind.SEND_FORWARD}
        self.last_backward = {}
        for op in self.program:
            if op.kind is OpKind.BACKWARD:
                self.last_backward[op.chunk] = op
        self.transport.start_call(pp_group=pp_group, device=self.device, timeout=self.timeout, locate=self._where,
                                  retire=self._retire_send, uses_links=any(op.kind.is_p2p for op in self.program))
        self.placement = {} if forward_only else plan.placement
        self.sharding = None if forward_only or owner.sharding is None else owner.sharding.program(model)
        self.meter = None
        if owner.options.measure_memory and not forward_only:
            self.meter = make_memory_meter(self.device, model_tensors(model))
        self.offloader = None
        self.host_keys = set(self.schedule.options.host_placement)
        self.offloaded: Dict[Tuple[int, int], int] = {}
        # Host-placed keys bypass any outer saved-tensor hooks (only the innermost see the tensors), so a
        # caller measuring the whole call (the bench) is given their saves and copies explicitly.
        self.host_meter = None
        if any(op.kind.is_host for op in self.program):
            self.offloader = owner.offloader(self.device)
            self.host_meter = self.meter if self.meter is not None else ambient_meter()
            self.offloader.begin(model_tensors(model), self.host_meter)
            # The pinned pool is sized now, before any receive is posted (a pinned allocation inside an OFFLOAD would
            # run while posted NCCL receives spin on the device).
            sizes = {chunk: size for (rank, chunk), size in plan.host_blocks.items() if rank == self.pp_rank}
            self.offloader.reserve(pool_blocks(self.program, sizes))

    # Helpers -------------------------------------------------------------------------------
    def _disable_grad_sync(self):
        if self.no_sync_context is None:
            self.no_sync_context = self.no_sync_func()
            self.no_sync_context.__enter__()

    def _enable_grad_sync(self):
        if self.no_sync_context is not None:
            self.no_sync_context.__exit__(None, None, None)
            self.no_sync_context = None

    def _where(self, step: int, op: Op) -> str:
        return (f"rank {self.rank} (pipeline rank {self.pp_rank}), step {step} ({op}) of plan "
                f"{self.schedule.digest()} [{self.schedule.config.describe()}]")

    def _link(self, direction: str, src_pp: int, dst_pp: int) -> LinkKey:
        """The link from pipeline rank ``src_pp`` to ``dst_pp`` in ``direction`` ('F' activations, 'B' gradients)."""
        return direction, self.pp_ranks[src_pp], self.pp_ranks[dst_pp]

    def _retire_send(self, op: Op, tensor: torch.Tensor) -> None:
        """A send completed: free a sent activation as Megatron's ``deallocate_output_tensor`` does."""
        if op.kind is OpKind.SEND_FORWARD:
            self.mcore.deallocate_output_tensor(tensor, self.config.deallocate_pipeline_outputs)
            if self.meter is not None and self.config.deallocate_pipeline_outputs:
                self.meter.untrack((op.chunk, op.microbatch))

    # Main loop -----------------------------------------------------------------------------
    def execute(self):
        mcore, config, model = self.mcore, self.config, self.model
        stats = RuntimeStats(self.rank, self.pp_rank, self.schedule.digest(), self.forward_only)
        if self.meter is not None:
            self.meter.begin()
        self.owner._check_same_plan(self.schedule, self.rank)
        embedding_module = None
        if config.finalize_model_grads_func is not None and not self.forward_only:
            embedding_module = mcore.clear_embedding_activation_buffer(config, model, self.pp_rank == self.pp - 1)
        if config.timers is not None:
            config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
            self.timer_started = True
        try:
            self._disable_grad_sync()
            if self.sharding is not None:
                self.sharding.begin(measure=self.owner.training_calls == 1)  # reported after the second call
            forward_data_store = self._run_program(stats, embedding_module)
        except BaseException as error:
            self._abandon(error)
            raise
        self.owner.last_stats = stats
        if self.sharding is not None:
            self.owner.training_calls += 1
            if self.owner.training_calls == 2:  # the optimizer state exists from the first step on
                from .sharding import format_report
                print(format_report(self.sharding, self.schedule.config, self.rank, self.pp_rank), flush=True)
        return forward_data_store

    def _abandon(self, error: BaseException) -> None:
        """Leave Megatron as the call found it after ``error``: DDP's ``no_sync`` exited, the
        ``forward-backward`` timer stopped, posted receives accounted for and sends in flight kept alive until they
        complete (:meth:`.PipelineTransport.abandon`)."""
        if self.sharding is not None:
            with contextlib.suppress(Exception):
                self.sharding.end()
        if self.no_sync_context is not None:
            context, self.no_sync_context = self.no_sync_context, None
            with contextlib.suppress(Exception):
                context.__exit__(type(error), error, error.__traceback__)
        if self.timer_started:
            self.timer_started = False
            with contextlib.suppress(Exception):
                self.config.timers("forward-backward").stop()
            # Megatron's forward_step/backward_step leave their own timer running when the step raises,
            # and its Timer.start asserts on the next call.
            for name in ("forward-compute", "backward-compute"):
                with contextlib.suppress(Exception):
                    timer = self.config.timers(name, log_level=2)
                    if getattr(timer, "_started", False):
                        timer.stop()
        self.transport.abandon()
        if self.offloader is not None:
            self.offloader.clear()

    def _op_range(self, op: Op):
        return torch.profiler.record_function(f"PipeMesh {op}")

    def _run_program(self, stats: RuntimeStats, embedding_module):
        state = _CallState(torch.zeros([], dtype=torch.int, device=self.device))
        begin = time.perf_counter()
        for step, op in enumerate(self.program):
            start, start_event = self.clock.mark() if op.kind.is_compute else (time.perf_counter(), None)
            wait_s = compute_s = 0.0
            events = None
            if self.sharding is not None:
                self.sharding.before(op)  # counts syncs; compute waits for its chunk's gather / gradient buffer
            with self._op_range(op):
                if op.kind.is_compute:
                    wait_s, compute_s, events = self._run_compute(step, op, state, start, start_event)
                else:
                    self._run_comm(step, op, state)
            stats.records.append(OpRecord(step, str(op), start - begin, wait_s, compute_s, events))
            self.transport.drain_sends(step)
        self._finish(stats, state, embedding_module, begin)
        return state.forward_data_store

    def _run_comm(self, step: int, op: Op, state: "_CallState") -> None:
        """A pipeline transfer, a data-parallel sync, a sharding op or a host copy."""
        kind, transport, model = op.kind, self.transport, self.model
        if kind in (OpKind.RECV_FORWARD, OpKind.RECV_BACKWARD):
            forward = kind is OpKind.RECV_FORWARD
            buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device, requires_grad=forward)
            transport.post_receive(op, buffer, self._link("F" if forward else "B", op.peer, self.pp_rank), step)
        elif kind in (OpKind.SEND_FORWARD, OpKind.SEND_BACKWARD):
            forward = kind is OpKind.SEND_FORWARD
            if forward:  # training keeps the output (its graph) for the backward
                tensor = state.outputs.pop(op.compute) if self.forward_only else state.outputs[op.compute]
            else:
                tensor = state.input_grads.pop(op.compute)
            transport.send(op, tensor, self._link("F" if forward else "B", self.pp_rank, op.peer), step)
        elif kind is OpKind.PARAM_SYNC:
            self.param_sync_func[op.chunk](model[op.chunk].parameters())
        elif kind is OpKind.GRAD_SYNC:
            self._enable_grad_sync()
            self.grad_sync_func[op.chunk](model[op.chunk].parameters())
            state.synced.add(op.chunk)
            self._disable_grad_sync()
        elif kind.is_shard:
            self.sharding.run(op)
        elif kind.is_host:
            self._host_copy(step, op, state.inputs, state.outputs)

    def _run_compute(self, step: int, op: Op, state: "_CallState", start: float, start_event):
        """A forward or backward once its received tensor is ready: (wait seconds, compute seconds, CUDA events)."""
        received = self.transport.wait_receive(
            op, step, "receive of its input" if op.kind is OpKind.FORWARD else "receive of its output gradient")
        ready, ready_event = self.clock.mark()
        if op.kind is OpKind.FORWARD:
            output, num_tokens = self._forward(step, op, received, state.forward_data_store)
            state.total_num_tokens += num_tokens
            if not self.forward_only:
                state.inputs[op], state.outputs[op] = received, output
            elif op in self.sent:
                state.outputs[op] = output  # until its SEND; evaluation keeps nothing else
        else:
            self._backward(step, op, received, state)
        end, end_event = self.clock.mark()
        return ready - start, end - ready, (start_event, ready_event, end_event) if start_event is not None else None

    def _backward(self, step: int, op: Op, received, state: "_CallState") -> None:
        forward_op = F(op.chunk, op.microbatch)
        if self.grad_sync_func is None and self.last_backward.get(op.chunk) == op:
            self._enable_grad_sync()  # DDP hooks reduce this chunk's grads during its last backward
            state.synced.add(op.chunk)
        # Megatron's custom_backward expects the sent output already deallocated.
        self.transport.drain_sends(step, only=forward_op)
        host = self._host_placed(op)
        if host:
            self._host_step(step, op, lambda key: self.offloader.wait(key))
        with self._recompute(op):  # the backward's replay takes the forward's path
            grad = self.mcore.backward_step(state.inputs.pop(forward_op), state.outputs.pop(forward_op), received,
                                            self.config)
        if self.meter is not None:
            self.meter.release((op.chunk, op.microbatch))
        if host:
            if self.host_meter is not None and self.host_meter is not self.meter:
                self.host_meter.release((op.chunk, op.microbatch))
            self.offloader.release((op.chunk, op.microbatch))
        self._disable_grad_sync()
        if grad is not None:
            state.input_grads[op] = grad

    def _finish(self, stats: RuntimeStats, state: "_CallState", embedding_module, begin: float) -> None:
        """After the program: sends drained, the remaining gradient reductions launched (as Megatron does after its
        cool-down), the model's gradients finalized, the timer stopped and the call's statistics filled in."""
        mcore, config, model = self.mcore, self.config, self.model
        drain = time.perf_counter()
        self.transport.drain_sends(len(self.program), block=True)
        stats.send_drain_s = time.perf_counter() - drain
        self.transport.end_call()
        if self.sharding is not None:
            self.sharding.end()
        self._enable_grad_sync()
        if self.grad_sync_func is not None:
            for chunk in range(self.vpp):
                if chunk not in state.synced:
                    self.grad_sync_func[chunk](model[chunk].parameters())
        if config.finalize_model_grads_func is not None and not self.forward_only:
            mcore.finish_embedding_wgrad_compute(config, embedding_module, self.pp_rank == self.pp - 1, self.pg_collection.tp)
            finalize = time.perf_counter()
            config.finalize_model_grads_func(
                model, state.total_num_tokens if config.calculate_per_token_loss else None,
                pg_collection=self.pg_collection, force_all_reduce=self.force_all_reduce)
            stats.dp_sync_s = time.perf_counter() - finalize
        if self.timer_started:
            self.timer_started = False
            config.timers("forward-backward").stop()
        stats.total_s = time.perf_counter() - begin
        if self.offloader is not None:
            stats.peak_host_bytes = int(self.offloader.peak_host_bytes)
            stats.peak_block_bytes = int(self.offloader.peak_block_bytes)
            stats.offloaded_bytes = dict(self.offloaded)
            self.offloader.clear()
            pool = self.offloader.pool
            if pool.late_allocations and not pool.late_reported:
                pool.late_reported = True  # once per pool: later calls allocate nothing more
                print(f"PipeMesh: rank {self.rank}: {pool.late_allocations} pinned host block(s) were allocated inside "
                      f"OFFLOAD (pool now {pool.allocated_bytes / 2**30:.2f} GiB): the plan priced some host-placed "
                      "chunk-micro-batches below the bytes their forward saved", flush=True)
        if self.meter is not None:
            stats.memory_source = self.meter.kind
            stats.peak_activation_bytes = int(self.meter.peak_bytes)
            stats.saved_bytes = {key: int(v) for key, v in self.meter.saved_bytes.items()}
            stats.output_bytes = {key: int(v) for key, v in self.meter.tracked_bytes.items()}

    def _recompute(self, op: Op):
        """The recompute switches of ``op``'s chunk-micro-batch; a plan without placement leaves Megatron's own
        ``--recompute-*`` settings alone, a plan with one sets every op's (host-placed ones recompute nothing)."""
        if not self.placement:
            return contextlib.nullcontext()
        return recompute_scope(self.model[op.chunk], self.placement.get((self.pp_rank, op.chunk, op.microbatch), DEVICE))

    def _host_placed(self, op: Op) -> bool:
        """Whether ``op``'s chunk-micro-batch keeps its activations in host memory (this call's plan)."""
        return self.offloader is not None and (self.pp_rank, op.chunk, op.microbatch) in self.host_keys

    def _host_step(self, step: int, op: Op, action):
        """Run one host-placement action on ``op``'s key; failures name rank, step and op."""
        try:
            return action((op.chunk, op.microbatch))
        except Exception as error:
            raise PipeMeshRuntimeError(f"{self._where(step, op)}: host placement failed: {error}") from error

    def _host_copy(self, step: int, op: Op, inputs, outputs) -> None:
        """OFFLOAD: launch the copy of the forward's saved tensors to host memory (the chunk's input goes too,
        its ``.data`` emptied until the reload; the output stays: it is the backward's root, freed after its send
        by Megatron's deallocation); RELOAD: launch the copy back."""
        if op.kind is OpKind.OFFLOAD:
            forward = op.compute
            keep, swap = (outputs.get(forward),), (inputs.get(forward),)
            self.offloaded[(op.chunk, op.microbatch)] = self._host_step(
                step, op, lambda key: self.offloader.offload(key, keep, swap, roots=keep))
        else:
            self._host_step(step, op, self.offloader.reload)

    def _forward(self, step: int, op: Op, received, forward_data_store):
        chunk, microbatch = op.chunk, op.microbatch
        last = chunk == self.vpp - 1 and self.pp_rank == self.pp - 1
        hooks = self._host_step(step, op, self.offloader.hooks) if self._host_placed(op) else None
        meter = self.meter if self.meter is not None else (self.host_meter if hooks else None)
        # Host-placed saved tensors get per-tensor hooks at OFFLOAD (see .offload: default hooks would hand the
        # backward new objects for saved Parameters); only a saved-tensor meter, whose default hooks hide the
        # tensors from per-tensor ones, runs the offloader's hooks inside its own.
        inner = hooks if meter is not None and meter.kind == SavedTensorMeter.kind else None
        saved = meter.record((chunk, microbatch), inner=inner) if meter is not None else contextlib.nullcontext()
        with self._recompute(op), saved:
            output, num_tokens = self._forward_step(op, received, forward_data_store, last)
        if self.meter is not None and not last:
            self.meter.track((chunk, microbatch), output)  # kept for the send and the backward
        if meter is not None:
            meter.hold_input((chunk, microbatch), received)  # kept until the backward (counted on CUDA)
        return output, num_tokens

    def _forward_step(self, op: Op, received, forward_data_store, last: bool):
        chunk, microbatch = op.chunk, op.microbatch
        return self.mcore.forward_step(
            self.forward_step_func, self.data_iterator[chunk], self.model[chunk], self.m, received,
            forward_data_store, self.config, self.cp_size,
            collect_non_loss_data=self.collect_non_loss_data,
            checkpoint_activations_microbatch=None,
            is_first_microbatch=self.mcore.check_first_val_step(self.first_val_step, self.forward_only, microbatch == 0),
            current_microbatch=microbatch, vp_stage=chunk, is_last_stage=last)
