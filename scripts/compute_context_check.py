"""What one layer's forward and backward cost in the context of a training run, one cause at a time, against the way
``pipemesh profile`` times them (a forward, then at once its backward, on a bare layer, alone on its core):

* micro-batches in flight: K forwards before their K backwards (the saved activations leave the caches) -- K = 2, 4, 8;
* chunks alternating: the forwards and backwards switch between 2 or 4 distinct layers (an interleaved rank's chunks);
* Megatron's DDP: the layer wrapped in ``DistributedDataParallel`` (gradient hooks into the ``main_grad`` buffers);
* traffic: two ranks on the bench's shaped per-rank network (root), each timing the layer while a thread sends and
  receives messages of one micro-batch's activations with the other, both ways at once (a pipeline's p2p beside its
  compute), against the same two ranks without traffic.

    .venv/bin/python scripts/compute_context_check.py [--megatron-args "..."] [--micro-batch-size 2] [--rate 100]

Each case prints its medians and its change against the profile's way; a cause the profile misses shows as a change
beyond the noise (the two rounds of the profile's own way show the noise). Run it on an idle machine.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LLAMA = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --group-query-attention --num-query-groups 2 "
         "--swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights "
         "--disable-bias-linear --seq-length 256 --max-position-embeddings 256 --mock-data --tokenizer-type "
         "NullTokenizer --vocab-size 2048 --train-iters 10 --lr 1e-4 --micro-batch-size 2 --global-batch-size 16")
ROUNDS = 14
"""Rounds per case; the first two are warm-up."""


class Layers:
    """Layers of the command built as the profile builds them, and their timed forward and backward."""

    def __init__(self, words: List[str], size: int, count: int):
        from megatron_pipemesh.integration.bootstrap import prepare_megatron_import

        prepare_megatron_import()
        import torch

        from megatron_pipemesh.integration.cpu_compat import apply_cpu_compat
        from megatron_pipemesh.integration.profile import command_args, start_process_group
        from megatron_pipemesh.integration.profile_models import gpt, level_args, with_main_grads
        from megatron_pipemesh.integration.profile_pieces import attention_mask
        from megatron_pipemesh.integration.profile_timing import ProfileSettings

        apply_cpu_compat()
        torch.set_num_threads(1)
        self.torch = torch
        self.args, _, run = command_args(words, False)
        self.stop = start_process_group(False)  # a one-rank world, or Megatron's state in the two ranks' one
        self.build = lambda: gpt(level_args(self.args, "none"), run.model.layer_spec, ProfileSettings(), False,
                                 False, False)
        self.layers = []
        for _ in range(count):
            model, self.config = self.build()
            with_main_grads(model)
            self.layers.append((model, model))
        self.mask = attention_mask(self.args, torch.device("cpu"))
        generator = torch.Generator().manual_seed(size)
        self.inputs = [torch.randn(self.args.seq_length, size, self.args.hidden_size, generator=generator)
                       for _ in range(8)]

    def forward(self, layer: Tuple[object, object], x) -> Tuple[object, float]:
        call, inner = layer
        start = time.perf_counter()
        inner.set_input_tensor(x.clone().requires_grad_(True))
        out = call(input_ids=None, position_ids=None, attention_mask=self.mask)
        inner.set_input_tensor(None)
        return out, time.perf_counter() - start

    def backward(self, out) -> float:
        start = time.perf_counter()
        self.torch.autograd.backward(out, self.torch.ones_like(out) * 1e-3)
        return time.perf_counter() - start


def pattern(layers: Layers, in_flight: int, chunks: int, which=None) -> Callable[[], Tuple[List[float], List[float]]]:
    """One round: ``in_flight`` micro-batches' forwards through ``chunks`` layers each, then their backwards in the
    order they came."""
    chosen = which or layers.layers[:chunks]

    def run():
        outs, forwards = [], []
        for i in range(in_flight):
            for layer in chosen:
                out, seconds = layers.forward(layer, layers.inputs[i])
                outs.append(out)
                forwards.append(seconds)
        return forwards, [layers.backward(out) for out in outs]
    return run


def medians(run: Callable[[], Tuple[List[float], List[float]]], rounds: int = ROUNDS) -> Tuple[float, float]:
    forwards, backwards = [], []
    for index in range(rounds):
        f, b = run()
        if index >= 2:
            forwards += f
            backwards += b
    return statistics.median(forwards), statistics.median(backwards)


def local_cases(words: List[str], size: int) -> Dict[str, Tuple[float, float]]:
    """Every case of one process, pinned to core 0, taking turns with the profile's way."""
    os.sched_setaffinity(0, {0})
    layers = Layers(words, size, 4)  # first: it prepares Megatron's import on CPU
    from megatron.core.distributed import DistributedDataParallel
    from megatron.training.training import get_megatron_ddp_config

    from megatron_pipemesh.integration.profile_models import megatron_quiet
    from megatron_pipemesh.integration.profile_optimizer import optimizer_args, own_groups

    try:
        model, config = layers.build()
        with megatron_quiet():
            wrapped = DistributedDataParallel(config=config, ddp_config=get_megatron_ddp_config(
                optimizer_args(layers.args)), module=model, pg_collection=own_groups())
        cases = {"profile's way (forward, then its backward)": pattern(layers, 1, 1)}
        cases.update({f"{k} micro-batches in flight": pattern(layers, k, 1) for k in (2, 4, 8)})
        cases.update({f"{c} chunks alternating, 2 in flight": pattern(layers, 2, c) for c in (2, 4)})
        cases["in Megatron's DDP (gradient hooks)"] = pattern(layers, 1, 1, [(wrapped, model)])
        found = {}
        for round_ in range(2):
            for name, run in cases.items():
                key = name if round_ == 0 or not name.startswith("profile") else name + ", again"
                found[key] = medians(run)
        return found
    finally:
        layers.stop()


def traffic_rank(words: List[str], size: int, kib: int) -> None:
    """One rank of the traffic case (launched by :func:`traffic_cases` in its namespace): prints its medians."""
    import datetime

    rank = int(os.environ["RANK"])
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    layers = Layers(words, size, 1)
    import torch

    stop, moved = threading.Event(), [0]
    group = dist.new_group([0, 1], backend="gloo")  # the traffic's own: the barriers below use the default one

    def traffic():
        buffer, peer = torch.zeros(kib * 256), 1 - rank
        while not stop.is_set():
            ops = [dist.P2POp(dist.isend, buffer, peer, group),
                   dist.P2POp(dist.irecv, torch.empty_like(buffer), peer, group)]
            for request in dist.batch_isend_irecv(ops):
                request.wait()
            moved[0] += buffer.numel() * 4

    for round_ in range(2):
        for loaded in (False, True):
            thread = threading.Thread(target=traffic, daemon=True)
            if loaded:
                stop.clear()
                thread.start()
                time.sleep(1.0)
            dist.barrier()
            start, before = time.perf_counter(), moved[0]
            forward, backward = medians(pattern(layers, 1, 1), ROUNDS * 2)
            rate = (moved[0] - before) * 8 / (time.perf_counter() - start) / 1e6
            print(f"RESULT {rank} {int(loaded)} {round_} {forward} {backward} {rate}", flush=True)
            if loaded:
                stop.set()
                thread.join()
    dist.barrier()
    dist.destroy_process_group()


def traffic_cases(words: List[str], size: int, rate: float) -> Dict[str, Tuple[float, float]]:
    """Two ranks on the shaped per-rank network at ``rate`` Mbit/s, each sending one micro-batch's activations at a
    time to the other while it times the layer, against the same ranks without traffic (medians of both ranks)."""
    from megatron_pipemesh.bench.netns import (RANK_INTERFACE, ShapedNamespace, Shaping, permission_problem,
                                               rank_address, rank_namespace)

    problem = permission_problem()
    if problem:
        print(f"traffic case skipped: {problem}", file=sys.stderr)
        return {}
    seq, hidden = (int(words[words.index(flag) + 1]) for flag in ("--seq-length", "--hidden-size"))
    kib = max(1, seq * size * hidden * 4 // 1024)  # one micro-batch's fp32 activations
    results: Dict[Tuple[int, int], List[Tuple[float, float, float]]] = {}
    with ShapedNamespace(Shaping(rate), ranks=2) as namespace:
        children, logs = [], [tempfile.TemporaryFile("w+") for _ in range(2)]  # files: a full pipe would block a rank
        for rank in range(2):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": rank_address(0),
                   "MASTER_PORT": "29631", "GLOO_SOCKET_IFNAME": RANK_INTERFACE, "OMP_NUM_THREADS": "1"}
            children.append(subprocess.Popen(
                ["ip", "netns", "exec", rank_namespace(namespace.name, rank), sys.executable, __file__,
                 "--traffic-rank", "--megatron-args", " ".join(words), "--micro-batch-size", str(size),
                 "--kib", str(kib)], env=env, stdout=logs[rank], stderr=subprocess.STDOUT, text=True))
        outputs = []
        for rank, (child, log) in enumerate(zip(children, logs)):
            child.wait(timeout=600)
            log.seek(0)
            outputs.append(log.read())
        failed = [f"rank {rank} exited with {child.returncode}:\n"
                  + "\n".join([line for line in out.splitlines() if "RESULT" in line or "compute_context" in line]
                              + out.splitlines()[-2:])
                  for rank, (child, out) in enumerate(zip(children, outputs)) if child.returncode]
        if failed:
            raise SystemExit("traffic case: " + "\n".join(failed))
        for out in outputs:
            for line in out.splitlines():
                if line.startswith("RESULT "):
                    _, rank, loaded, _, forward, backward, moved = line.split()
                    results.setdefault((int(loaded), int(rank)), []).append(
                        (float(forward), float(backward), float(moved)))
    found = {}
    for loaded, name in ((0, "2 ranks, no traffic"), (1, f"2 ranks, {kib} KiB messages both ways at {rate:g} Mbit/s")):
        rows = [row for rank in range(2) for row in results.get((loaded, rank), [])]
        if rows:
            moved = statistics.median(row[2] for row in rows)
            found[name + (f" (moved {moved:.0f} Mbit/s)" if loaded else "")] = (
                statistics.median(row[0] for row in rows), statistics.median(row[1] for row in rows))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-args", default=LLAMA, help="the command's model flags (default: a Llama-style "
                        "GPT of hidden 256)")
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--rate", type=float, default=100.0, help="the traffic case's NIC rate, Mbit/s each way")
    parser.add_argument("--traffic-rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kib", type=int, default=0, help=argparse.SUPPRESS)
    options = parser.parse_args()
    words = options.megatron_args.split()
    if options.traffic_rank:
        traffic_rank(words, options.micro_batch_size, options.kib)
        return 0
    found = local_cases(words, options.micro_batch_size)
    found.update(traffic_cases(words, options.micro_batch_size, options.rate))
    base = next(iter(found.values()))
    print(f"one layer at micro-batch size {options.micro_batch_size}; change against the profile's way\n")
    print(f"{'case':70s} {'fwd ms':>8s} {'bwd ms':>8s} {'fwd':>7s} {'bwd':>7s}")
    quiet = None
    for name, (forward, backward) in found.items():
        reference = base
        if name.startswith("2 ranks"):  # the traffic case against the same two ranks without it
            quiet = quiet or (forward, backward)
            reference = quiet
        print(f"{name:70s} {forward * 1e3:8.2f} {backward * 1e3:8.2f} {forward / reference[0] - 1:+7.1%} "
              f"{backward / reference[1] - 1:+7.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
