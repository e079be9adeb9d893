"""The advice ``pipemesh bench --advice`` checks: ``pipemesh plan --megatron-args`` for N single-GPU nodes on this
machine's emulated network, and each row's prediction split into its parts (:mod:`.advice_parts`).

The advisor is called as ``pipemesh plan`` calls it (its own parser, :func:`~..cli.megatron_args.problem_and_cluster`,
:func:`~..planning.advice.advise`, :func:`~..cli.megatron_args.report`), with the cluster the bench emulates:

* ``--nodes N --gpus-per-node 1``: every rank its own node behind its own NIC (the per-rank network);
* ``--nic-gbps``: the shaped rate's payload (frame headers off, :attr:`.netns.Shaping.payload_bytes_per_s`), what
  the bench's own predictions see; unshaped, the loopback the bench's predictions take as free
  (:data:`UNSHAPED_NIC_GBPS`);
* ``--device-tflops`` / ``--mfu``: the bench's rate of one CPU core; ``--device-memory-gb``: this machine's memory / N;
* when N ranks outnumber this machine's C cores, every rank on one host of C cores
  (:attr:`~..planning.advice.AdviceCluster.shared_cores`): the simulator gives the cores fairly to the ranks computing
  at each moment (a rank waiting in a bubble lends its core), unpinned or each pipeline rank's ranks on one core as
  ``--pin-cores`` runs them (:attr:`~..planning.advice.AdviceCluster.pinned_cores`), the stock rows' simulations too;
* ``--gpudirect-rdma``: CPU ranks send from their own memory, nothing is staged; and the ranks' host copies hold up
  their compute (:attr:`~..planning.advice.AdviceCluster.host_copies_on_compute`, set as the advisor sets it for
  costs measured on this CPU), and the ranks talk over gloo (:attr:`~..planning.advice.AdviceCluster.collectives`: its
  two-pass reduce-scatter, and Megatron's sends waiting for their receiver, :data:`~..planning.costs.MEGATRON_SEND_WAIT`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional, Sequence

from ..cli.common import UsageError
from .advice_parts import RankParts, predicted_parts

UNSHAPED_NIC_GBPS = 25.0
"""The NIC the advice is planned for with ``--unshaped`` (the bench's unshaped predictions use the same rate)."""


@dataclass(frozen=True)
class AdviceBenchSettings:
    """The cluster ``pipemesh bench --advice`` plans for (its flags in brackets)."""

    nproc: int
    """Ranks, one single-GPU node each [--nproc]."""
    nic_gbps: float
    """Payload rate of one rank's NIC each way, Gbit/s [--rate, or :data:`UNSHAPED_NIC_GBPS` with --unshaped]."""
    device_tflops: float
    """Peak TFLOP/s of one rank on a core of its own [--device-tflops] (sharing cores is ``shared_cores``)."""
    mfu: float
    """Fraction of the peak [--mfu]."""
    device_memory_gb: float
    """Memory of one rank: this machine's memory / N."""
    profile: Optional[str] = None
    """A ``pipemesh profile`` file the advisor prices with [--profile, or the one measured first]; None: analytic
    costs [--no-profile]."""
    shared_cores: Optional[int] = None
    """This machine's cores when the N ranks outnumber them: every rank's compute (timed at one core) runs on these,
    shared by the ranks computing at the moment; None: a core per rank."""
    pinned_cores: bool = False
    """With ``shared_cores``: each pipeline rank's ranks pinned to core (pipeline rank % cores) [--pin-cores]."""
    nic_burst_bytes: float = 0.0
    """The token-bucket burst of every emulated NIC direction (tc tbf [--burst]); 0: none (--unshaped)."""
    latency_us: Optional[float] = None
    """The fixed time of one message between two ranks, measured where the rows run (:mod:`.message_probe`);
    None: the planner's default."""


def advisor_argv(settings: AdviceBenchSettings) -> List[str]:
    """The ``pipemesh plan --megatron-args`` flags of the emulated cluster (the command itself goes separately)."""
    argv = ["--nodes", str(settings.nproc), "--gpus-per-node", "1", "--nic-gbps", f"{settings.nic_gbps:.6g}",
            "--device-tflops", f"{settings.device_tflops:.6g}", "--mfu", f"{settings.mfu:.6g}",
            "--device-memory-gib", f"{settings.device_memory_gb:.6g}", "--gpudirect-rdma", "--quiet"]
    if settings.profile is not None:
        argv += ["--profile", settings.profile]
    if settings.latency_us is not None:
        argv += ["--latency-us", f"{settings.latency_us:.6g}"]
    return argv


def advisor_problem(words: Sequence[str], settings: AdviceBenchSettings):
    """(the advisor's flags, (user, problem, cluster, rate) as ``pipemesh plan --megatron-args`` reads them): the
    command read by Megatron's parser for N ranks, and the profile matched to it. UsageError naming the flag when the
    command does not fit N ranks (cheap: nothing is planned)."""
    from ..cli.megatron_args import build_advice_parser, problem_and_cluster

    argv = advisor_argv(settings)
    args = build_advice_parser().parse_args(argv)
    try:
        return argv, problem_and_cluster(args, list(words))
    except UsageError as error:
        raise UsageError(f"--megatron-args on --nproc {settings.nproc} ranks: {error}") from error


def with_profile(parsed, settings: AdviceBenchSettings):
    """``parsed`` (:func:`advisor_problem`'s answer) with the profile of ``settings`` matched to the command and the
    advisor's flags of ``settings``, without reading the command again (a profile or latency measured after the
    command was read)."""
    from ..cli.megatron_args import build_advice_parser, matched_profile

    argv, (user, problem, cluster, rate) = parsed
    argv = advisor_argv(settings)
    profile = matched_profile(build_advice_parser().parse_args(argv), user, rate) if settings.profile else None
    return argv, (user, dataclasses.replace(problem, profile=profile), cluster, rate)


def plan_advice(parsed, settings: AdviceBenchSettings):
    """(the advisor's report as ``pipemesh plan --megatron-args --json`` prints it, the predicted parts per row name
    (per pipeline rank), the advisor's flags) for ``parsed``, :func:`advisor_problem`'s answer for ``settings``."""
    from ..cli.megatron_args import profile_report, report
    from ..planning.advice import advise
    from ..planning.planner import NoFeasiblePlan

    argv, (user, problem, cluster, rate) = parsed
    cluster = dataclasses.replace(cluster, host_copies_on_compute=True, collectives="gloo",
                                  shared_cores=settings.shared_cores, pinned_cores=settings.pinned_cores,
                                  nic_burst_bytes=settings.nic_burst_bytes,
                                  latency_us=cluster.latency_us if settings.latency_us is None else settings.latency_us)
    problem = dataclasses.replace(problem, max_tp=1)  # megatron-core runs TP > 1 on CUDA only
    try:
        advice = advise(problem, cluster)
    except NoFeasiblePlan as error:
        raise UsageError(f"--megatron-args on --nproc {settings.nproc} ranks: {error}") from error
    out = report(user, problem, cluster, rate, advice)
    if problem.profile is not None:
        out["profile"] = profile_report(settings.profile, problem, out)  # which costs were measured, which assumed
    parts = {name: row_parts(row, problem, cluster) for name, row in advice.rows.items() if row is not None}
    return out, parts, argv


def row_parts(row, problem, cluster) -> List[RankParts]:
    """The row's prediction per pipeline rank: a PipeMesh row's own simulation; a stock row simulated again as the
    advisor simulates it for its per-rank compute (its setting, uniform recomputation, its sharding model)."""
    if row.plan is not None:
        result = row.plan.result
    else:
        result = stock_simulation(row, problem, cluster)
    return predicted_parts(result.iteration_s, result.ranks)


def stock_simulation(row, problem, cluster):
    """The :class:`~..planning.simulator.SimulationResult` of a stock row on its layout's cluster."""
    from ..planning.advice import OVERLAP_FLAGS
    from ..planning.clusters import costs_for
    from ..planning.simulator import megatron_schedule, simulate
    from ..planning.stock import model_for, sharding_model, uniform_plan

    setting = row.stock
    config = setting.config()
    # The row's own micro-batch size and optimizer (a row without a pipeline may add the distributed optimizer).
    spec = cluster.spec(row.layout.tp, row.layout.dp, problem.sequence_parallel,
                        problem.distributed_optimizer or setting.sharding is not None,
                        tuple(on or flag in row.added_flags for on, flag in zip(problem.overlap, OVERLAP_FLAGS)),
                        row.layout.cp, problem.cp_comm, row.layout.ep, row.layout.etp)
    model = dataclasses.replace(problem.model_for(row.layout.tp, row.split),
                                micro_batch_size=row.micro_batch_size or problem.model.micro_batch_size)
    costs = costs_for(model_for(model, setting), spec, config, profile=problem.profile,
                      levels=(setting.recompute.level,))
    sharding = sharding_model(setting, model, spec)
    return simulate(config, costs, uniform_plan(config, setting.recompute.level),
                    megatron_schedule(config, costs, sharding), sharding=sharding)

