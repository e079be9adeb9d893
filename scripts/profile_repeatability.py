"""Two ``pipemesh profile`` runs of the same command in a row: per compute piece of 1 ms or more, both medians and
their relative difference as measured and at one pace of the machine (the second profile's times brought to the
first's pace, :class:`megatron_pipemesh.planning.profile_quality.MachinePace`), each profile's spread, load record
and pace, and whether every piece agrees within 5%.

    .venv/bin/python scripts/profile_repeatability.py [--megatron-args "..."] [--ranks-per-node 2] [--out DIR]

Exit 0 when every piece of 1 ms or more agrees within the tolerance at one pace (as measured where a profile has no
pace), 1 when one does not, 2 when a profile failed.
The default command is a Llama-style GPT at PP=2 (GQA, SwiGLU, RMSNorm, RoPE), profiled as ``bench --advice`` does
for two ranks on this machine (``--ranks-per-node 2``).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_pipemesh.planning.profile import Profile, load  # noqa: E402

LLAMA = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --group-query-attention --num-query-groups 2 "
         "--swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights "
         "--disable-bias-linear --seq-length 256 --max-position-embeddings 256 --micro-batch-size 2 "
         "--global-batch-size 16 --train-iters 3 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
         "--vocab-size 4096 --pipeline-model-parallel-size 2")
SMALLEST_S = 1e-3
"""Pieces below this are not compared (the tolerance is about the pieces that price a step)."""


def pieces(profile: Profile) -> Dict[str, float]:
    """Every compute time of ``profile`` by '<field> mbs <size>' (recompute extras and schedule steps per kind)."""
    out = {}
    for point in profile.compute:
        for name in ("layer_forward_s", "layer_backward_s", "embedding_forward_s", "embedding_backward_s",
                     "output_forward_s", "output_backward_s", "batch_s"):
            value = getattr(point, name)
            if value is not None:
                out[f"{name} mbs {point.micro_batch_size}"] = value
        for group in ("recompute_extra_s", "step_forward_s", "step_backward_s"):
            for kind, value in (getattr(point, group) or {}).items():
                out[f"{group}:{kind} mbs {point.micro_batch_size}"] = value
    return out


def spread_of(profile: Profile, key: str) -> str:
    name, _, size = key.rpartition(" mbs ")
    point = profile.point(1, int(size))
    spread = (point.spread or {}).get(name) if point is not None else None
    return "-" if spread is None else f"±{spread.relative_half_width * 100:.1f}%{'' if spread.stable else ' cap'}"


def compare(first: Profile, second: Profile, tolerance: float) -> Tuple[List[str], bool, bool]:
    """The table's lines and whether every piece of :data:`SMALLEST_S` or more agrees within ``tolerance`` as
    measured, and at one pace (the second's times times the first's pace over its own; as measured without paces)."""
    a, b = pieces(first), pieces(second)
    to_first = first.pace.seconds / second.pace.seconds if first.pace and second.pace else 1.0
    header = (f"{'piece':<44} {'first ms':>9} {'second ms':>9} {'diff':>7} {'one pace':>8}  {'spread 1':>11} "
              f"{'spread 2':>11}")
    lines, agree, agree_paced = [header, "-" * len(header)], True, True
    for key in a:
        if key not in b or max(a[key], b[key]) < SMALLEST_S:
            continue
        diff = (b[key] - a[key]) / a[key] if a[key] > 0 else float("inf")
        # the data loader is not timed at the pace (a child process, mostly Python and I/O)
        paced = diff if key.startswith("batch_s") else (b[key] * to_first - a[key]) / a[key] if a[key] > 0 else diff
        agree &= abs(diff) <= tolerance
        agree_paced &= abs(paced) <= tolerance
        lines.append(f"{key:<44} {a[key] * 1e3:>9.3f} {b[key] * 1e3:>9.3f} {diff * 100:>+6.1f}% {paced * 100:>+7.1f}%  "
                     f"{spread_of(first, key):>11} {spread_of(second, key):>11}"
                     + ("  OVER" if abs(paced) > tolerance else ""))
    return lines, agree, agree_paced


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-args", default=LLAMA)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--tolerance", type=float, default=0.05)
    parser.add_argument("--out", default="profile-repeatability")
    parser.add_argument("--extra", default="", help="more pipemesh profile flags, one quoted string")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    found = []
    for index in (1, 2):
        path = os.path.join(args.out, f"profile{index}.json")
        began = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "megatron_pipemesh", "profile", "--megatron-args",
                               args.megatron_args, "--ranks-per-node", str(args.ranks_per_node), "--output", path,
                               "--quiet", *args.extra.split()],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            print(f"profile {index} failed:\n{done.stderr[-3000:]}", file=sys.stderr)
            return 2
        took = time.perf_counter() - began
        found.append(load(path))
        print(f"profile {index}: {took:.0f} s; " + (found[-1].pace.describe() if found[-1].pace else "no pace")
              + "; " + (found[-1].load.describe() if found[-1].load else "load not recorded"))
    lines, agree, agree_paced = compare(found[0], found[1], args.tolerance)
    print("\n".join(lines))
    if found[0].pace and found[1].pace:
        print(f"the machine's pace moved {(found[1].pace.seconds / found[0].pace.seconds - 1) * 100:+.1f}% from "
              "profile 1 to profile 2 ('one pace': the second's times at the first's pace)")
    print(f"every piece of {SMALLEST_S * 1e3:g} ms or more within {args.tolerance:.0%}: as measured "
          f"{'yes' if agree else 'no'}, at one pace {'yes' if agree_paced else 'no'}")
    return 0 if agree_paced else 1


if __name__ == "__main__":
    sys.exit(main())
