"""``pipemesh profile``: measure, on this machine and with Megatron's own modules of the user's command, what the
planner otherwise assumes (the file format is :mod:`..planning.profile`).

The command is read as ``pipemesh plan --megatron-args`` reads it (:func:`.megatron_command.read_command`, with the
flags a CPU run adds, as the training entry point adds them) and Megatron's ``TransformerConfig`` is built from its
args (``core_transformer_config_from_args``), with one transformer layer, TP = 1 and no pipeline: the layer spec,
dtype, dropout, fusions and recomputation settings are the command's. On one process it measures, at every
micro-batch size 1, 2, 4, ... up to the command's:

* one layer's forward and backward (a middle stage's ``GPTModel``: input from the previous stage, no embedding, no
  output layer), and again with each recompute level the planner chooses from (Megatron's own selective and full
  recomputation, configured by ``--recompute-granularity`` / ``--recompute-modules``): the extra over none;
* the embedding (``GPTModel.embedding``) and the final norm, output layer and loss
  (``compute_language_model_loss``), forward and backward;
* the bytes each keeps for its backward: on CPU the runtime's saved-tensor meter
  (:class:`..runtime.memory.SavedTensorMeter`: storages autograd saves, parameters excluded); on CUDA the caching
  allocator's count across the forward less its output, with the previous call's tensors freed before the first
  reading (``scripts/gpu_check.py``'s ``profile`` check holds the two within 10% of each other);
* the data loader per micro-batch (:mod:`.profile_batch`: the command's dataset and loader workers, the training
  entry's ``get_batch``);
* Megatron's schedule step beyond those pieces on each kind of chunk (:mod:`.profile_steps`);
* the optimizer per parameter: Megatron's own (``get_megatron_optimizer`` with the command's flags, the distributed
  optimizer included, over a one-layer model in Megatron's DDP on groups of the rank alone), zeroing the gradients
  and its ``step()``, as ``train_step`` runs them;
* on CUDA, the pinned host link (device-to-host and back, the slower).

Launched on several ranks (torchrun, Slurm: ``WORLD_SIZE`` > 1), every rank joins the job's process group, every rank
measures the optimizer at once (Megatron's DDP and optimizer take part in collectives over the job's groups; rank 0's
time is kept), then rank 0 measures the layers and, in a one-process child (Megatron's dataset builder synchronises
every rank of a job), the data loader (the others wait; a failure on any rank stops every rank), then every rank
times the links between them
(:mod:`.profile_links`: p2p, collectives, flows sharing a NIC) and rank 0 returns the profile. One process measures no
network: the plan keeps ``--nic-gbps`` and ``--intra-node-gbps``.

Timing: on CPU the wall clock with one thread (a rank's share), on CUDA CUDA events; warm-up calls, then the median
of the repeats. Weights get Megatron's ``main_grad`` buffers, as DDP gives them, so the backward accumulates as in
training. TP > 1 is not measured (it needs CUDA and a process group per rank).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import io
import logging
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..planning.profile import ComputePoint, Profile, dtype_name, shape_of
from ..schedule.levers import Lever

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ProfileSettings:
    """How much to measure."""

    warmup: int = 2
    """Calls before the timed ones (first-call allocations, lazy initialisation)."""
    repeats: int = 5
    """Timed calls; the median is kept."""
    max_micro_batch: Optional[int] = None
    """The largest micro-batch size measured (None: the command's); larger than the command's measures the sizes
    the advice may change it to (1, 2, 4, ... and this one)."""
    seed: int = 1234
    """Seed of the weights and inputs."""
    bucket_bytes: Optional[int] = None
    """The larger message the links are timed with (None: on CUDA Megatron's gradient bucket of the command,
    :func:`.profile_links.megatron_bucket_bytes`; on CPU :data:`.profile_links.CPU_BUCKET_BYTES`)."""
    ranks_per_node: int = 1
    """On CPU: the ranks that will compute at once on this machine; the compute is timed with that many cores
    computing (the others run the command's layer, :mod:`.profile_siblings`), at most the cores this process may
    use. Ignored on CUDA (each rank computes on a device of its own)."""


def micro_batch_sizes(largest: int) -> List[int]:
    """1, 2, 4, ... below ``largest``, and ``largest``."""
    sizes, size = [], 1
    while size < largest:
        sizes.append(size)
        size *= 2
    return sizes + [largest]


def _parallel_sizes(words: Sequence[str]) -> Tuple[int, int, int]:
    """(TP, PP, CP) the command asks for: the world size its validation needs with one data-parallel replica."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--context-parallel-size", type=int, default=1)
    known, _ = parser.parse_known_args(list(words))
    return known.tensor_model_parallel_size, known.pipeline_model_parallel_size, known.context_parallel_size


def _device_name(cuda: bool) -> str:
    import torch

    if cuda:
        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class _Timer:
    """Seconds of a block: CUDA events on CUDA, the wall clock on CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def __call__(self, fn: Callable[[], object]) -> Tuple[object, float]:
        import torch

        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            return out, start.elapsed_time(end) / 1e3
        began = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - began


@dataclass(frozen=True)
class Piece:
    """One piece the profile times (a layer at a recompute level, the embedding, the output layer and loss)."""

    forward: Callable[[], object]
    """Makes the piece's input (a layer's received activation) and runs its forward; returns the output."""
    release: Callable[[], None] = lambda: None
    """Drops what the last call left referenced beyond its output and graph (a layer's input tensor, which holds
    its gradient), so that freeing it cannot fall inside the next reading of the allocator."""


def _forward_backward(pieces: Dict[str, Piece], grad_of: Callable[[object], object], timer: _Timer,
                      settings: ProfileSettings, meter_exclude) -> Dict[str, Tuple[float, float, int]]:
    """Per name: (median forward s, median backward s, bytes kept for the backward) of ``forward`` then
    ``backward(grad)``. The pieces take turns in every round, so that a drift of the machine's speed (other
    processes, clocks) reaches them alike and their differences (a recomputation's extra) stay fair. The bytes kept:
    on CUDA what the allocator holds after the forward less its output (workspace and rounding included, as the
    device will hold them), with everything of the call before freed ahead of the first reading; on CPU the
    saved-tensor meter's count."""
    import torch

    from ..runtime.memory import SavedTensorMeter

    samples: Dict[str, Tuple[List[float], List[float]]] = {name: ([], []) for name in pieces}
    for call in range(settings.warmup + settings.repeats):
        for name, piece in pieces.items():
            out, forward_s = timer(piece.forward)
            gradient = grad_of(out)
            _, backward_s = timer(lambda: torch.autograd.backward(out, gradient))
            if call >= settings.warmup:
                samples[name][0].append(forward_s)
                samples[name][1].append(backward_s)
    out = gradient = None  # the last timed call's output and graph go before any reading
    found = {}
    for name, piece in pieces.items():
        piece.release()
        meter = SavedTensorMeter(meter_exclude)
        allocated = _allocated_bytes()
        with meter.record(name):
            out = piece.forward()
        kept = (_allocated_bytes() - allocated - _tensor_bytes(out) if allocated is not None
                else meter.saved_bytes.get(name, 0))
        torch.autograd.backward(out, grad_of(out))
        out = None  # with its graph (an output piece's input and that input's gradient hang on it)
        found[name] = (statistics.median(samples[name][0]), statistics.median(samples[name][1]), int(max(0, kept)))
    return found


def _allocated_bytes() -> Optional[int]:
    """Bytes the CUDA allocator holds once the device is idle; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _tensor_bytes(out) -> int:
    """Bytes of the tensors in ``out`` (a tensor, or a tuple / list / dict of them)."""
    import torch

    if isinstance(out, torch.Tensor):
        return out.numel() * out.element_size()
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return sum(_tensor_bytes(item) for item in out)
    return 0


def _with_main_grads(model) -> List:
    """Give every parameter an fp32 ``main_grad`` (what Megatron's DDP buffers are) and return the tensors."""
    import torch

    tensors = []
    for param in model.parameters():
        param.main_grad = torch.zeros_like(param, dtype=torch.float32)
        tensors += [param, param.main_grad]
    return tensors


def _level_args(args, level: str):
    """``args`` with the recomputation of ``level`` (a :class:`..schedule.levers.Lever` name) and one layer."""
    lever = Lever.parse(level)
    switches = lever.switches  # what the runtime sets for the lever, as Megatron's --recompute-* values
    out = copy.copy(args)
    out.num_layers = 1
    out.recompute_granularity, out.recompute_method = switches.granularity, switches.method
    out.recompute_num_layers = switches.num_layers
    if lever.is_selective:
        out.recompute_modules = sorted(lever.modules)
    return out


def _single_rank_args(args):
    """``args`` for one process: TP = PP = CP = 1, no layer split, no sequence parallelism."""
    out = copy.copy(args)
    out.tensor_model_parallel_size = out.pipeline_model_parallel_size = out.context_parallel_size = 1
    out.virtual_pipeline_model_parallel_size = None
    out.sequence_parallel = False
    for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                 "pipeline_model_parallel_layout"):
        if hasattr(out, name):
            setattr(out, name, None)
    for name in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
        if hasattr(out, name):
            setattr(out, name, False)
    return out


def _te_importable() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        return False


def _as_run_here(words: List[str], cuda: bool) -> List[str]:
    """The flags a run of ``words`` gets on this machine (the training entry point adds the same): on CPU the local
    layer spec, CPU initialisation, no fused kernels; on CUDA without Transformer Engine the local layer spec."""
    from .cpu_compat import _given, missing_cpu_args

    if not cuda:
        return words + missing_cpu_args(words)
    if not _te_importable() and not _given(words, "--transformer-impl"):
        return words + ["--transformer-impl", "local"]
    return words


def _layer_spec(args, use_te: bool):
    """Megatron's dense GPT layer spec of ``args`` (Transformer Engine's or the local one)."""
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                          get_gpt_layer_with_transformer_engine_spec)

    qk_l2_norm = getattr(args, "qk_l2_norm", False)
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(None, False, args.qk_layernorm, args.multi_latent_attention,
                                                          qk_l2_norm=qk_l2_norm)
    return get_gpt_layer_local_spec(None, False, args.qk_layernorm, args.multi_latent_attention,
                                    normalization=args.normalization, qk_l2_norm=qk_l2_norm)


def _start_process_group(cuda: bool) -> Callable[[], None]:
    """A one-rank process group and Megatron's parallel state (TP = PP = 1); returns the teardown."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    store_path = tempfile.mktemp(prefix="pipemesh-profile-")
    owned = not dist.is_initialized()
    if owned:
        if cuda:
            torch.cuda.set_device(0)
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.FileStore(store_path, 1), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)

    def stop() -> None:
        parallel_state.destroy_model_parallel()
        if owned:
            dist.destroy_process_group()
        if os.path.exists(store_path):
            os.remove(store_path)

    return stop


@contextlib.contextmanager
def _siblings(words: Sequence[str], settings: ProfileSettings, cuda: bool, progress: Progress, notes: List[str]):
    """On CPU with :attr:`ProfileSettings.ranks_per_node` > 1: the block runs with that many cores computing
    (:func:`.profile_siblings.busy_siblings`), noted where fewer cores are allowed; else as it is. Yields the cores
    computing."""
    from .profile_siblings import busy_siblings

    wanted = settings.ranks_per_node - 1
    if cuda or wanted < 1:
        if cuda and wanted >= 1:
            notes.append("--ranks-per-node is for CPU runs: each rank computes on a device of its own here")
        yield 1
        return
    with busy_siblings(words, wanted) as cores:
        if len(cores) < wanted:
            notes.append(f"timed with {len(cores) + 1} cores computing, not {wanted + 1} (--ranks-per-node): this "
                         f"process may use {len(cores) + 1}")
        progress(f"timing with {len(cores)} other core(s) computing the command's layer ({', '.join(map(str, cores))})")
        yield len(cores) + 1


def command_args(words: Sequence[str], cuda: bool):
    """(Megatron's args of the command ``words`` for one process on this machine, the command as the planner reads
    it, as it runs here): both read as ``pipemesh plan --megatron-args`` reads them. CommandError for what the
    profile cannot measure."""
    from .megatron_command import CommandError, read_command

    tp, pp, cp = _parallel_sizes(words)
    planned = read_command(list(words), world_size=tp * pp * cp)  # the command as the planner reads it
    run = read_command(_as_run_here(list(words), cuda), world_size=tp * pp * cp)  # as it runs on this machine
    if getattr(run.args, "num_experts", None) or getattr(run.args, "spec", None):
        raise CommandError("pipemesh profile measures dense GPT layers: --num-experts and --spec are not supported")
    args = _single_rank_args(run.args)
    args.padded_vocab_size = run.model.vocab_size  # set by the tokenizer in training; the planner pads it alike
    return args, planned, run


def measure_profile(words: Sequence[str], settings: ProfileSettings = ProfileSettings(),
                    progress: Progress = lambda line: None) -> Optional[Profile]:
    """Measure the profile of the command ``words`` (its flags, as ``pipemesh plan --megatron-args`` takes them).
    Launched on several ranks, every rank calls it and rank 0 gets the profile, the others None."""
    from .bootstrap import prepare_megatron_import
    from .profile_links import (CPU_BUCKET_BYTES, join_job, launched, measure_network, megatron_bucket_bytes,
                                message_sizes)

    launch = launched()
    prepare_megatron_import()
    import torch

    from .cpu_compat import apply_cpu_compat

    cuda = torch.cuda.is_available()
    if not cuda:
        apply_cpu_compat()
        torch.set_num_threads(1)  # one thread per rank, as the ranks will run
    args, planned, run = command_args(words, cuda)
    optimizer_config(args)  # refused here, before any process group or measurement, where Megatron refuses it
    model_spec = planned.model
    lead = launch is None or launch.rank == 0
    say = progress if lead else (lambda line: None)
    notes = ["TP > 1 is not measured: it needs CUDA and one process per rank (TP = 1 only)"] if not cuda else [
        "TP > 1 is not measured by this single-process profile (TP = 1 only)" if launch is None else
        "TP > 1 is not measured: rank 0 measures the layers alone (TP = 1 only)"]
    if launch is None:
        notes.append("the network (pipeline and data-parallel links) is not measured by one process: launch pipemesh "
                     "profile with torchrun on one node (intra-node link) or on two or more (the NIC); plans keep "
                     "--nic-gbps and --intra-node-gbps")
    if run.model.layer_spec != model_spec.layer_spec:
        notes.append(f"measured with the {run.model.layer_spec} layer spec (the command's {model_spec.layer_spec} "
                     "needs Transformer Engine, which this machine does not have); a run here uses the same")
    stop = _start_process_group(cuda) if launch is None else join_job(launch, cuda)
    network = None
    try:
        # Every rank, first: building Megatron's DDP and optimizer takes part in collectives over the job's groups,
        # and a command whose optimizer cannot be built here fails before the minutes of the compute.
        optimizer_s = _shared(launch, "the optimizer", lambda: _optimizer_s_per_param(args, run.model.layer_spec,
                                                                                     settings, cuda))
        say(f"optimizer step {optimizer_s * 1e9:.2f} ns per parameter")
        compute, host_gbps, computing = [], None, 1

        def measure_compute():
            with _siblings(words, settings, cuda, say, notes) as cores:
                points = _measure(args, model_spec, run.model.layer_spec, settings, cuda, say, notes)
                # Several ranks: Megatron's dataset builder would synchronise every rank of the job, so rank 0
                # times the loader in a one-process child of its own.
                return _with_batch_times(args, points, settings, say, notes,
                                         apart=None if launch is None else (list(words), launch.local_rank)), cores

        measured = _shared(launch, "the compute", measure_compute if lead else lambda: None)
        if lead:
            compute, computing = measured
        if cuda:
            host_gbps, rates = _shared(launch, "the host link", lambda: host_link_together(launch, settings))
            say(f"host link {host_gbps:.1f} Gbit/s (pinned copies, the slower direction"
                + (f"; the slowest of {len(rates)} ranks copying at once)" if rates else ")"))
            if launch is None:
                notes.append("the pinned host link was timed by this process alone: a node's ranks offloading at "
                             "once each get less; launch pipemesh profile with torchrun on a node's ranks to time "
                             "them together")
        if launch is not None:
            bucket = settings.bucket_bytes or (megatron_bucket_bytes(args.ddp_bucket_size, launch.world,
                                                                     _grad_bytes(args)) if cuda else CPU_BUCKET_BYTES)
            sizes = message_sizes(model_spec.micro_batch_size, model_spec.seq_length, model_spec.hidden_size,
                                  model_spec.dtype_bytes, bucket)
            network, link_notes = measure_network(launch, sizes, settings.warmup, settings.repeats, cuda, say)
            notes += link_notes
    finally:
        stop()
    if not lead:
        return None
    import megatron.core

    return Profile(
        device_kind="cuda" if cuda else "cpu", device_name=_device_name(cuda), torch_version=torch.__version__,
        megatron_core_version=getattr(megatron.core, "__version__", "unknown"),
        shape=shape_of(model_spec, dtype_name(planned.args)), compute=tuple(compute),
        optimizer_s_per_param=optimizer_s, host_link_gbps=host_gbps, network=network,
        method={"timer": "CUDA events" if cuda else "wall clock", "threads": None if cuda else 1,
                "cores_computing": None if cuda else computing,
                "warmup": settings.warmup, "repeats": settings.repeats, "statistic": "median",
                "activation_meter": ("CUDA allocator after the forward, less its output" if cuda else
                                     "saved-tensor meter (parameters excluded)"),
                "measured_layer_spec": run.model.layer_spec},
        notes=tuple(notes))


def _shared(launch, what: str, measure: Callable[[], object]):
    """``measure()`` on this rank; launched on several ranks, a failure on any rank stops every rank
    (:func:`.profile_links.share_failure`) instead of leaving the others waiting in the next collective."""
    from .profile_links import share_failure

    if launch is None:
        return measure()
    try:
        found = measure()
    except BaseException as error:
        share_failure(launch, f"{type(error).__name__}: {error}", what)
        raise
    share_failure(launch, None, what)
    return found


def _gpt(level_args, run_spec: str, settings: ProfileSettings, cuda: bool, pre: bool, post: bool):
    """(Megatron's ``GPTModel`` of ``level_args`` on this device, its ``TransformerConfig``): a middle stage, or with
    ``pre`` / ``post`` the embedding / the output layer and loss."""
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.training.argument_utils import core_transformer_config_from_args

    torch.manual_seed(settings.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(settings.seed)
    config = core_transformer_config_from_args(level_args)
    model = GPTModel(config=config, transformer_layer_spec=_layer_spec(level_args, run_spec == "te" and _te_importable()),
                     vocab_size=level_args.padded_vocab_size,
                     max_sequence_length=level_args.max_position_embeddings, pre_process=pre, post_process=post,
                     parallel_output=True,
                     share_embeddings_and_output_weights=not level_args.untie_embeddings_and_output_weights,
                     position_embedding_type=level_args.position_embedding_type,
                     rotary_percent=level_args.rotary_percent, rotary_base=level_args.rotary_base)
    return model.to(torch.device("cuda" if cuda else "cpu")), config


def _measure(args, model_spec, run_spec: str, settings: ProfileSettings, cuda: bool, progress: Progress,
             notes: List[str]):
    import torch

    from ..planning.costs import planning_levels
    from ..schedule.levers import DEVICE

    device = torch.device("cuda" if cuda else "cpu")
    timer = _Timer(cuda)

    def build(level_args, pre: bool, post: bool):
        return _gpt(level_args, run_spec, settings, cuda, pre, post)

    layer_models = {}
    for level in planning_levels(model_spec):
        try:
            layer_models[str(level)] = build(_level_args(args, level), pre=False, post=False)
        except (AssertionError, ValueError, RuntimeError, NotImplementedError) as error:
            notes.append(f"recompute level {level} not measured: Megatron refuses it here ({error})")
    ends, config = build(_level_args(args, str(DEVICE)), pre=True, post=True)
    excluded = [t for model, _ in layer_models.values() for t in _with_main_grads(model)] + _with_main_grads(ends)
    dtype = config.params_dtype
    s, h, vocab = args.seq_length, args.hidden_size, args.padded_vocab_size
    # Above the command's own size too when asked: the advice prices every micro-batch size it may change to.
    largest = settings.max_micro_batch or args.micro_batch_size
    mask = _attention_mask(args, device)
    points = []
    for b in micro_batch_sizes(largest):
        try:
            points.append(_point(b, s, h, vocab, layer_models, ends, dtype, device, timer, settings, excluded,
                                 progress, mask))
        except (MemoryError, getattr(torch.cuda, "OutOfMemoryError", MemoryError)):
            notes.append(f"micro-batch size {b} and above not measured: out of device memory")
            break
    return _with_step_overhead(args, points, build, timer, device, settings, progress)


def _attention_mask(args, device):
    """The mask the layers get, as the command's loader makes it (one sample's; None with
    ``--no-create-attention-mask-in-dataloader``); CommandError naming that flag where it does not fit the device."""
    import torch

    from .megatron_command import CommandError
    from .profile_steps import loader_attention_mask

    try:
        return loader_attention_mask(args, 1, device)
    except (MemoryError, getattr(torch.cuda, "OutOfMemoryError", MemoryError)) as error:
        s = args.seq_length
        raise CommandError(f"the command's data loader builds an attention mask of seq x seq = {s} x {s} per sample "
                           f"({s * s / 2**30:.1f} GiB), which does not fit here ({error}); Megatron's attention "
                           "applies its causal mask itself: add --no-create-attention-mask-in-dataloader") from error


@contextlib.contextmanager
def _megatron_quiet():
    """Megatron's INFO logs and prints kept out of the profile's progress and table while it builds its parts."""
    megatron_log = logging.getLogger("megatron.core")
    level = megatron_log.level
    megatron_log.setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        megatron_log.setLevel(level)


def _with_batch_times(args, points: List[ComputePoint], settings: ProfileSettings, progress: Progress,
                      notes: List[str], apart: Optional[Tuple[List[str], int]] = None) -> List[ComputePoint]:
    """``points`` with the data loader's time per batch (:mod:`.profile_batch`), each batch taken after a pause of
    one layer's forward and backward, in this process or, with ``apart`` (the command's words, this rank's device),
    in a one-process child; where the command's data path cannot be built here, the points unchanged and a note
    saying so."""
    from .profile_batch import measure_batch_s, measure_batch_s_apart

    pauses = {point.micro_batch_size: point.layer_forward_s + point.layer_backward_s for point in points}
    try:
        if apart is not None:
            batch = measure_batch_s_apart(apart[0], pauses, settings.warmup, settings.repeats, device=apart[1])
        else:
            with _megatron_quiet():
                batch = measure_batch_s(args, pauses, settings.warmup, settings.repeats)
    except Exception as error:  # the user's data path, tokenizer or loader: whatever it raises, the plan must say
        notes.append(f"the data loader was not measured ({type(error).__name__}: {error}); plans price it at 0")
        return points
    for size, seconds in batch.items():
        progress(f"micro-batch {size}: data loader {seconds * 1e3:.2f} ms per batch")
    return [dataclasses.replace(point, batch_s=batch[point.micro_batch_size]) for point in points]


def _one_layer_chunks(args, build) -> Dict[str, Tuple[object, object]]:
    """Per :data:`..planning.costs.STAGE_KINDS`: a one-layer chunk of that kind built by ``build`` (``(model,
    config)``, the embedding on the first / only, the output layer on the last / only), with ``main_grad``s."""
    from ..planning.costs import STAGE_KINDS

    chunks = {}
    for kind in STAGE_KINDS:
        model, config = build(_level_args(args, "none"), pre=kind in ("only", "first"), post=kind in ("only", "last"))
        _with_main_grads(model)
        chunks[kind] = (model, config)
    return chunks


def _with_step_overhead(args, points: List[ComputePoint], build, timer: _Timer, device, settings: ProfileSettings,
                        progress: Progress) -> List[ComputePoint]:
    """``points`` with what Megatron's schedule step spends beyond their pieces on each kind of chunk
    (:mod:`.profile_steps`), timed on one-layer models of each kind."""
    from .profile_steps import measure_step_overhead

    models = _one_layer_chunks(args, build)
    with _megatron_quiet():
        overhead = measure_step_overhead(args, models, points, timer, device, settings.warmup, settings.repeats)
    out = []
    for point in points:
        found = overhead[point.micro_batch_size]
        progress(f"micro-batch {point.micro_batch_size}: schedule step beyond the pieces (forward + backward) "
                 + ", ".join(f"{kind} {(f + b) * 1e3:.2f} ms" for kind, (f, b) in found.items()))
        out.append(dataclasses.replace(point, step_forward_s={kind: f for kind, (f, _) in found.items()},
                                       step_backward_s={kind: b for kind, (_, b) in found.items()}))
    return out


def _point(b: int, s: int, h: int, vocab: int, layer_models, ends, dtype, device, timer: _Timer,
           settings: ProfileSettings, excluded, progress: Progress, mask) -> ComputePoint:
    """The pieces at micro-batch size ``b``, the layers given ``mask`` (the command's loader's, or None)."""
    import torch

    generator = torch.Generator().manual_seed(settings.seed + b)
    hidden = torch.randn(s, b, h, generator=generator).to(device=device, dtype=dtype)

    def like(out):
        return torch.ones_like(out) * 1e-3

    def layer(model) -> Piece:
        def forward():
            model.set_input_tensor(hidden.clone().requires_grad_(True))
            return model(input_ids=None, position_ids=None, attention_mask=mask)
        return Piece(forward, release=lambda: model.set_input_tensor(None))
    times = _forward_backward({level: layer(model) for level, (model, _) in layer_models.items()}, like,
                              timer, settings, excluded)
    none = times["none"]
    tokens = torch.randint(0, vocab, (b, s), generator=generator).to(device)
    positions = torch.arange(s, device=device).unsqueeze(0).expand(b, s)

    def embedding_forward():
        return ends.embedding(input_ids=tokens, position_ids=positions)
    embedding = _forward_backward({"embedding": Piece(embedding_forward)}, like, timer, settings, excluded)["embedding"]

    def output_forward():
        x = hidden.clone().requires_grad_(True)
        weight = ends.shared_embedding_or_output_weight() if ends.share_embeddings_and_output_weights else None
        logits, _ = ends.output_layer(ends.decoder.final_layernorm(x), weight=weight)
        return ends.compute_language_model_loss(tokens, logits).float().mean()
    output = _forward_backward({"output": Piece(output_forward)}, lambda out: None, timer, settings, excluded)["output"]
    point = ComputePoint(
        tp=1, micro_batch_size=b, layer_forward_s=none[0], layer_backward_s=none[1],
        recompute_extra_s={level: max(0.0, t[0] + t[1] - none[0] - none[1]) for level, t in times.items()
                           if Lever.parse(level).recomputes},
        layer_activation_bytes={level: float(t[2]) for level, t in times.items()},
        embedding_forward_s=embedding[0], embedding_backward_s=embedding[1],
        embedding_activation_bytes=float(embedding[2]), output_forward_s=output[0], output_backward_s=output[1],
        output_activation_bytes=float(output[2]))
    progress(f"micro-batch {b}: layer forward {point.layer_forward_s * 1e3:.2f} ms, backward "
             f"{point.layer_backward_s * 1e3:.2f} ms, keeps {point.layer_activation_bytes['none'] / 2**20:.2f} MiB; "
             f"embedding {embedding[0] * 1e3:.2f} + {embedding[1] * 1e3:.2f} ms; output + loss "
             f"{output[0] * 1e3:.2f} + {output[1] * 1e3:.2f} ms; recompute extra "
             + ", ".join(f"{level} {extra * 1e3:.2f} ms" for level, extra in point.recompute_extra_s.items()))
    return point


def _optimizer_args(args):
    """``args`` for the optimizer measurement: the command's optimizer flags, on one instance of the distributed
    optimizer where the command has several (the shard's step costs the same per parameter)."""
    out = copy.copy(args)
    out.num_distributed_optimizer_instances = 1
    return out


def optimizer_config(args):
    """(Megatron's ``OptimizerConfig`` of the command, its overrides) as ``train_step`` builds them; CommandError
    naming the cause where Megatron refuses it on this machine (``--use-precision-aware-optimizer`` needs
    Transformer Engine's FusedAdam): checked before anything is measured, so no rank fails after the others
    measured for minutes."""
    from megatron.training.training import get_megatron_optimizer_config

    from .megatron_command import CommandError

    try:
        with _megatron_quiet():
            return get_megatron_optimizer_config(_optimizer_args(args))
    except (AssertionError, RuntimeError, ValueError, ImportError) as error:
        raise CommandError(f"pipemesh profile cannot build the command's optimizer on this machine, as Megatron's "
                           f"train_step would: {error or type(error).__name__}") from error


def _own_groups():
    """Megatron's process groups for a model of this rank alone: every group of the collection Megatron would use
    replaced by a one-rank group of this rank (every rank creates every one in the same order)."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    mine, _ = dist.new_subgroups(group_size=1)
    mpu = ProcessGroupCollection.use_mpu_process_groups()
    return ProcessGroupCollection(**{name: mine if isinstance(value, dist.ProcessGroup) else value
                                     for name, value in vars(mpu).items()})


def _optimizer_s_per_param(args, run_spec: str, settings: ProfileSettings, cuda: bool) -> float:
    """Seconds per parameter of what Megatron's ``train_step`` spends on the optimizer of the command, over a
    one-layer model with its embedding and output layer (the tensors of a stage) wrapped in Megatron's DDP: zeroing
    the gradient buffers and the optimizer's gradients, then ``get_megatron_optimizer``'s ``step()`` with the
    command's flags (the distributed optimizer where the command has it, the gradient norm and clipping, Adam's step,
    the fp32 main copy of 16-bit weights). torch's Adam alone measured 1.9 ns per parameter where Megatron's step
    took 3-4 here. The model's groups are this rank's alone (:func:`_own_groups`): the distributed optimizer's shard
    is then every parameter, its step's cost per parameter what a shard's is (the planner divides the parameters by
    DP), and its gathers and reductions, data-parallel traffic priced apart, copy nothing. Launched on several ranks
    every rank measures at once, rank 0's time is kept."""
    import torch
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.training.training import get_megatron_ddp_config

    from ..schedule.levers import DEVICE

    timer = _Timer(cuda)
    args = _optimizer_args(args)
    optimizer_config_, overrides = optimizer_config(args)
    model, config = _gpt(_level_args(args, str(DEVICE)), run_spec, settings, cuda, pre=True, post=True)
    groups = _own_groups()
    with _megatron_quiet():  # DDP and the optimizer log their buckets and config at INFO
        wrapped = DistributedDataParallel(config=config, ddp_config=get_megatron_ddp_config(args), module=model,
                                          pg_collection=groups)
        optimizer = get_megatron_optimizer(optimizer_config_, [wrapped], config_overrides=overrides,
                                           use_gloo_process_groups=False, pg_collection=groups)
    params = [p for p in model.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(settings.seed)
    grads = [torch.randn(p.shape, generator=generator).mul_(1e-3) for p in params]

    def zero() -> None:
        wrapped.zero_grad_buffer()
        optimizer.zero_grad()

    samples = []
    for call in range(settings.warmup + settings.repeats):
        _, zero_s = timer(zero)
        with torch.no_grad():
            for param, grad in zip(params, grads):
                param.main_grad.copy_(grad)  # what the backward leaves in DDP's buffers
        _, step_s = timer(optimizer.step)
        if call >= settings.warmup:
            samples.append(zero_s + step_s)
    return statistics.median(samples) / sum(p.numel() for p in params)


def _grad_bytes(args) -> int:
    """Bytes per element of the command's gradient buffers: fp32 under --accumulate-allreduce-grads-in-fp32 (bf16's
    default) or with fp32 parameters, else the parameters' 16 bits."""
    import torch

    return 4 if args.accumulate_allreduce_grads_in_fp32 or args.params_dtype == torch.float32 else 2


def host_link_together(launch, settings: ProfileSettings) -> Tuple[float, List[float]]:
    """(the pinned host link, Gbit/s of the slower direction, every rank's rate: [] for one process) as training's
    host placement meets it: launched on several ranks, every rank copies at once (a node's ranks share its host
    memory and PCIe switches), each copy after a barrier, and the slowest rank's rate is kept."""
    import torch
    import torch.distributed as dist

    from ..runtime.host_link import measure_host_link

    device = torch.device("cuda", torch.cuda.current_device())
    together = None if launch is None else dist.barrier
    rate = measure_host_link(device, repeats=settings.repeats, before_copy=together).planning_gbps
    if launch is None:
        return rate, []
    rates: List[Optional[float]] = [None] * launch.world
    dist.all_gather_object(rates, rate)
    return min(rates), rates
