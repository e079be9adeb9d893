"""CPU (gloo) compatibility layer for megatron-core 0.19.2.

megatron-core assumes CUDA in a few places that have nothing to do with the maths.  On a machine
without CUDA, :func:`apply_cpu_compat` patches exactly those places so that Megatron's GPT model,
schedules, DDP wrapper, optimizer and ``pretrain()`` run on CPU with the gloo backend.  It does
nothing at all when ``torch.cuda.is_available()``.  Each item names the upstream place (file:line in
megatron-core 0.19.2) it works around; ``docs/cpu.md`` explains them in more detail. One item is torch's, not
Megatron's: gloo groups get one worker thread (item 14, :func:`set_gloo_worker_threads`), since torch's two corrupt
the heap under overlapped collectives.

:func:`cpu_megatron_args` lists the Megatron command-line flags a CPU run needs (local transformer
implementation, CPU initialization, no fused kernels, gloo); :func:`missing_cpu_args` keeps only the
ones a given argv does not already set, so a single command line works on CPU and on GPU. Megatron's default
``--gradient-accumulation-fusion`` stays on (item 12 provides its kernels), so CPU runs take the ``main_grad`` path
of GPU runs; ``--no-gradient-accumulation-fusion`` still turns it off.

Not solved (GPU-only): CUDA graphs; combined 1F1B.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from typing import Iterable, List, Optional, Sequence

import torch
from torch.overrides import TorchFunctionMode

__all__ = [
    "apply_cpu_compat",
    "cpu_compat_active",
    "cpu_megatron_args",
    "missing_cpu_args",
    "set_gloo_worker_threads",
    "CudaToCpuMode",
    "RNG_FORK_WARNING",
]

_ACTIVE = False
_MODE: Optional[TorchFunctionMode] = None


# --------------------------------------------------------------------------------------------------
# Device mapping ("cuda" / int devices -> cpu) for factory calls and Tensor.to/.cuda
# --------------------------------------------------------------------------------------------------
def _map_device(device):
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return "cpu"
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA devices to CPU in every torch call; ``Tensor.cuda()``/``record_stream`` no-ops.

    Works around the unconditional ``device="cuda"`` factory calls, e.g. ``total_num_tokens`` in
    ``pipeline_parallel/schedules.py:749,1121,2292``, the p2p receive buffers on
    ``torch.cuda.current_device()`` (``p2p_communication.py:211-223,334,342``), ``clip_grads.py:96,108``,
    ``utils.py:1332`` (``local_multi_tensor_l2_norm``) and RoPE's ``inv_freq.to(device=...)``
    (``models/common/embeddings/rotary_pos_embedding.py:162``).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.record_stream:
            return None
        if "device" in kwargs:
            kwargs["device"] = _map_device(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0],) + tuple(_map_device(a) for a in args[1:])
        return func(*args, **kwargs)


# --------------------------------------------------------------------------------------------------
# Dummy streams / events (no device queue exists on CPU)
# --------------------------------------------------------------------------------------------------
class _DummyEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        return None

    def wait(self, stream=None):
        return None

    def synchronize(self):
        return None

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class _DummyStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        return None

    def wait_event(self, event):
        return None

    def record_event(self, event=None):
        return event if event is not None else _DummyEvent()

    def synchronize(self):
        return None

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_DEFAULT_STREAM = _DummyStream()


# --------------------------------------------------------------------------------------------------
# RNG: the "CUDA" RNG tracker uses the CPU default generator
# --------------------------------------------------------------------------------------------------
def _cpu_get_rng_state(device="cuda", clone=False, graph_safe=False):
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed):
    torch.default_generator.manual_seed(int(seed))


#: Logged by ``CudaRNGStatesTracker.fork`` (``tensor_parallel/random.py:326-333``) when the CPU default
#: generator moved inside a fork.
RNG_FORK_WARNING = "CPU RNG state changed within GPU RNG context"


class _OneGeneratorForkFilter(logging.Filter):
    """Drops :data:`RNG_FORK_WARNING`, and only it, while the CPU layer is active.

    ``fork()`` records ``torch.get_rng_state()`` after switching to the tracker's state and warns if it
    differs on exit, to catch CPU randomness drawn inside a GPU fork.  Here the "CUDA" generator *is* the
    CPU default generator (item 1), so the check compares the fork's own stream with itself and fires on
    every dropout inside it (attention dropout, ``dot_product_attention.py:217``: once per micro-batch and
    chunk).  Nothing can leak: ``fork()`` restores the default stream on exit (random.py:340-346).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != RNG_FORK_WARNING


# --------------------------------------------------------------------------------------------------
# Gradient clipping without the torch.cuda.FloatTensor assertion
# --------------------------------------------------------------------------------------------------
def _clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Same contract as ``megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32``."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = []
    for param in parameters:
        grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if grad is None:
            continue
        assert grad.dtype in (torch.float32, torch.bfloat16) if use_decoupled_grad else (
            grad.dtype == torch.float32
        ), f"clip_grad_by_total_norm_fp32 expects fp32 gradients, got {grad.dtype}"
        grads.append(grad.detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if isinstance(clip_coeff, torch.Tensor):
        clip_coeff = clip_coeff.clamp_max(1.0)
        for g in grads:
            g.mul_(clip_coeff.to(g.dtype))
    elif clip_coeff < 1.0:
        for g in grads:
            g.mul_(clip_coeff)


# --------------------------------------------------------------------------------------------------
# Autocast: forward_step hard-codes device_type "cuda"
# --------------------------------------------------------------------------------------------------
class _CpuAutocast(torch.autocast):
    """``torch.autocast("cuda", ...)`` -> CPU autocast (``schedules.py:504``, ``--enable-autocast``)."""

    def __init__(self, device_type, *args, **kwargs):
        super().__init__("cpu" if device_type == "cuda" else device_type, *args, **kwargs)


# --------------------------------------------------------------------------------------------------
# Distributed optimizer: CUDA tensor type names in its dtype dispatch
# --------------------------------------------------------------------------------------------------
class _CudaTypeNameMode(TorchFunctionMode):
    """``Tensor.type()`` (no argument) of a CPU tensor reports the CUDA name, e.g. ``torch.cuda.FloatTensor``.

    Entered only around ``DistributedOptimizer.__init__``, whose parameter sorting dispatches on those
    names (``distrib_optimizer.py:401,466,758``) and rejects anything else (``:477``).  Conversions
    (``Tensor.type(dtype)``) pass through unchanged.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and args[0].device.type == "cpu":
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        return func(*args, **kwargs)


def _with_cuda_type_names(init):
    @functools.wraps(init)
    def wrapped(*args, **kwargs):
        with _CudaTypeNameMode():
            return init(*args, **kwargs)

    return wrapped


def _patch_distributed_optimizer() -> None:
    """Item 11: let ``DistributedOptimizer`` accept CPU parameters (see :class:`_CudaTypeNameMode`)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    DistributedOptimizer.__init__ = _with_cuda_type_names(DistributedOptimizer.__init__)


# --------------------------------------------------------------------------------------------------
# Gradient-accumulation fusion: the two wgrad kernels of APEX's fused_weight_gradient_mlp_cuda in torch
# --------------------------------------------------------------------------------------------------
class TorchWgradKernels:
    """Stands in for APEX's ``fused_weight_gradient_mlp_cuda`` extension: ``main_grad += grad_output^T @ input``
    accumulated in ``main_grad``'s dtype, as Megatron calls it from ``LinearWithGradAccumulationAndAsyncCommunication.
    backward`` (``tensor_parallel/layers.py:680-686``) and ``drain_embedding_wgrad_compute`` (``utils.py:1279``), on
    the 2-D tensors ``prepare_input_tensors_for_wgrad_compute`` made."""

    __name__ = "fused_weight_gradient_mlp_cuda"

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        """fp32 ``main_grad``; 16-bit inputs are multiplied in fp32, as the CUDA kernel accumulates."""
        main_grad.addmm_(grad_output.t().to(main_grad.dtype), total_input.to(main_grad.dtype))

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        """16-bit ``main_grad`` (fp16 or bf16)."""
        main_grad.addmm_(grad_output.t(), total_input)


def _map_devices_in_backward() -> None:
    """Item 6 for autograd's backward: the engine runs a custom Function's backward without the Python torch-function
    modes of the calling thread, so :class:`CudaToCpuMode` does not see the ``device=torch.cuda.current_device()``
    allocations Megatron's fused-wgrad backward makes (the dummy wgrad, ``layers.py:713-718``; the sequence-parallel
    buffers, ``layers.py:647``). Megatron's Functions run their backward inside the mode."""
    from torch.autograd.function import BackwardCFunction

    original = BackwardCFunction.apply
    if getattr(original, "_pipemesh_cpu", False):
        return

    @functools.wraps(original)
    def apply(self, *args):
        if torch._C._is_torch_function_mode_enabled():
            return original(self, *args)
        with CudaToCpuMode():
            return original(self, *args)

    apply._pipemesh_cpu = True
    BackwardCFunction.apply = apply


def _provide_wgrad_kernels() -> None:
    """Item 12: keep Megatron's default ``--gradient-accumulation-fusion`` (the ``main_grad`` path every GPU run
    takes) on CPU: where the CUDA extension cannot be imported, Megatron's linear layers and its embedding wgrad
    drain get :class:`TorchWgradKernels` (``layers.py:49-53`` sets ``_grad_accum_fusion_available`` from the
    import, and ``ColumnParallelLinear`` raises without it, ``layers.py:1070``)."""
    from megatron.core.tensor_parallel import layers

    if layers._grad_accum_fusion_available:
        return
    sys.modules.setdefault(TorchWgradKernels.__name__, TorchWgradKernels)
    layers.fused_weight_gradient_mlp_cuda = TorchWgradKernels
    layers._grad_accum_fusion_available = True


def _moe_split_sizes_as_numpy() -> None:
    """Item 15: the all-to-all token dispatcher moves its split sizes to the host with ``maybe_move_tensor_to_cpu(...,
    as_numpy=True)`` (``transformer/moe/moe_utils.py:1169-1190``), which converts only a CUDA tensor; on CPU the
    splits stay tensors and torch's ``all_to_all_single`` binding refuses them (it takes sequences of ints). The
    token dispatcher's name for the function gets one that also converts a CPU tensor when asked for numpy."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu
    if getattr(original, "_pipemesh_cpu", False):
        return

    @functools.wraps(original)
    def move(tensor, as_numpy: bool = False, record_stream: bool = False):
        out = original(tensor, as_numpy=as_numpy, record_stream=record_stream)
        return out.numpy() if as_numpy and torch.is_tensor(out) and not out.is_cuda else out

    move._pipemesh_cpu = True
    token_dispatcher.maybe_move_tensor_to_cpu = move


def _jit_warmup_only_for_fusions_in_use() -> None:
    """Item 13: ``set_jit_fusion_options`` (``training/initialize.py:473``, called from ``training.py:1117``) runs
    ``_warmup_jit_function`` (``initialize.py:497-551``), which ``torch.compile``s the fused bias+GeLU/SwiGLU and
    bias+dropout+add whether or not the model uses them: on CPU, where the fusions are off (the flags above), it
    compiles C++ kernels nobody calls for about 12 s per rank. The warm-up still runs when a fusion is on."""
    import megatron.training.initialize as mt_init

    original = mt_init._warmup_jit_function
    if getattr(original, "_pipemesh_cpu", False):
        return

    @functools.wraps(original)
    def warmup(*args, **kwargs):
        run_args = mt_init.get_args()
        activation = run_args.bias_swiglu_fusion if run_args.swiglu else run_args.bias_gelu_fusion
        if activation or run_args.bias_dropout_fusion:
            return original(*args, **kwargs)
        return None

    warmup._pipemesh_cpu = True
    mt_init._warmup_jit_function = warmup


GLOO_WORKER_THREADS = 1
"""Worker threads of each gloo process group created once the layer is active (torch's default is 2)."""


def _gloo_devices(gloo) -> list:
    """The devices torch's ``ProcessGroupGloo(store, rank, size, timeout)`` picks (torch/csrc/distributed/c10d/init.cpp):
    one per interface of ``GLOO_SOCKET_IFNAME`` (comma-separated), else the one the hostname resolves to."""
    interfaces = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if len(interfaces) > 1:
        return [gloo.create_device(interface=name) for name in interfaces.split(",")]
    return [gloo.create_default_device()]


def set_gloo_worker_threads(threads: int) -> None:
    """Item 14: every gloo group created from now on runs its collectives on ``threads`` worker threads (torch's
    default is 2); a later call changes the number for the groups created after it.

    Why: ``ProcessGroupGloo`` (torch 2.13, ``ProcessGroupGloo::Options::threads``, built by
    ``distributed_c10d._new_process_group_helper``) executes a group's queued collectives on two worker threads at
    once. With Megatron's overlapped all-gathers and reduce-scatters in flight together on one data-parallel group,
    a worker thread now and then finds glibc's per-thread cache corrupted ("malloc(): unaligned tcache chunk
    detected" / SIGSEGV in ``tcp::UnboundBuffer``'s constructor): ``scripts/gloo_stress.py`` reproduces it with
    torch alone, without Megatron or PipeMesh, and not with one worker thread. One thread runs a group's
    collectives in issue order (still asynchronous to the caller; collectives of different groups still run at
    once). Groups created before keep their threads."""
    import torch.distributed.distributed_c10d as c10d

    if getattr(c10d.ProcessGroupGloo, "_pipemesh_threads", None) is not None:
        c10d.ProcessGroupGloo._pipemesh_threads = threads
        return
    base = c10d.ProcessGroupGloo

    class ProcessGroupGloo(base):  # a subclass: torch checks isinstance(backend, ProcessGroupGloo)
        _pipemesh_threads = threads

        def __init__(self, store, rank, size, timeout=None):
            if isinstance(timeout, base._Options):  # the constructor's other form: (store, rank, size, options)
                options = timeout
            else:
                options = base._Options()
                if timeout is not None:
                    options._timeout = timeout
                options._devices = _gloo_devices(base)
            options._threads = type(self)._pipemesh_threads
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = ProcessGroupGloo


def cpu_compat_active() -> bool:
    """True once :func:`apply_cpu_compat` has patched this process."""
    return _ACTIVE


def apply_cpu_compat() -> bool:
    """Patch torch.cuda / megatron-core so Megatron runs on CPU with gloo.

    Idempotent.  Returns True if the layer is active, False if CUDA is available (nothing patched).
    Importing ``megatron`` first requires :func:`~megatron_pipemesh.integration.bootstrap.
    prepare_megatron_import` on stacks without triton / Python < 3.12; this function calls it.
    """
    global _ACTIVE
    if _ACTIVE:
        return True
    if torch.cuda.is_available():
        return False

    from megatron_pipemesh.integration.bootstrap import prepare_megatron_import

    prepare_megatron_import()
    _patch_cuda_rng()  # 1
    _patch_cuda_runtime()  # 2-5
    _map_cuda_to_cpu()  # 6-7
    _patch_megatron_start_up()  # 8-9
    _patch_cuda_type_checks()  # 10-11
    # 12. Gradient-accumulation fusion without APEX's CUDA extension (layers.py:49-53,680-686, utils.py:1248).
    _provide_wgrad_kernels()
    # 13. The JIT warm-up compiles fused kernels the CPU run does not use (initialize.py:497).
    _jit_warmup_only_for_fusions_in_use()
    # 14. Not Megatron's: torch's gloo runs a group's asynchronous collectives on two worker threads, which now and
    #     then corrupt the heap (torch 2.13, distributed_c10d._new_process_group_helper builds the group).
    set_gloo_worker_threads(GLOO_WORKER_THREADS)
    # 15. MoE's all-to-all dispatcher hands its split sizes to all_to_all_single as they come back from the device
    #     (moe_utils.py:1169-1190 makes numpy arrays of CUDA tensors only; token_dispatcher.py:930-945).
    _moe_split_sizes_as_numpy()
    # 16. Not Megatron's: glibc's malloc moves its mmap threshold with what the process freed before, so two runs of
    #     one command fault in and return pages differently (3-4 k page faults per layer call; medians 15-20% apart).
    fixed_allocator_thresholds()

    _ACTIVE = True
    return True


MALLOC_MMAP_THRESHOLD = 32 * 2 ** 20
"""Allocations above this go to mmap (glibc's largest fixed threshold on 64-bit); a fixed one stops the dynamic one."""
MALLOC_TRIM_THRESHOLD = 2 ** 30
"""Free memory kept at the heap's top before glibc returns it: the next step reuses it instead of faulting it in."""


def fixed_allocator_thresholds() -> bool:
    """16. Fix glibc malloc's mmap and trim thresholds (``mallopt``): activations of a few MiB are then served from
    the heap the previous step freed, not from fresh pages. Measured on a Llama-style layer's forward + backward
    (scripts/profile_allocator_check.py, one core): 3100-4100 page faults per call and 55-58 ms with an IQR of 8-12%
    before, 0 faults and 46-47 ms with an IQR of 1-3% after. False where there is no glibc (nothing changed)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    return bool(mallopt(m_trim_threshold, MALLOC_TRIM_THRESHOLD)) and bool(mallopt(m_mmap_threshold,
                                                                                   MALLOC_MMAP_THRESHOLD))


def _patch_cuda_rng() -> None:
    """1. RNG tracker: tensor_parallel/random.py:303-308 (CudaRNGStatesTracker.add) and random.py:104-175
    (_get/_set_cuda_rng_state, used by fork()) use the CUDA generator."""
    cuda = torch.cuda
    cuda.get_rng_state = _cpu_get_rng_state
    cuda.random.get_rng_state = _cpu_get_rng_state
    cuda.set_rng_state = _cpu_set_rng_state
    cuda.random.set_rng_state = _cpu_set_rng_state
    cuda.manual_seed = _cpu_manual_seed
    cuda.random.manual_seed = _cpu_manual_seed
    from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_cuda_rng_state = _cpu_get_rng_state
    tp_random._set_cuda_rng_state = _cpu_set_rng_state
    #    ... which makes fork()'s "CPU RNG changed" check (random.py:326-333) fire on every dropout.
    logging.getLogger(tp_random.__name__).addFilter(_OneGeneratorForkFilter())


def _patch_cuda_runtime() -> None:
    """2-5. One device that is always there, synchronizes at once and runs every stream and event inline."""
    cuda = torch.cuda
    # 2. current_device(): p2p_communication.py:211-223,334,342 (buffers), RoPE :162, initialize.py:131.
    cuda.current_device = lambda: 0
    # 3. device_count()/set_device(): initialize.py:270-283,358 skip initialize_model_parallel and the
    #    RNG seeding (:447) when no device is counted.
    cuda.device_count = lambda: 1
    cuda.set_device = lambda device: None
    # 4. synchronize(): p2p_communication.py:263,419 (batch_p2p_sync), timers, training loop.
    cuda.synchronize = lambda device=None: None
    # 5. Streams/events: DDP init stream (training/models/dist_utils.py:303), param_and_grad_buffer.py:632.
    cuda.Stream = _DummyStream
    cuda.Event = _DummyEvent
    cuda.current_stream = lambda device=None: _DEFAULT_STREAM
    cuda.default_stream = lambda device=None: _DEFAULT_STREAM
    cuda.stream = lambda stream=None: contextlib.nullcontext(stream)
    cuda.set_stream = lambda stream: None


def _map_cuda_to_cpu() -> None:
    """6. "cuda"/int devices in factory calls and Tensor.to/.cuda (see CudaToCpuMode); 7. autocast: schedules.py:504
    uses torch.autocast("cuda") when config.enable_autocast."""
    global _MODE
    _MODE = CudaToCpuMode()
    _MODE.__enter__()
    _map_devices_in_backward()
    torch.autocast = _CpuAutocast


def _patch_megatron_start_up() -> None:
    """8. initialize_megatron asserts torch.cuda.is_available() (training/initialize.py:66); 9. _compile_dependencies
    (initialize.py:174) runs `make` in core/datasets; the wheel ships the prebuilt helpers_cpp extension but no
    Makefile."""
    import megatron.training
    import megatron.training.initialize as mt_init
    import megatron.training.training as mt_training

    original_init = mt_init.initialize_megatron

    @functools.wraps(original_init)
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original_init(*args, **kwargs)

    mt_init.initialize_megatron = initialize_megatron
    mt_training.initialize_megatron = initialize_megatron
    megatron.training.initialize_megatron = initialize_megatron

    import megatron.core.datasets.utils as ds_utils

    ds_utils.compile_helpers = lambda: None


def _patch_cuda_type_checks() -> None:
    """10. clip_grads.py:174 asserts param.grad.type() == 'torch.cuda.FloatTensor'; 11. distrib_optimizer.py:401,466,758
    sort parameters by CUDA tensor type names (:477 raises)."""
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as mcore_optimizer

    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    mcore_optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    _patch_distributed_optimizer()


# --------------------------------------------------------------------------------------------------
# Command-line flags a CPU run needs
# --------------------------------------------------------------------------------------------------
# (flag, value or None for store_true/store_false flags, flags that make this one redundant)
_CPU_ARGS = (
    ("--transformer-impl", "local", ()),
    ("--use-cpu-initialization", None, ()),
    ("--no-bias-gelu-fusion", None, ("--no-bias-swiglu-fusion",)),
    ("--no-bias-dropout-fusion", None, ()),
    ("--no-masked-softmax-fusion", None, ()),
    ("--no-persist-layer-norm", None, ()),
    ("--no-rope-fusion", None, ()),
    ("--distributed-backend", "gloo", ()),
)


def cpu_megatron_args() -> List[str]:
    """All Megatron flags a CPU run needs (local transformer, CPU init, no fused kernels, gloo)."""
    out: List[str] = []
    for flag, value, _ in _CPU_ARGS:
        out.append(flag)
        if value is not None:
            out.append(value)
    return out


def _given(argv: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def missing_cpu_args(argv: Iterable[str]) -> List[str]:
    """The part of :func:`cpu_megatron_args` that ``argv`` does not already set (in any value)."""
    argv = list(argv)
    out: List[str] = []
    for flag, value, alternatives in _CPU_ARGS:
        if _given(argv, flag) or any(_given(argv, alt) for alt in alternatives):
            continue
        out.append(flag)
        if value is not None:
            out.append(value)
    return out
