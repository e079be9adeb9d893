"""What each rank of a PipeMesh schedule computes per iteration at each group size of one layout, run as
``pipemesh bench --advice`` runs its rows (torchrun, the bench's rank entry, one core per rank), over the plain
loopback and over the bench's shaped per-rank network: compute = the schedule's time less its pipeline and
data-parallel waits, read from the runtime's own interval line. Groups of p are Megatron's order, one group of m
breadth-first; every group size runs the same ops, so a change of compute with the group size is a cost of the
schedule's context that the profile's pieces (timed one forward then its backward) do not see.

    .venv/bin/python scripts/group_compute_check.py [--rate 200] [--rounds 2] [--groups 2 4 8 16] [--megatron-args "..."]

The command runs on 2 ranks (PP = 2, DP = 1): give its micro-batch and global batch sizes so that m = global / micro
is a multiple of every group size. Run it on an idle machine; the shaped network needs root (skipped otherwise).
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
from typing import Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GPT = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256 --max-position-embeddings 256 "
       "--mock-data --tokenizer-type NullTokenizer --vocab-size 2048 --lr 1e-4 --micro-batch-size 2 "
       "--global-batch-size 32 --use-distributed-optimizer --pipeline-model-parallel-size 2 "
       "--num-layers-per-virtual-pipeline-stage 1 --hidden-dropout 0 --attention-dropout 0")
"""The advice ledger's GPT (scripts/advice_accuracy.sh) at the layout its gpt-distopt-dp2 command was advised: PP 2,
V 2, micro-batch 2, m 16."""
WARMUP, ITERS = 4, 10
"""Iterations per run: the first WARMUP are not counted."""


def _microbatches(words: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--global-batch-size", type=int, required=True)
    known, _ = parser.parse_known_args(list(words))
    return known.global_batch_size // known.micro_batch_size


def compute_per_rank(text: str) -> Optional[List[float]]:
    """Median compute ms per iteration per rank past the warm-up: forward-backward less the waits of each interval
    line (one iteration per line at --log-interval 1)."""
    from megatron_pipemesh.integration.report import parse_interval_line

    lines = [f for f in map(parse_interval_line, text.splitlines()) if f is not None and f["iteration"] > WARMUP]
    if not lines:
        return None
    ranks = len(lines[0]["forward-backward"])
    return [statistics.median(f["forward-backward"][r] - f["pipeline wait"][r] - f["data-parallel wait"][r]
                              for f in lines) for r in range(ranks)]


def run(words: List[str], group: int, m: int, namespace, out_dir: str, tag: str) -> Optional[List[float]]:
    from megatron_pipemesh.bench.runner import TRAIN_MODULE, launch_command, run_env, run_once

    groups = [str(group)] * (m // group)
    flags = words + ["--train-iters", str(WARMUP + ITERS), "--log-interval", "1", "--eval-iters", "0",
                     "--eval-interval", "100000", "--pipeline-schedule", "pipemesh", "--forward-groups", *groups,
                     "--backward-groups", *groups]
    env = run_env(1, cores=[0, 1])
    env.pop("PIPEMESH_BENCH_ACTIVATION_METER", None)  # times only, as the advice's runs
    cmd = launch_command(2, flags, namespace.prefix() if namespace else [],
                         rank_namespaces=namespace.rank_namespaces if namespace else None,
                         master_port=29500 + (group * 7 + os.getpid()) % 1000, target=TRAIN_MODULE)
    code, _, _, text = run_once(cmd, env, os.path.join(out_dir, f"{tag}-g{group}.log"), 600, sample_memory=False)
    if code != 0:
        print(f"  g={group}: exit {code}, log {out_dir}/{tag}-g{group}.log", flush=True)
        return None
    return compute_per_rank(text)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-args", default=GPT)
    parser.add_argument("--groups", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--rate", type=float, default=200.0, help="the shaped NIC per rank, Mbit/s")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    from megatron_pipemesh.bench.netns import ShapedNamespace, Shaping, permission_problem

    words = shlex.split(args.megatron_args)
    m = _microbatches(words)
    bad = [g for g in args.groups if g < 2 or m % g]
    if bad:
        parser.error(f"--groups {' '.join(map(str, bad))}: each must be >= 2 (p) and divide m = {m}")
    networks: Dict[str, Optional[Shaping]] = {"loopback": None}
    problem = permission_problem()
    if problem:
        print(f"note: the shaped network is skipped: {problem}")
    else:
        networks[f"{args.rate:g} Mbit/s"] = Shaping(args.rate)
    out_dir = tempfile.mkdtemp(prefix="group-compute-")
    print(f"m = {m}, groups {args.groups}, {args.rounds} round(s), logs in {out_dir}", flush=True)
    table: Dict[str, Dict[int, List[List[float]]]] = {name: {g: [] for g in args.groups} for name in networks}
    for name, shaping in networks.items():
        namespace = ShapedNamespace(shaping, ranks=2) if shaping is not None else None
        try:
            if namespace:
                namespace.__enter__()
            for round_ in range(1, args.rounds + 1):
                for g in args.groups:  # every size once per round: the machine's drift reaches each alike
                    got = run(words, g, m, namespace, out_dir, f"{name.split()[0]}-r{round_}")
                    if got is not None:
                        table[name][g].append(got)
                        print(f"{name} round {round_} g={g}: compute ms/iteration per rank "
                              + " ".join(f"{x:.1f}" for x in got), flush=True)
        finally:
            if namespace:
                namespace.close()
    print("\n| network | group size | compute ms/iteration per rank (mean of rounds) | against groups of p |")
    print("|---|---|---|---|")
    for name, rows in table.items():
        base = None
        for g in args.groups:
            if not rows[g]:
                continue
            mean = [statistics.mean(r[k] for r in rows[g]) for k in range(len(rows[g][0]))]
            base = base or mean
            change = " ".join(f"{100 * (x / b - 1):+.1f}%" for x, b in zip(mean, base))
            print(f"| {name} | {g} | {' '.join(f'{x:.0f}' for x in mean)} | {change} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
