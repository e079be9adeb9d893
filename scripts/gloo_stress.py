"""Reproduce torch's gloo heap corruption under overlapped collectives, with torch alone (no Megatron; of PipeMesh only
the CPU layer's knob for the worker threads, with ``--threads``).

Run on 4 CPU ranks (PP=2 x DP=2 as Megatron lays them out: data-parallel groups [0, 1] and [2, 3], pipeline pairs
(0, 2) and (1, 3), one two-rank group per pipeline link and direction)::

    torchrun --nproc-per-node 4 scripts/gloo_stress.py --iterations 8000            # torch's 2 worker threads
    torchrun --nproc-per-node 4 scripts/gloo_stress.py --iterations 8000 --threads 1

Each iteration does what an overlapped Megatron step does on one data-parallel group: three bucket all-gathers
through ``_coalescing_manager`` in flight together, four pipeline sends and receives each way on the link groups
with matmuls in between, then three bucket reduce-scatters in flight together, then every wait. With torch 2.13's
default of two worker threads per gloo group a rank dies within a few thousand iterations, in a worker thread's
``malloc`` ("malloc(): unaligned tcache chunk detected", or SIGSEGV in ``gloo::transport::tcp::UnboundBuffer``).
With ``--threads 1`` it runs through: what ``megatron_pipemesh.integration.cpu_compat`` item 14 sets on CPU.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import _coalescing_manager

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatron_pipemesh.integration.cpu_compat import set_gloo_worker_threads  # noqa: E402 (torch only, no Megatron)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=8000)
    parser.add_argument("--threads", type=int, default=0, help="worker threads per gloo group (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        set_gloo_worker_threads(args.threads)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if dist.get_world_size() != 4:
        raise SystemExit("run with torchrun --nproc-per-node 4")
    data_parallel = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    links = {}
    for a, b in ((0, 2), (1, 3)):
        for direction in "FB":
            for src, dst in ((a, b), (b, a)):
                links[(direction, src, dst)] = dist.new_group([src, dst])
    peer, slot = (rank + 2) % 4, rank % 2
    params = [torch.randn(40000 + 4000 * i) for i in range(3)]
    grads = [torch.randn(40000 + 4000 * i) for i in range(3)]
    weight = torch.randn(64, 64, requires_grad=True)
    shape = (64, 2, 64)

    def bucket_collectives(buffers, collective):
        handles = []
        for buffer in buffers:
            n = buffer.numel() // 2
            with _coalescing_manager(data_parallel, async_ops=True) as cm:
                collective(buffer, buffer[slot * n:(slot + 1) * n])
            handles.append(cm)
            (torch.randn(shape) @ weight).sum().backward()
        return handles

    for iteration in range(args.iterations):
        gathers = bucket_collectives(params, lambda whole, mine: dist.all_gather_into_tensor(
            whole, mine, group=data_parallel, async_op=True))
        transfers = []
        for tag in range(4):
            out, into = torch.randn(shape) @ weight.detach(), torch.empty(shape)
            send, recv = ("F", "B") if rank < 2 else ("B", "F")
            transfers.append(dist.isend(out, peer, group=links[(send, rank, peer)], tag=tag))
            transfers.append(dist.irecv(into, peer, group=links[(recv, peer, rank)], tag=tag))
            (torch.randn(shape) @ weight).sum().backward()
        for handle in gathers:
            handle.wait()
        reduces = bucket_collectives(grads, lambda whole, mine: dist.reduce_scatter_tensor(
            mine, whole, group=data_parallel, async_op=True))
        for handle in transfers + reduces:
            handle.wait()
        for grad in grads:
            grad.mul_(0.5)
        if rank == 0 and iteration % 1000 == 0:
            print(f"iteration {iteration}", flush=True)
    dist.barrier()
    print(f"rank {rank}: {args.iterations} iterations, no fault", flush=True)


if __name__ == "__main__":
    main()
