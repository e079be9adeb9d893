"""``pipemesh profile``: measure, on this machine and with Megatron's own modules of the user's command, what the
planner otherwise assumes (the file format is :mod:`..planning.profile`).

The command is read as ``pipemesh plan --megatron-args`` reads it (:func:`.megatron_command.read_command`, with the
flags a CPU run adds, as the training entry point adds them) and built as one process builds it
(:mod:`.profile_models`: one transformer layer, TP = 1 and no pipeline; the layer spec, dtype, dropout, fusions and
recomputation settings are the command's). It measures, by job:

* the compute pieces at every micro-batch size 1, 2, 4, ... up to the command's (:mod:`.profile_pieces`): a layer's
  forward and backward at each recompute level the planner chooses from, the embedding, the output layer and loss,
  the bytes each keeps for its backward (:mod:`.profile_kept`), Megatron's schedule step beyond those pieces on each
  kind of chunk (:mod:`.profile_steps`) and the data loader per micro-batch (:mod:`.profile_batch`);
* Megatron's optimizer per parameter, as the command builds it (:mod:`.profile_optimizer`);
* on CUDA, the pinned host link (device-to-host and back, the slower; :func:`host_link_together`);
* launched on several ranks, the links between them (:mod:`.profile_links`: p2p, collectives, flows sharing a NIC).

Every time goes through one measuring loop (:mod:`.profile_timing`: warm-up calls, then the median of the repeats,
the measurements taking turns; on CPU the wall clock with one thread, a rank's share, on CUDA CUDA events around
each block launched behind queued work, as in training).

Launched on several ranks (torchrun, Slurm: ``WORLD_SIZE`` > 1), every rank joins the job's process group, every rank
measures the optimizer at once (Megatron's DDP and optimizer take part in collectives over the job's groups; rank 0's
time is kept), then rank 0 measures the compute and, in a one-process child (Megatron's dataset builder synchronises
every rank of a job), the data loader while the others wait, then every rank times the pinned host link at once (on
CUDA) and the links between them, and rank 0 returns the profile; a failure on any rank stops every rank. One process
measures no network: the plan keeps ``--nic-gbps`` and ``--intra-node-gbps``. TP > 1 is not measured (it needs CUDA
and a process group per rank).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
import tempfile
from typing import Callable, List, Optional, Sequence, Tuple

from ..planning.profile import Profile, at_pace, dtype_name, shape_of
from .profile_load import LoadWatch
from .profile_timing import ProfileSettings

Progress = Callable[[str], None]


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


def as_run_here(words: List[str], cuda: bool) -> List[str]:
    """The flags a run of ``words`` gets on this machine (the training entry point adds the same): on CPU the local
    layer spec, CPU initialisation, no fused kernels; on CUDA without Transformer Engine the local layer spec."""
    from .cpu_compat import _given, missing_cpu_args
    from .profile_models import te_importable

    if not cuda:
        return words + missing_cpu_args(words)
    if not te_importable() and not _given(words, "--transformer-impl"):
        return words + ["--transformer-impl", "local"]
    return words


def start_process_group(cuda: bool) -> Callable[[], None]:
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
    from .profile_models import single_rank_args

    tp, pp, cp = _parallel_sizes(words)
    planned = read_command(list(words), world_size=tp * pp * cp)  # the command as the planner reads it
    run = read_command(as_run_here(list(words), cuda), world_size=tp * pp * cp)  # as it runs on this machine
    if getattr(run.args, "spec", None):
        raise CommandError("pipemesh profile measures Megatron's GPT layers: --spec (a custom layer spec) is not "
                           "supported")
    args = single_rank_args(run.args)
    args.padded_vocab_size = run.model.vocab_size  # set by the tokenizer in training; the planner pads it alike
    return args, planned, run


@contextlib.contextmanager
def stdout_to_stderr():
    """Whatever is written to stdout meanwhile (Megatron's and its libraries' warnings, by Python or by C) goes to
    stderr: the file descriptor itself is pointed there, and back after."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def measure_profile(words: Sequence[str], settings: ProfileSettings = ProfileSettings(),
                    progress: Progress = lambda line: None) -> Optional[Profile]:
    """Measure the profile of the command ``words`` (its flags, as ``pipemesh plan --megatron-args`` takes them).
    Launched on several ranks, every rank calls it and rank 0 gets the profile, the others None. What Megatron
    prints meanwhile goes to stderr: stdout stays the caller's (``pipemesh profile``'s table, ``bench``'s report)."""
    with stdout_to_stderr():
        return _measure(words, settings, progress)


def _measure(words: Sequence[str], settings: ProfileSettings, progress: Progress) -> Optional[Profile]:
    """:func:`measure_profile` with stdout already redirected."""
    from .bootstrap import prepare_megatron_import
    from .profile_links import (CPU_BUCKET_BYTES, join_job, launched, measure_network, megatron_bucket_bytes,
                                message_sizes)

    launch = launched()
    prepare_megatron_import()
    import torch

    from .cpu_compat import apply_cpu_compat
    from .profile_optimizer import optimizer_config, optimizer_s_per_param
    from .profile_pace import pace_here
    from .profile_pieces import measure_compute, with_batch_times

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
    stop = start_process_group(cuda) if launch is None else join_job(launch, cuda)
    network = None
    try:
        # Every rank, first: building Megatron's DDP and optimizer takes part in collectives over the job's groups,
        # and a command whose optimizer cannot be built here fails before the minutes of the compute.
        pace = pace_here(cuda)
        optimizer_s = _shared(launch, "the optimizer", lambda: optimizer_s_per_param(args, run.model.layer_spec,
                                                                                    settings, cuda, pace))
        say(f"optimizer step {optimizer_s * 1e9:.2f} ns per parameter")
        compute, host_gbps, computing, load = [], None, 1, None

        watch = None if cuda else LoadWatch()  # before the siblings pin this process: it watches every core

        def compute_here():
            with _siblings(words, settings, cuda, say, notes) as cores:
                points = measure_compute(args, model_spec, run.model.layer_spec, settings, cuda, say, notes,
                                         watch.piece if watch is not None else None, pace)
                if pace is not None:  # from the first reading's pace to the median of all
                    points = [at_pace(found, pace.factor()) for found in points]
                # Several ranks: Megatron's dataset builder would synchronise every rank of the job, so rank 0
                # times the loader in a one-process child of its own.
                return with_batch_times(args, points, settings, say, notes,
                                        apart=None if launch is None else (list(words), launch.local_rank)), cores

        measured = _shared(launch, "the compute", compute_here if lead else lambda: None)
        if lead:
            compute, computing = measured
            load = watch.record() if watch is not None else None
            if pace is not None:
                optimizer_s *= pace.factor()
                say(f"{pace.record().describe()} (the lines above at the first reading's pace, x {pace.factor():.3f})")
            if load is not None:
                say(load.describe())
                if load.affected:
                    notes.append(f"timed while other processes computed on this machine ({load.describe()}): those "
                                 "pieces are slower than this machine's; profile again on an idle machine")
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
                                                                     grad_bytes(args)) if cuda else CPU_BUCKET_BYTES)
            sizes = message_sizes(model_spec.micro_batch_size, model_spec.seq_length, model_spec.hidden_size,
                                  model_spec.dtype_bytes, bucket, model_spec.moe.topk if model_spec.moe else None)
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
        method={"timer": "CUDA events, each block launched behind queued work" if cuda else "wall clock",
                "threads": None if cuda else 1,
                "cores_computing": None if cuda else computing,
                "warmup": settings.warmup, "repeats": settings.repeats, "statistic": "median",
                "stable_within": settings.stable_within, "stable_floor_s": settings.stable_floor_s,
                "max_seconds": settings.max_seconds,
                "capped": sorted({f"{name} mbs {point.micro_batch_size}" for point in compute
                                  for name, spread in (point.spread or {}).items() if not spread.stable}),
                "activation_meter": ("CUDA allocator across the forward, less its output" if cuda else
                                     "saved-tensor meter (parameters excluded)"),
                "measured_layer_spec": run.model.layer_spec},
        notes=tuple(notes), load=load, pace=pace.record() if pace is not None and lead else None)


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


def grad_bytes(args) -> int:
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
