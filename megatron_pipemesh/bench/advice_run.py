"""``pipemesh bench --advice``: the advice of ``pipemesh plan --megatron-args`` for N ranks of this machine, every row
run on the emulated per-rank network, predicted against measured iteration time, and the cost that differs where a
prediction misses.

Each row runs with its own flags (as ``pipemesh plan`` prints them) through the bench's rank entry
(:mod:`.rank`, the same training entry point as ``scripts/pretrain_gpt.py``), with only what the measurement needs
replaced (:data:`RUN_FLAGS`: the iteration count and Megatron's per-rank timers). Rows whose flags are identical run
once. Ranks get a core each while the cores allow; with more ranks than cores they share the cores (``--pin-cores``
pins each pipeline stage's ranks to one core, :mod:`.affinity`), and the advice is planned for ranks that share them
so (:attr:`.advice_plan.AdviceBenchSettings.shared_cores`).
"""
from __future__ import annotations

import dataclasses
import os
import shlex
import statistics
import tempfile
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from ..cli.common import UsageError, emit_json
from ..planning.defaults import MFU
from .advice_parts import PARTS, attribute, cause_text, judgement, measured_parts, part_misses
from .advice_plan import UNSHAPED_NIC_GBPS, AdviceBenchSettings, advisor_problem, plan_advice, with_profile
from .machine_speed import BLOCK, drift, reference_s
from .message_probe import measure_latency
from .session import log

RUN_FLAGS = ("--train-iters", "--train-samples", "--log-interval", "--timing-log-level", "--timing-log-option",
             "--eval-iters", "--eval-interval", "--exit-interval", "--save", "--save-interval", "--load")
"""Flags of a row that the measurement replaces: the iterations, Megatron's per-rank timers every iteration, no
evaluation and no checkpoints."""

ADVICE_WARMUP, ADVICE_ITERS, ADVICE_REPEATS = 1, 3, 1
"""Default iterations of each row's run with ``--advice``: warm-up (not counted), then measured."""

ADVICE_CONFLICTS = (("quick", "--quick"), ("network_check", "--network-check"), ("configs", "--configs"),
                    ("sharding", "--sharding"), ("plot", "--plot"), ("activation_budget_mb", "--activation-budget-mb"),
                    ("memory_budget_mb", "--memory-budget-mb"), ("forward_groups", "--forward-groups"),
                    ("backward_groups", "--backward-groups"), ("group_sizes", "--group-sizes"),
                    ("stock_vpp", "--stock-vpp"))
"""Bench flags ``--advice`` refuses: the rows, their layouts and memory come from the advice."""


def add_advice_args(advice) -> None:
    """The flags only ``--advice`` reads, on its argument group ``advice``."""
    from ..cli.common import positive_int
    from ..integration.profile_timing import ProfileSettings

    advice.add_argument("--megatron-args", metavar='"FLAGS"', default=None,
                        help="with --advice: the flags of your pretrain_gpt.py command, in one quoted string")
    advice.add_argument("--nproc", type=positive_int, default=None,
                        help="with --advice: ranks, one single-GPU node each (the command's world size)")
    advice.add_argument("--profile", metavar="FILE", default=None,
                        help="with --advice: a 'pipemesh profile' file of the command the advisor prices with "
                             "(default: the command is profiled on this machine first, one thread as each rank runs)")
    advice.add_argument("--profile-max-seconds", type=float, default=None, metavar="S",
                        help="with --advice, profiling here: the time cap of each group of pieces the profile times "
                             f"together ('pipemesh profile --max-seconds', default {ProfileSettings.max_seconds:g}); "
                             "pieces not stable by then are marked so in the profile")
    advice.add_argument("--only-advised", action="store_true",
                        help="with --advice: run your command and the advised row only (the others are printed as "
                             "planned, not run)")
    advice.add_argument("--no-profile", action="store_true",
                        help="with --advice: plan with analytic costs at --device-tflops x --mfu instead of a profile "
                             "(what pipemesh plan --megatron-args does without --profile)")


def run_flags(flags: Sequence[str], warmup: int, iters: int) -> List[str]:
    """``flags`` with :data:`RUN_FLAGS` replaced: ``warmup + iters`` iterations, timers of every rank each iteration."""
    from ..integration.command_flags import expand_aliases, replace_flags
    from ..integration.megatron_command import option_aliases

    names = expand_aliases(RUN_FLAGS, option_aliases(RUN_FLAGS))
    return replace_flags(flags, names, ["--train-iters", str(warmup + iters), "--log-interval", "1",
                                        "--timing-log-level", "2", "--timing-log-option", "all", "--eval-iters", "0",
                                        "--eval-interval", "1000000"])


def rank_cores(pp: int, dp: int, cores: int, pin_shared: bool) -> Optional[List[int]]:
    """Core of each global rank: one each while the cores allow; with more ranks than cores, each pipeline stage's
    ranks on one core with ``--pin-cores`` (:func:`.affinity.stage_cores`), else unpinned (None)."""
    from .affinity import stage_cores

    world = pp * dp
    if world <= cores:
        return list(range(world))
    return stage_cores(pp, dp, cores) if pin_shared else None


@dataclass
class AdviceSetup:
    """``--advice``'s flags, checked."""

    words: List[str]
    """The user's command (Megatron flags; a launcher before them is allowed)."""
    settings: AdviceBenchSettings
    shaping: object
    """The :class:`~.netns.Shaping` of the per-rank network, or None with ``--unshaped``."""
    warmup: int
    iters: int
    cores: int
    memory_gb: float
    repeats: int = ADVICE_REPEATS
    """Runs of every row, round-robin (the rows' order each round), their measured iterations pooled: a drift of
    the machine's speed reaches every row alike."""
    profile_max_seconds: Optional[float] = None
    """The time cap of each group of the profile taken here (None: the profile's default)."""


def resolve_advice(args, machine: dict, shaping_at: Callable[[float], object], default_rate: str) -> AdviceSetup:
    """Check ``--advice``'s flags before anything runs (UsageError naming the flag). ``machine``: the bench's
    description of this machine; ``shaping_at``: the bench's shaping of its network flags at a rate (Mbit/s);
    ``default_rate``: the bench's ``--rate`` when none is given."""
    from ..cli.common import check_number
    from ..cli.megatron_args import MEGATRON_ARGS
    from .netns import MAX_RANKS, parse_rate_mbit

    given = [flag for name, flag in ADVICE_CONFLICTS if getattr(args, name, None)]
    if given:
        raise UsageError(f"--advice with {' '.join(given)} is invalid: the rows, their layouts and their memory come "
                         "from the advice of your command. Drop them. Example: pipemesh bench --advice --megatron-args "
                         '"<your flags>" --nproc 2 --rate 100mbit')
    if not args.megatron_args or not args.megatron_args.strip():
        raise UsageError(f'--advice needs {MEGATRON_ARGS}: the flags of your pretrain_gpt.py command in one quoted '
                         f'string. Example: --advice {MEGATRON_ARGS} "--num-layers 4 --hidden-size 256 ... '
                         '--pipeline-model-parallel-size 2" --nproc 2 --rate 100mbit')
    if args.nproc is None:
        raise UsageError("--advice needs --nproc N: the ranks (one single-GPU node each) the advice is for and the "
                         "rows run on. Example: --nproc 2")
    if args.network == "shared":
        raise UsageError("--advice with --network shared is invalid: the advice is for N nodes with a NIC each, the "
                         "per-rank network. Drop --network shared")
    try:
        words = shlex.split(args.megatron_args)
    except ValueError as error:
        raise UsageError(f"{MEGATRON_ARGS}: the quoted flags do not split as a shell would ({error})") from error
    warmup = args.warmup if args.warmup is not None else ADVICE_WARMUP
    iters = args.iters if args.iters is not None else ADVICE_ITERS
    repeats = args.repeats if args.repeats is not None else ADVICE_REPEATS
    for flag, value, example, positive in (("--warmup", warmup, "1", False), ("--iters", iters, "3", True),
                                           ("--repeats", repeats, "2", True),
                                           ("--device-tflops", args.device_tflops, "0.05", True),
                                           ("--mfu", args.mfu, f"{MFU:g}", True), ("--timeout", args.timeout, "600", True)):
        check_number(flag, value, example, positive=positive, required=True)
    for flag, value in (("--warmup", warmup), ("--iters", iters), ("--repeats", repeats)):
        if int(value) != value:
            raise UsageError(f"{flag} {value} is invalid: it must be a whole number. Example: {flag} 2")
    if args.mfu > 1:
        raise UsageError(f"--mfu {args.mfu:g} is invalid: it is a fraction of the peak, at most 1. Example: --mfu {MFU:g}")
    if args.nproc > MAX_RANKS:
        raise UsageError(f"--nproc {args.nproc} is invalid: the per-rank network holds at most {MAX_RANKS} ranks")
    if args.unshaped:
        if args.rate or args.delay_ms or args.nic_queue:
            raise UsageError("--advice --unshaped with --rate/--delay-ms/--nic-queue is contradictory: --unshaped runs "
                             f"over the plain loopback and plans for a {UNSHAPED_NIC_GBPS:g} Gbit/s NIC. Drop one of "
                             "them. Example: --rate 100mbit")
        shaping, gbps = None, UNSHAPED_NIC_GBPS
    else:
        rate_text = args.rate or default_rate
        try:
            rate = parse_rate_mbit(rate_text)
        except ValueError as error:
            raise UsageError(f"--rate {rate_text}: {error}") from error
        shaping = shaping_at(rate)
        gbps = shaping.payload_bytes_per_s * 8 / 1e9
    if args.profile and args.no_profile:
        raise UsageError(f"--profile {args.profile} with --no-profile is contradictory: drop one of them")
    cap = args.profile_max_seconds
    if cap is not None:
        check_number("--profile-max-seconds", cap, "3", positive=False, required=True)
        if args.profile or args.no_profile:
            raise UsageError(f"--profile-max-seconds {cap:g} with {'--profile' if args.profile else '--no-profile'} "
                             "is contradictory: it caps the profile taken here. Drop one of them")
    if args.profile and not os.path.isfile(args.profile):
        raise UsageError(f"--profile {args.profile}: no such file. Make one with pipemesh profile --megatron-args "
                         "\"<the same flags>\" --output FILE, or drop --profile to profile here first")
    cores = machine["cores"]
    memory_gb = machine["memory_gb"] or 8.0
    # More ranks than cores: the simulator shares the cores among the ranks computing (not a fixed cores / N each).
    shared = cores if args.nproc > cores else None
    settings = AdviceBenchSettings(nproc=args.nproc, nic_gbps=gbps, device_tflops=args.device_tflops, mfu=args.mfu,
                                   device_memory_gb=memory_gb / args.nproc, profile=args.profile, shared_cores=shared,
                                   pinned_cores=shared is not None and bool(getattr(args, "pin_cores", False)),
                                   nic_burst_bytes=shaping.payload_burst_bytes if shaping is not None else 0.0)
    return AdviceSetup(words, settings, shaping, int(warmup), int(iters), cores, memory_gb, int(repeats), cap)


def cmd_advice(args, machine: dict, shaping_at: Callable[[float], object], default_rate: str) -> int:
    """``pipemesh bench --advice``: check the flags, plan, check the namespace can be made, run every distinct row,
    report (the arguments after ``args``: :func:`resolve_advice`'s)."""
    setup = resolve_advice(args, machine, shaping_at, default_rate)
    if setup.shaping is not None:
        from .netns import permission_problem

        problem = permission_problem()
        if problem:
            raise UsageError(f"--advice cannot emulate the network: {problem}. Run as root, or pass --unshaped")
    out_dir = args.out_dir or tempfile.mkdtemp(prefix="pipemesh-bench-advice-")
    os.makedirs(out_dir, exist_ok=True)
    parsed = advisor_problem(setup.words, setup.settings)  # the command must fit N ranks (a given profile match it)
    if setup.settings.profile is None and not args.no_profile:
        setup = dataclasses.replace(setup, settings=dataclasses.replace(
            setup.settings, profile=profile_here(setup.words, os.path.join(out_dir, "profile.json"),
                                                 min(setup.settings.nproc, setup.cores), setup.profile_max_seconds)))
    refuse_loaded_profile(setup.settings.profile)
    at_profile = profile_pace_s(setup.settings.profile)  # the machine's pace the profile's times are given at
    # where the rows will run: on CPU ranks a message's fixed time is tenfold the planner's default
    try:
        latency = measure_latency(setup.shaping, os.path.join(out_dir, "latency.log"))
    except RuntimeError as error:
        log(f"pipemesh bench --advice: {error}")
        return 1
    log(f"pipemesh bench --advice: {latency.describe()}")
    setup = dataclasses.replace(setup, settings=dataclasses.replace(setup.settings, latency_us=latency.us))
    parsed = with_profile(parsed, setup.settings)
    if setup.settings.shared_cores is not None:
        log(f"note: {setup.settings.nproc} ranks share {setup.cores} cores: the predictions run each rank's compute "
            "(timed at one core) on them, " + ("each pipeline stage's ranks on one core (--pin-cores)"
                                               if setup.settings.pinned_cores else
                                               "shared by the ranks computing at each moment (a rank waiting in a "
                                               "bubble lends its core)"))
    costs = (f"the profile {setup.settings.profile}" if setup.settings.profile is not None else
             f"{setup.settings.device_tflops:g} TFLOP/s x MFU {setup.settings.mfu:g} per rank (analytic)")
    log(f"pipemesh bench --advice: planning for {setup.settings.nproc} ranks (one single-GPU node each) at "
        f"{setup.settings.nic_gbps * 1e3:.1f} Mbit/s payload per NIC, compute from {costs}")
    advice, parts, advisor_flags = plan_advice(parsed, setup.settings)
    if args.only_advised:
        advice = {**advice, "rows": {name: row for name, row in advice["rows"].items()
                                     if name in ("user", advice["run"])}}
    load_before = os.getloadavg()
    runs = run_rows(args, setup, advice, out_dir)
    if runs is None:
        return 130
    document = advice_document(setup, advice, parts, advisor_flags, runs, out_dir)
    # Other work on the machine slows the runs and not the predictions: the load is part of the measurement.
    document["load_average"] = {"before": list(load_before), "after": list(os.getloadavg())}
    document["machine_speed"] = {"block": BLOCK, "at_profile_s": at_profile,
                                 "at_runs_s": {name: run.get("machine_s", []) for name, run in runs.items()}}
    for row in document["rows"]:
        row["machine_drift"] = drift(runs[row["name"]].get("machine_s", []), at_profile)
    emit_json(document, os.path.join(out_dir, "advice.json"))
    if not emit_json(document, args.json):
        print(format_advice(document))
    return 0 if all(r["returncode"] == 0 for r in document["rows"]) else 1


def refuse_loaded_profile(path: Optional[str]) -> None:
    """UsageError where the profile at ``path`` was timed while other processes computed on its machine (its load
    record, :func:`..planning.profile_quality.load_problem`): its compute is priced too high, and predictions from
    it cannot be judged against runs."""
    from ..planning.profile import ProfileError, load
    from ..planning.profile_quality import load_problem

    if path is None:
        return
    try:
        problem = load_problem(load(path).load, path)
    except ProfileError as error:
        raise UsageError(str(error)) from error
    if problem:
        raise UsageError(f"--advice cannot judge predictions from {path}: {problem}")


PROFILED_MICRO_BATCH = 8
"""The bench's profile measures micro-batch sizes up to this (or the command's, if larger; at most the global batch):
the advice may change the size, and prices the sizes measured from the profile."""


def profiled_micro_batch(words: Sequence[str]) -> int:
    """The largest micro-batch size the bench's profile measures for the command ``words``."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--global-batch-size", type=int, default=None)
    known, _ = parser.parse_known_args(list(words))
    largest = max(known.micro_batch_size, PROFILED_MICRO_BATCH)
    return min(largest, known.global_batch_size) if known.global_batch_size else largest


def profile_pace_s(path: Optional[str]) -> List[float]:
    """The machine's pace the profile at ``path`` gives its times at (:class:`..planning.profile_quality.
    MachinePace`), as one reading; none for no profile or one without a pace (CUDA, an older file)."""
    from ..planning.profile import load

    pace = load(path).pace if path is not None else None
    return [] if pace is None else [pace.seconds]


def profile_here(words: Sequence[str], path: str, computing: int = 1, max_seconds: Optional[float] = None) -> str:
    """Profile the command on this machine (``pipemesh profile``: one thread, as each rank runs, with ``computing``
    cores computing at once, as the ranks will) into ``path``; ``max_seconds``: each group's time cap (None: the
    profile's default)."""
    from ..integration.megatron_command import CommandError
    from ..integration.profile import ProfileSettings, measure_profile

    log(f"pipemesh bench --advice: profiling the command on this machine into {path}")
    try:
        capped = {} if max_seconds is None else {"max_seconds": float(max_seconds)}
        profile = measure_profile(list(words), ProfileSettings(max_micro_batch=profiled_micro_batch(words),
                                                               ranks_per_node=computing, **capped),
                                  progress=lambda line: log(f"  {line}"))
    except CommandError as error:
        raise UsageError(f"--megatron-args: {error}") from error
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(profile.to_json() + "\n")
    return path


def _present(advice: dict) -> List[str]:
    return [name for name, row in advice["rows"].items() if row is not None]


def run_rows(args, setup: AdviceSetup, advice: dict, out_dir: str) -> Optional[Dict[str, dict]]:
    """Every distinct row's runs (rows with the same flags share them), ``setup.repeats`` rounds of every row in
    turn, in the shaped namespace when there is one: name -> {returncode, log, logs, iterations (parsed, past the
    warm-up, of every round), wall_s, error, same_run_as}. A row whose run fails is not run again."""
    from .logparse import parse_log
    from .netns import ShapedNamespace
    from .runner import TRAIN_MODULE, error_excerpt, launch_command, run_env, run_once, threads_per_rank
    from .session import enter_namespace

    names = _present(advice)
    namespace = ShapedNamespace(setup.shaping, ranks=setup.settings.nproc) if setup.shaping else None
    runs: Dict[str, dict] = {}
    flags_of = {name: run_flags(advice["rows"][name]["flags"], setup.warmup, setup.iters) for name in names}
    first_of: Dict[tuple, str] = {}
    for name in names:
        first_of.setdefault(tuple(flags_of[name]), name)
    try:
        enter_namespace(namespace)
        for round_ in range(1, setup.repeats + 1):
            for index, name in enumerate(names, 1):
                row, flags = advice["rows"][name], flags_of[name]
                first = first_of[tuple(flags)]
                if first != name:
                    if round_ == 1:
                        log(f"[{index}/{len(names)}] {name}: the same flags as {first}, measured once")
                    continue
                if name in runs and runs[name]["returncode"] != 0:
                    continue
                world = setup.settings.nproc
                threads, _ = threads_per_rank(world, setup.cores)
                cores = rank_cores(row["pp"], row["dp"] * row["tp"], setup.cores, bool(args.pin_cores))
                env = run_env(threads, cores=cores)
                env.pop("PIPEMESH_BENCH_ACTIVATION_METER", None)  # times only: no saved-tensor hooks in the runs
                cmd = launch_command(world, flags, namespace.prefix() if namespace else [],
                                     rank_namespaces=namespace.rank_namespaces if namespace else None,
                                     master_port=29500 + (round_ * len(names) + index + os.getpid()) % 1000,
                                     target=TRAIN_MODULE)
                log_path = os.path.join(out_dir, "logs", f"{name}.log" if round_ == 1 else f"{name}.{round_}.log")
                before = reference_s()
                code, wall, _, text = run_once(cmd, env, log_path, args.timeout, sample_memory=False)
                machine = [before, reference_s()]  # the machine moves within a run: its pace either side
                iterations = parse_log(text).measured(setup.warmup)
                run = runs.setdefault(name, {"returncode": 0, "log": log_path, "logs": [], "wall_s": 0.0,
                                             "iterations": [], "error": "", "same_run_as": None, "cores": cores,
                                             "machine_s": []})
                run["machine_s"] += machine
                run["logs"].append(log_path)
                run["wall_s"] += wall
                run["iterations"] += iterations
                if code != 0:
                    run.update(returncode=code, error=f"exit {code}: {error_excerpt(text, 4)}")
                times = sorted(it.elapsed_ms for it in iterations)
                progress = f" (round {round_} of {setup.repeats})" if setup.repeats > 1 else ""
                log(f"[{index}/{len(names)}] {name}{progress}: "
                    + (f"{statistics.median(times):.0f} ms/iteration, {wall:.0f} s" if code == 0 and times
                       else f"FAILED ({run['error'][:300]})"))
        for name in names:
            first = first_of[tuple(flags_of[name])]
            if first != name:
                runs[name] = {**runs[first], "same_run_as": first}
    except KeyboardInterrupt:
        log("pipemesh bench --advice: interrupted" + ("; the namespace is removed" if namespace else ""))
        return None
    finally:
        if namespace:
            namespace.close()
    return runs


def advice_document(setup: AdviceSetup, advice: dict, parts: Dict[str, list], advisor_flags: Sequence[str],
                    runs: Dict[str, dict], out_dir: str) -> dict:
    """Everything ``--advice`` found, as ``--json`` writes it: per row the prediction and its parts, the
    measurement and its parts, their ratio and, for a miss, the cost that differs."""
    rows = []
    for name in _present(advice):
        row, run = advice["rows"][name], runs[name]
        iterations = run["iterations"]
        times = [it.elapsed_ms / 1e3 for it in iterations]
        measured_s = statistics.median(times) if run["returncode"] == 0 and times else None
        predicted = parts[name]
        measured = measured_parts(iterations, row["pp"], row["dp"] * row["tp"]) if measured_s is not None else None
        entry = {"name": name, "describe": row["describe"], "flags": row["flags"], "command": row["command"],
                 "pp": row["pp"], "dp": row["dp"], "tp": row["tp"], "vpp": row["vpp"],
                 "predicted_iteration_s": row["predicted_iteration_s"], "measured_iteration_s": measured_s,
                 "measured_iterations_s": times, "predicted_ratio_to_user": row["ratio_to_user"],
                 "predicted_parts_s": [p.to_dict() for p in predicted],
                 "measured_parts_s": [m.to_dict() for m in measured] if measured else None,
                 "returncode": run["returncode"], "error": run["error"], "log": run["log"],
                 "same_run_as": run["same_run_as"], "cores": run.get("cores"), "fits": row["fits"],
                 "kind": row.get("kind"), "predicted_error": row.get("error"),
                 "interval_s": row.get("interval_s")}
        if measured_s is not None:
            attribution = attribute(row["predicted_iteration_s"], measured_s, predicted, measured)
            misses = part_misses(predicted, measured)
            entry.update({"measured_over_predicted": attribution["measured_over_predicted"],
                          "miss": attribution["miss"], "cause": attribution["cause"],
                          "part_misses": misses, "judgement": judgement(attribution, misses),
                          "part_differences_s": attribution["differences_s"], "cause_text": cause_text(attribution)})
        else:
            entry.update({"measured_over_predicted": None, "miss": None, "cause": None, "part_differences_s": None,
                          "part_misses": None, "judgement": "not measured", "cause_text": ""})
        rows.append(entry)
    by_name = {r["name"]: r for r in rows}
    user_s = by_name["user"]["measured_iteration_s"]
    for r in rows:
        r["measured_ratio_to_user"] = (user_s / r["measured_iteration_s"]
                                       if user_s and r["measured_iteration_s"] else None)
    advised = advice["run"]
    settings, shaping = setup.settings, setup.shaping
    return {
        "command": setup.words, "nproc": settings.nproc, "cores": setup.cores,
        "ranks_share_cores": settings.nproc > setup.cores, "pinned": [r["cores"] for r in rows],
        "network": {"shaped": shaping is not None, "rate_mbit": shaping.rate_mbit if shaping else None,
                    "per_rank": True, "nic_queue": shaping.nic_queue if shaping else None,
                    "planned_nic_gbps": settings.nic_gbps, "planned_burst_bytes": settings.nic_burst_bytes,
                    "planned_latency_us": settings.latency_us},
        "device": {"tflops_per_rank": settings.device_tflops, "mfu": settings.mfu,
                   "memory_gb_per_rank": settings.device_memory_gb, "shared_cores": settings.shared_cores,
                   "pinned_cores": settings.pinned_cores},
        "profile": settings.profile, "advisor_flags": list(advisor_flags),
        "warmup_iters": setup.warmup, "measured_iters": setup.iters, "repeats": setup.repeats, "out_dir": out_dir,
        "advised": advised,
        "advised_measured_ratio_to_user": by_name[advised]["measured_ratio_to_user"] if advised in by_name else None,
        "advised_predicted_ratio_to_user": by_name[advised]["predicted_ratio_to_user"] if advised in by_name else None,
        "rows": rows, "notes": list(advice["notes"]), "advice": advice,
    }


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_advice(document: dict) -> str:
    """The table: per row predicted and measured iteration time, their ratio, both ratios to the user's command;
    then the advised row's measured ratio, and one line per missed prediction naming the cost that differs."""
    net = document["network"]
    lines = [f"pipemesh bench --advice: {document['nproc']} ranks, one single-GPU node each; network: "
             + (f"{net['rate_mbit']:g} Mbit/s per rank each way ({net['nic_queue']} share), planned at "
                f"{1e3 * net['planned_nic_gbps']:.1f} Mbit/s payload"
                + (f" with the {net['planned_burst_bytes'] / 1024:g} KiB token-bucket burst"
                   if net.get("planned_burst_bytes") else "") if net["shaped"]
                else f"unshaped loopback, planned at {net['planned_nic_gbps']:g} Gbit/s")
             + (f", {net['planned_latency_us']:.0f} us per message (measured)" if net.get("planned_latency_us")
                else "")
             + ("; compute and activations from the profile " + document["profile"] if document["profile"] else
                f"; {document['device']['tflops_per_rank']:g} TFLOP/s x MFU {document['device']['mfu']:g} per rank "
                "(analytic, --no-profile)")
             + f"; {document['warmup_iters']} warm-up + {document['measured_iters']} measured iterations"
             + (f" x {document['repeats']} rounds, every row in turn" if document.get("repeats", 1) > 1 else "")
             + " (median)"]
    if document["ranks_share_cores"]:
        pinned = any(cores is not None for cores in document["pinned"])
        lines.append(f"note: {document['nproc']} ranks share {document['cores']} cores: "
                     + ("each pipeline stage's ranks pinned to one core (--pin-cores), as the predictions model it"
                        if pinned else "unpinned; the predictions share the cores among the ranks computing at each "
                        "moment (a rank waiting in a bubble lends its core)"))
    else:
        lines.append(f"one core per rank ({document['cores']} cores)")
    header = (f"{'row':<18} {'pred s':>8} {'meas s':>8} {'meas/pred':>9} {'pred x user':>11} {'meas x user':>11}  what")
    lines += ["", header, "-" * len(header)]
    for r in document["rows"]:
        mark = "" if r["returncode"] == 0 else "  FAILED"
        lines.append(f"{r['name']:<18} {r['predicted_iteration_s']:>8.3f} {_fmt(r['measured_iteration_s'], '8.3f'):>8} "
                     f"{_fmt(r['measured_over_predicted'], '9.2f'):>9} {r['predicted_ratio_to_user']:>11.2f} "
                     f"{_fmt(r['measured_ratio_to_user'], '11.2f'):>11}  {r['describe']}{mark}")
    lines.append("")
    advised = document["advised"]
    if advised is not None:
        lines.append(f"advised row ({advised}): measured {_fmt(document['advised_measured_ratio_to_user'], '.2f')}x the "
                     f"user's command's speed (predicted {_fmt(document['advised_predicted_ratio_to_user'], '.2f')}x)"
                     + (f"; {document['advice']['run_reason']}" if document["advice"].get("run_reason") else ""))
    for r in document["rows"]:
        if r.get("part_misses") and r["same_run_as"] is None:
            lines.append(f"{r['name']}: {r['judgement']}: parts outside their limits (compute 10%, communication 20% or "
                         f"50 ms, optimizer 20% or 20 ms): {'; '.join(r['part_misses'])}")
        if r["cause_text"] and r["same_run_as"] is None:
            lines.append(f"{r['name']}: {r['cause_text']}")
            lines += [f"   pipeline rank {rank}, predicted/measured ms: " + ", ".join(
                f"{part} {1e3 * p[part]:.0f}/{1e3 * m[part]:.0f}" for part in PARTS)
                for rank, (p, m) in enumerate(zip(r["predicted_parts_s"], r["measured_parts_s"] or []))]
        if r["error"]:
            lines.append(f"{r['name']}: {r['error']}")
    for note in document["notes"]:
        lines.append(f"note: {note}")
    machine = document.get("machine_speed")
    drifts = [(r["name"], r.get("machine_drift")) for r in document["rows"] if r.get("machine_drift") is not None
              and r["same_run_as"] is None]
    if machine and drifts:
        lines.append(f"the machine's own pace ({machine['block']}, every core, before and after each run) against "
                     f"the profile's pace: " + ", ".join(f"{name} {100 * value:+.0f}%" for name, value in drifts)
                     + " (+: slower; the predictions are not scaled by it)")
    load = document.get("load_average")
    if load:
        lines.append(f"load average (1, 5, 15 min) before the runs {', '.join(f'{x:.2f}' for x in load['before'])}; "
                     f"after {', '.join(f'{x:.2f}' for x in load['after'])} (other work on the machine slows the runs)")
    lines.append(f"logs and advice.json: {document['out_dir']}")
    return "\n".join(lines)
