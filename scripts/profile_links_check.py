"""Check that ``pipemesh profile`` measures the NIC the bench's emulated network gives each rank.

Runs the two-rank profile of a tiny GPT inside the bench's per-rank network (:class:`~megatron_pipemesh.bench.netns.
ShapedNamespace`: every rank in a namespace of its own, its NIC shaped at ``--rate`` each way), so the profile finds
two nodes of one rank each and times p2p and collectives between them. Prints the NIC rate the profile measured next
to the shaped payload rate (:attr:`~megatron_pipemesh.bench.netns.Shaping.payload_bytes_per_s`: the rate less the
frame headers), every link point it timed, and the report line of ``pipemesh plan --profile`` without --nic-gbps.

Usage (root, for the namespaces; about a minute on an idle 2-core machine)::

    .venv/bin/python scripts/profile_links_check.py --rate 100mbit [--out-dir /tmp/profile-links] [--bucket-mib 4]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
        "--micro-batch-size 2 --global-batch-size 8 --train-iters 3 --lr 1e-3 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 257 --pipeline-model-parallel-size 2")
"""The smallest GPT the profile builds (the compute part is not what this checks)."""


def main(argv=None) -> int:
    from megatron_pipemesh.bench.netns import Shaping, parse_rate_mbit
    from megatron_pipemesh.bench.runner import error_excerpt, run_workers
    from megatron_pipemesh.planning.profile import load

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="100mbit", help="each rank's NIC, each way (default 100mbit)")
    parser.add_argument("--out-dir", default="/tmp/profile-links-check")
    parser.add_argument("--bucket-mib", type=float, default=4.0, help="the larger message (default 4 MiB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    shaping = Shaping(parse_rate_mbit(args.rate))
    output = os.path.join(args.out_dir, "profile.json")
    profile_args = ["--megatron-args", TINY, "--output", output, "--repeats", str(args.repeats), "--warmup", "1",
                    "--bucket-mib", f"{args.bucket_mib:g}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}
    log_path = os.path.join(args.out_dir, "profile.log")
    print(f"profile on the emulated network ({shaping.describe()}); log {log_path}", flush=True)
    code, wall, text = run_workers(shaping, 2, ("-m", "megatron_pipemesh", "profile"), profile_args, log_path,
                                   args.timeout, cwd=REPO)
    if code != 0:
        print(f"the profile failed (exit {code}): {error_excerpt(text, 20)}", file=sys.stderr)
        return 1
    network = load(output).network
    shaped = shaping.payload_bytes_per_s * 8 / 1e9
    print(f"profiled in {wall:.1f} s: {network.nodes} nodes ({network.backend})")
    print(f"NIC measured {network.nic_gbps:.4f} Gbit/s ({network.nic_from}); shaped payload rate {shaped:.4f} "
          f"Gbit/s; measured / shaped = {network.nic_gbps / shaped:.3f}")
    for point in network.points:
        print(f"  {point.pattern:<15} {point.scope:<14} {point.nbytes:>9} bytes  median {point.median_s * 1e3:9.3f} ms"
              f"  {point.gbps:.4f} Gbit/s ({point.gbps / shaped:.3f} of shaped)")
    plan = subprocess.run([sys.executable, "-m", "megatron_pipemesh", "plan", "--nodes", "2", "--gpus-per-node",
                           "1", "--device-memory-gb", "1", "--quiet", "--json", "--megatron-args", TINY,
                           "--profile", output], capture_output=True, text=True, cwd=REPO, env=env)
    if plan.returncode != 0:
        print(f"pipemesh plan --profile failed: {plan.stderr[-2000:]}", file=sys.stderr)
        return 1
    report = json.loads(plan.stdout)["profile"]
    print("plan --profile without --nic-gbps: measured " + "; ".join(report["measured"]["1"]))
    print("  assumed " + "; ".join(report["assumed"]["1"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
