"""Measure the emulated NIC one transfer at a time, against a token bucket of its burst and the network model.

Two ranks in the bench's per-rank network (:class:`~megatron_pipemesh.bench.netns.ShapedNamespace`, each NIC shaped
at ``--rate`` each way with tc's ``--burst``) time a gloo send of ``--kib`` KiB from rank 0 to rank 1 (until rank 1
acknowledges it) after the link idled ``gap`` ms, for several gaps, and print each median next to
what a token bucket of tc's burst refilled at the rate while idle would take, and what the network model takes
(:class:`~megatron_pipemesh.planning.network.FairShareNetwork`: a NIC at its rate, no burst).

Usage (root, for the namespaces; about 30 s on an idle 2-core machine)::

    .venv/bin/python scripts/nic_burst_check.py [--rate 100mbit] [--kib 512] [--burst 262144]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

GAPS_MS = (0.0, 5.0, 10.0, 20.0, 30.0, 100.0)
REPEATS = 10
WARMUP = 2


def worker() -> None:
    """One rank: rank 0 sends, rank 1 receives and acknowledges; rank 0 prints ``gap_ms median_ms`` per gap."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    data = torch.ones(int(os.environ["NIC_CHECK_BYTES"]) // 4)
    ack = torch.zeros(1)
    for gap_ms in GAPS_MS:
        seconds = []
        for _ in range(WARMUP + REPEATS):
            dist.barrier()
            time.sleep(gap_ms / 1e3)
            start = time.perf_counter()
            if rank == 0:
                dist.send(data, 1)
                dist.recv(ack, 1)
            else:
                dist.recv(data, 0)
                dist.send(ack, 0)
            seconds.append(time.perf_counter() - start)
        if rank == 0:
            print(f"NIC-CHECK {gap_ms:g} {statistics.median(seconds[WARMUP:]) * 1e3:.3f}", flush=True)
    dist.destroy_process_group()


def bucket_ms(nbytes: float, idle_s: float, rate: float, burst: float) -> float:
    """A token bucket's time for ``nbytes`` at ``rate`` bytes/s started ``idle_s`` after the same transfer drained
    it: what refilled while idle (at most ``burst``) passes at once, the rest at the rate."""
    return max(0.0, nbytes - min(burst, idle_s * rate)) / rate * 1e3


def main(argv=None) -> int:
    if os.environ.get("LOCAL_RANK") is not None:
        worker()
        return 0
    from megatron_pipemesh.bench.netns import MIN_BURST_BYTES, ShapedNamespace, Shaping, parse_rate_mbit
    from megatron_pipemesh.bench.runner import error_excerpt, launch_command, run_once

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="100mbit", help="each rank's NIC, each way (default 100mbit)")
    parser.add_argument("--kib", type=float, default=512.0, help="the transfer (default 512 KiB)")
    parser.add_argument("--burst", type=int, default=MIN_BURST_BYTES, help=f"tc's burst (default {MIN_BURST_BYTES})")
    parser.add_argument("--log", default="/tmp/nic_burst_check.log")
    args = parser.parse_args(argv)
    shaping = Shaping(parse_rate_mbit(args.rate), burst_bytes=args.burst)
    nbytes = int(args.kib * 1024)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "NIC_CHECK_BYTES": str(nbytes)}
    with ShapedNamespace(shaping, ranks=2) as namespace:
        cmd = launch_command(2, [], namespace.prefix(), rank_namespaces=namespace.rank_namespaces,
                             target=(os.path.abspath(__file__),))
        code, _, _, text = run_once(cmd, env, args.log, 300.0, cwd=REPO, sample_memory=False)
    if code != 0:
        print(f"the check failed (exit {code}): {error_excerpt(text, 20)}", file=sys.stderr)
        return 1
    rate = shaping.payload_bytes_per_s
    print(f"{args.kib:g} KiB, rank 0 -> rank 1 then a 4-byte acknowledgement, median of {REPEATS}; "
          f"{shaping.describe()}, burst {args.burst} B, payload {rate * 8 / 1e6:.2f} Mbit/s")
    print(f"{'idle ms':>8} {'measured ms':>12} {'bucket ms':>10} {'network model ms':>17}")
    for line in text.splitlines():
        if line.startswith("NIC-CHECK "):
            gap_ms, measured = (float(v) for v in line.split()[1:])
            # the barrier before each transfer idles the link too (about a millisecond): not in the idle column
            print(f"{gap_ms:8g} {measured:12.2f} {bucket_ms(nbytes, gap_ms / 1e3, rate, args.burst):10.2f} "
                  f"{bucket_ms(nbytes, 0.0, rate, 0.0):17.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
