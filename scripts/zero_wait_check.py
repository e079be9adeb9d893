"""Measure the wait of a ZeRO-2/3 chunk's backward for its previous group's reduce-scatter in real CPU training,
and compare the iteration time and that wait with the simulator's prediction.

The runtime reduce-scatters a ZeRO-2/3 chunk's gradient buffer after each backward group but the last (REDUCE)
and, before the chunk's next backward, waits for it (``runtime/sharding.py``: ``restore_grads`` ->
``finish_reduce``): the next group accumulates into the same buffer. This script runs the bench's tiny GPT on
PP=2 x DP=2 (four gloo ranks) with a plan of several backward groups, ZeRO-2 on every chunk, and a ZeRO-1 control
of the same groups (no REDUCE, nothing to wait for), each once over the plain loopback (its compute timers price
the simulation, as ``pipemesh bench`` calibrates) and once on the bench's shaped per-rank network. Every rank
times its waits inside ``finish_reduce`` and prints them per training call.

The prediction uses the bench's calibration (:func:`megatron_pipemesh.bench.calibrate.measured_costs`, the
levels' :class:`~megatron_pipemesh.planning.sharding.ShardingModel` on the shaped network) with the per-transfer
overhead fitted on the control's loopback run; the predicted wait is the simulated time backwards spent on a
REDUCE (``waited_on == 'reduce'``). ``--predict-only DIR`` re-predicts from a finished run's ``runs.json`` with
whatever ``megatron_pipemesh`` is importable (point PYTHONPATH at an older tree to see its prediction).

Usage (root, for the network namespaces; about 2.5 minutes per repeat on a loaded 2-core machine)::

    .venv/bin/python scripts/zero_wait_check.py --out-dir /tmp/zero-wait --rate 200mbit
    PYTHONPATH=/path/to/old/tree .venv/bin/python scripts/zero_wait_check.py --predict-only /tmp/zero-wait
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

WAIT_LINE = "zero-wait rank {rank} call {call}: {count} waits {seconds:.6f} s, launch to done {done:.6f} s"
WAIT_RE = re.compile(r"zero-wait rank (\d+) call (\d+): (\d+) waits ([0-9.]+) s, launch to done ([0-9.]+) s")
RANK_ENTRY = "--rank-entry"
PP, DP = 2, 2


def install_wait_timer() -> None:
    """In a rank: time every ``finish_reduce`` that has a reduction in flight and print, per training call, the
    sum of those waits and the sum, over the waits longer than 1 ms, of the time from the REDUCE's launch to the
    wait's end (then the reduce-scatter's own duration, up to the accumulation after it)."""
    import torch.distributed as dist

    from megatron_pipemesh.runtime import sharding

    waits: List[float] = []
    done: List[float] = []
    launched: Dict[int, float] = {}
    calls = [0]
    finish, end, reduce = sharding.ChunkSharding.finish_reduce, sharding.ProgramSharding.end, sharding.ChunkSharding.reduce

    def timed_reduce(self) -> int:
        nbytes = reduce(self)
        launched[self.chunk] = time.perf_counter()
        return nbytes

    def timed_finish(self) -> None:
        if not self.pending:
            return finish(self)
        start = time.perf_counter()
        finish(self)
        now = time.perf_counter()
        waits.append(now - start)
        if now - start > 1e-3 and self.chunk in launched:
            done.append(now - launched[self.chunk])

    def reported_end(self) -> None:
        end(self)
        calls[0] += 1
        print(WAIT_LINE.format(rank=dist.get_rank(), call=calls[0], count=len(waits), seconds=sum(waits),
                               done=sum(done) / len(done) if done else 0.0), flush=True)
        waits.clear()
        done.clear()

    sharding.ChunkSharding.finish_reduce = timed_finish
    sharding.ChunkSharding.reduce = timed_reduce
    sharding.ProgramSharding.end = reported_end


def parse_waits(text: str) -> Dict[int, Dict[int, List[float]]]:
    """rank -> {training call: [seconds waited in finish_reduce, mean launch-to-done seconds of those waits]}."""
    out: Dict[int, Dict[int, List[float]]] = {}
    for rank, call, _, seconds, done in WAIT_RE.findall(text):
        out.setdefault(int(rank), {})[int(call)] = [float(seconds), float(done)]
    return out


def setup(args):
    from megatron_pipemesh.bench.runner import ModelSetup, ParallelConfig, bench_gpt
    from megatron_pipemesh.schedule.config import ScheduleConfig

    model = ModelSetup(bench_gpt(args.hidden_size, 4, args.seq_length, 2, 1), args.microbatches, args.vpp,
                       args.warmup, args.iters)
    sched = ScheduleConfig(PP, args.vpp, args.microbatches, tuple(args.forward_groups), tuple(args.backward_groups))
    plans = {"zero2": tuple(args.levels or ["optim"] + ["optim_grads"] * (args.vpp - 1)), "zero1": ("optim",) * args.vpp}
    return model, ParallelConfig(PP, DP), sched, plans


def run_all(args) -> None:
    from megatron_pipemesh.bench.memory_fair import RunSpec
    from megatron_pipemesh.bench.netns import MIN_BURST_BYTES, ShapedNamespace, Shaping, parse_rate_mbit
    from megatron_pipemesh.bench.runner import (launch_command, prepare_data, run_env, run_once, threads_per_rank,
                                                training_args)
    from megatron_pipemesh.schedule.plan import RunPlan

    model, config, sched, plans = setup(args)
    shaping = Shaping(parse_rate_mbit(args.rate), 0.0, MIN_BURST_BYTES, 200.0, per_rank=True)
    os.makedirs(args.out_dir, exist_ok=True)
    data_flags = prepare_data(os.path.join(args.out_dir, "data"))
    threads, _ = threads_per_rank(config.world)
    runs = []
    order = [(repeat, name, levels, shaped) for repeat in range(args.repeats) for name, levels in plans.items()
             for shaped in (False, True)]
    with ShapedNamespace(shaping, ranks=config.world) as namespace:
        for index, (repeat, name, levels, shaped) in enumerate(order):
            plan_path = os.path.join(args.out_dir, f"{name}.json")
            with open(plan_path, "w", encoding="utf-8") as handle:
                handle.write(RunPlan(sched, sharding=levels).to_json())
            spec = RunSpec(name=name, family="pipemesh", groups=(sched.forward_groups, sched.backward_groups),
                           plan_path=plan_path, sharding=levels)
            train = training_args(model, config, spec, data_flags, os.path.join(args.out_dir, "runs"))
            cmd = launch_command(config.world, train, namespace.prefix() if shaped else [],
                                 rank_namespaces=namespace.rank_namespaces if shaped else None,
                                 master_port=29700 + index, target=(os.path.abspath(__file__), RANK_ENTRY))
            log = os.path.join(args.out_dir, "logs", f"{name}-{'shaped' if shaped else 'unshaped'}-r{repeat}.log")
            code, wall, _, text = run_once(cmd, run_env(threads), log, args.timeout, sample_memory=False)
            print(f"{name} {'shaped' if shaped else 'unshaped'} (repeat {repeat}): exit {code}, {wall:.0f} s, log {log}",
                  flush=True)
            if code != 0:
                raise SystemExit(f"run failed: see {log}")
            runs.append({"name": name, "levels": list(levels), "shaped": shaped, "log": log, "waits": parse_waits(text)})
    document = {"rate_mbit": shaping.rate_mbit, "payload_bytes_per_s": shaping.payload_bytes_per_s,
                "settings": vars(args), "runs": runs}
    with open(os.path.join(args.out_dir, "runs.json"), "w", encoding="utf-8") as handle:
        json.dump(document, handle, indent=1)


def _metrics(runs: Sequence[dict], model, config):
    """The bench's numbers of one plan and variant over its repeats (medians of the measured iterations)."""
    from megatron_pipemesh.bench.logparse import parse_log
    from megatron_pipemesh.bench.report import variant_metrics
    from megatron_pipemesh.bench.runner import RunResult

    results = []
    for run in runs:
        with open(run["log"], encoding="utf-8", errors="replace") as handle:
            parsed = parse_log(handle.read())
        results.append(RunResult(config.name, run["name"], run["shaped"], 0, 0, 0.0, run["log"], parsed))
    return variant_metrics(results, model, config)


def measured_wait_ms(runs: Sequence[dict], warmup: int, field: int = 0) -> List[float]:
    """Per pipeline rank: the median over the measured training calls of every repeat of the wait per call
    (``field`` 1: of the mean launch-to-done time of the waits), averaged over its data-parallel ranks."""
    per_rank: Dict[int, List[float]] = {}
    for run in runs:
        for rank, calls in run["waits"].items():
            per_rank.setdefault(int(rank), []).extend(v[field] for call, v in calls.items() if int(call) > warmup)
    return [1e3 * statistics.mean(statistics.median(per_rank[r]) for r in per_rank if r // DP == stage)
            for stage in range(PP)]


def predict(out_dir: str) -> dict:
    """Measured vs predicted iteration time and reduce-scatter wait of every shaped run in ``out_dir``."""
    from megatron_pipemesh.bench.calibrate import fit_transfer_overhead, measured_costs, sharding_model
    from megatron_pipemesh.bench.report import _measured_compute
    from megatron_pipemesh.planning.simulator import simulate

    with open(os.path.join(out_dir, "runs.json"), encoding="utf-8") as handle:
        document = json.load(handle)
    args = argparse.Namespace(**document["settings"])
    model, config, sched, _ = setup(args)
    rate = document["payload_bytes_per_s"]
    runs: Dict[tuple, List[dict]] = {}
    for run in document["runs"]:
        runs.setdefault((run["name"], run["shaped"]), []).append(run)
    plans = {name: tuple(group[0]["levels"]) for (name, _), group in runs.items()}  # as run, whatever the defaults
    control = _metrics(runs[("zero1", False)], model, config)
    overhead = fit_transfer_overhead(model, config, sched, _measured_compute(control, config),
                                     max(control["forward_backward_ms"]), sharding=plans["zero1"])
    out = {"rate_mbit": document["rate_mbit"], "transfer_overhead_ms": overhead * 1e3, "plans": {}}
    for name, levels in plans.items():
        unshaped, shaped = _metrics(runs[(name, False)], model, config), _metrics(runs[(name, True)], model, config)
        compute = _measured_compute(unshaped, config)
        costs = measured_costs(model, config, sched, compute, rate, overhead, distributed_optimizer=True)
        result = simulate(sched, costs, sharding=sharding_model(model, config, levels, rate))
        predicted_ms = result.iteration_s * 1e3 + compute.overhead_ms
        waits = [1e3 * sum(e.comm_part for e in events if e.waited_on == "reduce") for events in result.timeline.compute]
        reduce_ms = [1e3 * statistics.mean([c.end - c.start for c in result.timeline.comms
                                            if c.src == rank and c.op.kind.value == "REDUCE"] or [0.0])
                     for rank in range(PP)]
        measured_ms = shaped["iteration_ms_median"]
        out["plans"][name] = {
            "levels": list(levels), "measured_iteration_ms": measured_ms, "predicted_iteration_ms": predicted_ms,
            "error": (predicted_ms - measured_ms) / measured_ms,
            "measured_iteration_ms_all": [shaped["iteration_ms_min"], shaped["iteration_ms_max"]],
            "measured_reduce_wait_ms": measured_wait_ms(runs[(name, True)], model.warmup_iters),
            "predicted_reduce_wait_ms": waits,
            "measured_reduce_launch_to_done_ms": measured_wait_ms(runs[(name, True)], model.warmup_iters, 1),
            "modelled_reduce_ms": reduce_ms,
            "unshaped_iteration_ms": unshaped["iteration_ms_median"]}
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == RANK_ENTRY:  # one torchrun worker: time the waits, then the bench's rank entry
        install_wait_timer()
        from megatron_pipemesh.bench.rank import main as rank_main

        rank_main(argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", default="/tmp/zero-wait")
    parser.add_argument("--predict-only", metavar="DIR", help="re-predict a finished run's runs.json")
    parser.add_argument("--rate", default="200mbit", help="each rank's NIC, each way (default 200mbit)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--vpp", type=int, default=2)
    parser.add_argument("--forward-groups", type=int, nargs="+", default=[2, 2, 2, 2])
    parser.add_argument("--backward-groups", type=int, nargs="+", default=[2, 2, 2, 2])
    parser.add_argument("--levels", nargs="+",
                        help="the sharded plan's level per chunk (default: optim, then optim_grads for the others)")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1, help="runs of every plan and variant, round-robin")
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    if not args.predict_only:
        run_all(args)
    print(json.dumps(predict(args.predict_only or args.out_dir), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
