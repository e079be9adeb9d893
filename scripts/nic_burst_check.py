"""Measure the emulated NIC one transfer at a time, against a token bucket of its burst and the network model.

Two ranks in the bench's per-rank network (:class:`~megatron_pipemesh.bench.netns.ShapedNamespace`, each NIC shaped
at ``--rate`` each way with tc's ``--burst``) time a gloo send of each ``--kib`` size from rank 0 to rank 1, one
way (both ranks read the machine's one monotonic clock), after the link idled ``gap`` ms, for several gaps, and print
each median next to what a token bucket of tc's burst refilled at the rate while idle would take (its burst at once)
and what the NIC at its rate without a burst takes.

Usage (root, for the namespaces; about 30 s on an idle 2-core machine)::

    .venv/bin/python scripts/nic_burst_check.py [--rate 100mbit] [--kib 0.004 64 256 512] [--burst 262144]
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
    """One rank: rank 0 sends each size after each gap, rank 1 receives; both note the machine's monotonic clock
    (one clock for every namespace), so the one-way time is rank 1's end less rank 0's start. Rank 0 prints
    ``NIC-CHECK kib gap_ms median_ms`` per size and gap."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for kib in (float(k) for k in os.environ["NIC_CHECK_KIB"].split(",")):
        data = torch.ones(max(1, int(kib * 1024) // 4))
        for gap_ms in GAPS_MS:
            stamps = []
            for _ in range(WARMUP + REPEATS):
                dist.barrier()
                time.sleep(gap_ms / 1e3)
                if rank == 0:
                    stamps.append(time.monotonic())
                    dist.send(data, 1)
                else:
                    dist.recv(data, 0)
                    stamps.append(time.monotonic())
            both = [None, None]
            dist.all_gather_object(both, stamps)
            if rank == 0:
                one_way = [end - start for start, end in zip(both[0], both[1])][WARMUP:]
                print(f"NIC-CHECK {kib:g} {gap_ms:g} {statistics.median(one_way) * 1e3:.3f}", flush=True)
    dist.destroy_process_group()


def bucket_ms(nbytes: float, idle_s: float, rate: float, burst: float) -> float:
    """A token bucket's time for ``nbytes`` at ``rate`` data bytes/s started ``idle_s`` after the same transfer
    drained it: what refilled while idle (at most ``burst`` data bytes) passes at once, the rest at the rate."""
    return max(0.0, nbytes - min(burst, idle_s * rate)) / rate * 1e3


def main(argv=None) -> int:
    if os.environ.get("LOCAL_RANK") is not None:
        worker()
        return 0
    from megatron_pipemesh.bench.netns import MIN_BURST_BYTES, Shaping, parse_rate_mbit
    from megatron_pipemesh.bench.runner import error_excerpt, run_workers

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="100mbit", help="each rank's NIC, each way (default 100mbit)")
    parser.add_argument("--kib", type=float, nargs="+", default=[512.0],
                        help="the transfers' sizes (default 512 KiB)")
    parser.add_argument("--burst", type=int, default=MIN_BURST_BYTES, help=f"tc's burst (default {MIN_BURST_BYTES})")
    parser.add_argument("--log", default="/tmp/nic_burst_check.log")
    args = parser.parse_args(argv)
    shaping = Shaping(parse_rate_mbit(args.rate), burst_bytes=args.burst)
    os.environ["NIC_CHECK_KIB"] = ",".join(f"{k:g}" for k in args.kib)  # the workers' sizes
    code, _, text = run_workers(shaping, 2, (os.path.abspath(__file__),), [], args.log, 300.0, cwd=REPO)
    if code != 0:
        print(f"the check failed (exit {code}): {error_excerpt(text, 20)}", file=sys.stderr)
        return 1
    rate = shaping.payload_bytes_per_s
    print(f"rank 0 -> rank 1, one way (rank 1's end less rank 0's start, one clock), median of {REPEATS}; "
          f"{shaping.describe()}, burst {args.burst} B ({shaping.payload_burst_bytes:.0f} of data), payload "
          f"{rate * 8 / 1e6:.2f} Mbit/s")
    print(f"{'KiB':>6} {'idle ms':>8} {'measured ms':>12} {'bucket ms':>10} {'no burst ms':>12}")
    for line in text.splitlines():
        if line.startswith("NIC-CHECK "):
            kib, gap_ms, measured = (float(v) for v in line.split()[1:])
            nbytes = kib * 1024
            # the barrier before each transfer idles the link too (about a millisecond): not in the idle column
            print(f"{kib:6g} {gap_ms:8g} {measured:12.3f} {bucket_ms(nbytes, gap_ms / 1e3, rate, shaping.payload_burst_bytes):10.3f} "
                  f"{bucket_ms(nbytes, 0.0, rate, 0.0):12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
