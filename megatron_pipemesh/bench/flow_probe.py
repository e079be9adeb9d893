"""The network check's worker: times :mod:`.flow_scenarios` with gloo, one torchrun worker per rank namespace.

``python -m megatron_pipemesh.bench.flow_probe SPEC.json`` (started by :mod:`.network_check` through
:mod:`.rank_netns`, so each rank sends through its own shaped NIC, as the training ranks do). SPEC holds
``scenarios`` (:meth:`.flow_scenarios.Scenario.to_dict`), ``warmup`` and ``repeats`` (runs of every scenario,
round-robin) and ``timeout_s``. Every distinct pair of a send and every ring gets its own process group (its own TCP
connections), like Megatron's pipeline and data-parallel groups. Each run starts after a barrier; a send is done
when its receiver has the last byte, the all-reduce when its last rank returns. Rank 0 prints one line per measured
run: ``[pipemesh-netcheck] {"scenario": ..., "repeat": ..., "seconds": {...}}``, seconds from the first rank's start
to each measure, to each transfer's completion (``receive 0->2``, ``send 0->2``: the sender's buffer handed off,
``all-reduce over (0, 1)``) and to each rank's start (one clock for all ranks: they share the machine's monotonic
clock).
"""
from __future__ import annotations

import json
import sys
import threading
import time
from datetime import timedelta
from typing import Dict, List, Optional, Sequence, Tuple

from .flow_scenarios import ALL_REDUCE, SENDS, MeasuredScenario, Scenario

LINE_PREFIX = "[pipemesh-netcheck] "


def group_keys(scenarios: Sequence[Scenario]) -> List[Tuple[str, Tuple[int, ...]]]:
    """The process groups the scenarios use, in the order every rank creates them: ('p2p', pair) per distinct pair
    of a send, ('ring', ranks) per distinct ring."""
    keys = {("p2p", tuple(sorted((s.src, s.dst)))) for sc in scenarios for s in sc.sends}
    keys |= {("ring", tuple(sorted(sc.all_reduce.ranks))) for sc in scenarios if sc.all_reduce}
    return sorted(keys)


def run_scenario(scenario: Scenario, rank: int, groups: Dict, timeout_s: float) -> Tuple[Optional[float], Dict[str, float]]:
    """Start this rank's part of ``scenario`` and wait for it: (start time or None when the rank takes no part,
    {measure or transfer: when this rank's last transfer of that measure, or that transfer, completed})."""
    import torch
    import torch.distributed as dist

    posted = []  # (measure, or None for the sender's side of a send; what; the call that starts it)
    for send in scenario.sends:
        if rank in (send.src, send.dst):
            group = groups[("p2p", tuple(sorted((send.src, send.dst))))]
            buf = torch.ones(send.nbytes // 4)
            if rank == send.src:
                posted.append((None, f"send {send.src}->{send.dst}",
                               lambda b=buf, d=send.dst, g=group: dist.isend(b, d, group=g)))
            else:
                posted.append((SENDS, f"receive {send.src}->{send.dst}",
                               lambda b=buf, s=send.src, g=group: dist.irecv(b, s, group=g)))
    ring = scenario.all_reduce
    if ring and rank in ring.ranks:
        buf = torch.ones(ring.nbytes // 4)
        group = groups[("ring", tuple(sorted(ring.ranks)))]
        posted.append((ALL_REDUCE, f"all-reduce over {ring.ranks}",
                       lambda b=buf, g=group: dist.all_reduce(b, group=g, async_op=True)))
    if not posted:
        return None, {}
    start = time.monotonic()
    # Receives first: gloo sends a buffer only once its receiver has said it is ready, and that word travels on the
    # same TCP stream as the data: posted after a send to the same peer, it would wait behind the whole send.
    posted.sort(key=lambda item: item[0] != SENDS)
    works = [(measure, what, issue()) for measure, what, issue in posted]
    done: Dict[str, float] = {}
    errors: List[str] = []

    def wait(measure, what, work):
        try:
            work.wait(timedelta(seconds=timeout_s))
        except Exception as error:  # reported below with the op's name
            errors.append(f"{what}: {error}")
            return
        finished = time.monotonic()
        done[what] = finished
        if measure is not None:
            done[measure] = max(done.get(measure, 0.0), finished)

    # one waiter per transfer: each completion is timed when it happens, not when the previous one is waited for
    waiters = [threading.Thread(target=wait, args=item, daemon=True) for item in works]
    for waiter in waiters:
        waiter.start()
    for waiter, (_, what, _) in zip(waiters, works):
        waiter.join(timeout_s + 5)
        if waiter.is_alive():
            raise TimeoutError(f"rank {rank}: {scenario.name}: {what} not done after {timeout_s:g} s")
    if errors:
        raise RuntimeError(f"rank {rank}: {scenario.name}: " + "; ".join(errors))
    return start, done


def combine(scenario: str, repeat: int, parts: Sequence[Tuple[Optional[float], Dict[str, float]]]) -> MeasuredScenario:
    """Every rank's (start, completions) of one run -> seconds from the first rank's start to each measure and
    transfer (the last rank's), and to each rank's start."""
    start = min(s for s, _ in parts if s is not None)
    measures = {m for _, done in parts for m in done}
    seconds = {m: max(done[m] for _, done in parts if m in done) - start for m in sorted(measures)}
    seconds.update({f"start rank {rank}": s - start for rank, (s, _) in enumerate(parts) if s is not None})
    return MeasuredScenario(scenario, repeat, seconds)


def parse_runs(text: str) -> List[dict]:
    """The measured runs rank 0 printed into a log (``scenario``, ``repeat``, ``seconds`` per measure, per op and
    per rank's start)."""
    return [json.loads(line[len(LINE_PREFIX):]) for line in text.splitlines() if line.startswith(LINE_PREFIX)]


def main(argv: Optional[Sequence[str]] = None) -> None:
    import torch.distributed as dist

    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        raise SystemExit("usage (as a torchrun worker): python -m megatron_pipemesh.bench.flow_probe SPEC.json")
    with open(argv[0], encoding="utf-8") as handle:
        spec = json.load(handle)
    scenarios = [Scenario.from_dict(d) for d in spec["scenarios"]]
    timeout_s = float(spec["timeout_s"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = {key: dist.new_group(list(key[1])) for key in group_keys(scenarios)}
    for repeat in range(-int(spec["warmup"]), int(spec["repeats"])):
        for scenario in scenarios:
            dist.barrier()
            part = run_scenario(scenario, rank, groups, timeout_s)
            parts: List = [None] * world
            dist.all_gather_object(parts, part)
            if rank == 0 and repeat >= 0:
                measured = combine(scenario.name, repeat, parts)
                print(LINE_PREFIX + json.dumps({"scenario": measured.scenario, "repeat": measured.repeat,
                                                "seconds": measured.seconds}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
