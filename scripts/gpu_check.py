#!/usr/bin/env python
"""What one GPU can check of PipeMesh's GPU path (run through ``scripts/gpu_check.sh``).

Checks (each reports pass/fail/skip with its numbers; a check, or a part of one, that needs CUDA reports ``skipped:
needs CUDA (...)`` without it, never a pass). The JSON summary (``--out``; ``gpu_check_lib/summary.py``) is rewritten
as every check starts and ends, so a run stopped by the shell's timeout keeps what it found and names the check it
stopped in; it lists the checks ``passed``, ``skipped`` (with the reasons; a skip is not a pass) and ``failed`` apart,
and the exit status is 1 when one failed. Each check lives in a module of ``scripts/gpu_check_lib/`` (named in
brackets; ``common.py`` holds the one-process world and the tiny GPT models); this file is the command line only:

* ``executor_<backend>`` [executor]: the executor's forward/backward/send/receive path for every pipeline rank role
  (first stage, middle stages, last stage with the loss; p=4, V=2, elastic groups) in one process. NCCL cannot put
  two ranks on one GPU, so the ranks run as threads and each gives the executor the runtime's in-process loopback
  transport (``runtime/loopback.py``), which on CUDA behaves like NCCL: every thread-rank runs on a compute stream
  of its own, each copy runs on its link's communication stream after an event from each poster, and the waiter's
  stream waits for the copy's event. Losses and every gradient must equal the whole model run by Megatron's
  no-pipelining schedule (fp32); under the "nccl" backend every wait must be untimed (a timed NCCL wait blocks the
  host), under "gloo" every wait timed.
* ``executor_host`` [executor]: the executor check again with a placement plan mixing every kind (device, host,
  selective, full recomputation) on every rank role: host placement's OFFLOAD / RELOAD (side streams, events, pinned
  buffer pool on GPU; synchronous copies on CPU) must leave losses and gradients unchanged.
* ``executor_delayed_copies`` (CUDA) [executor]: ``executor_host`` with every side-stream copy (loopback links,
  offload, reload) starting ~1 ms late (``torch.cuda._sleep``): a missing event wait or ``record_stream`` then lets
  a compute stream reuse or read a block before its copy ran, and the comparison fails instead of the race being
  won.
* ``executor_no_caching`` (CUDA) [executor]: ``executor_host`` in a child process under
  ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` (every free a ``cudaFree``, every allocation a fresh ``cudaMalloc``): what
  only worked because the caching allocator kept a freed block's bytes or reused blocks in a lucky order fails here.
  (``cudaFree`` synchronises the device, so frees racing a side stream are the delayed-copies check's job.)
* ``megatron_path`` [megatron_path]: PipeMesh on Megatron's default GPU path, 3 training steps on 2 thread-ranks
  (V=2): a real process group (NCCL on GPU, even at world size 1; one communicator per thread-rank), bf16 chunks in
  ``Float16Module``, Transformer Engine's layer spec when TE imports, Megatron DDP with ``--overlap-grad-reduce
  --overlap-param-gather``, the distributed optimizer, gradient-accumulation fusion (the ``main_grad`` path; the
  torch wgrad kernels where APEX is absent), and train()'s hooks. The same model runs plain, with host placement,
  and with host placement plus ZeRO-3 on chunk 0, ZeRO-2 on chunk 1 and
  ``--overlap-param-gather-with-optimizer-step``. Host placement covers half of chunk 0's micro-batches on every
  rank and the other half of the last stage's last chunk's: with TE, chunk 0's linears are TE's, which reach
  ``main_grad`` through a weakref and survive a copied weight; Megatron's own fused-wgrad output layer is in the
  last stage's last chunk, and every iteration must move bytes there. Every run must finish (a saved Parameter that
  reaches the fused-wgrad backward as a copy makes DDP's overlap hook assert; a ZeRO-3 release under the optimizer
  step's in-flight gather makes Megatron's next gather assert), the first iteration's losses must be equal, later
  ones within bf16's margin, and a ZeRO-3 chunk's host placement must move what an unsharded one moves. On CUDA also
  the allocator meter runs on every rank, and Megatron's ``max_memory_allocated`` is never lowered. On CPU the same
  code runs with gloo and the local spec (its CUDA-only parts named in the record). One GPU cannot show per-bucket
  expert-parallel groups (MoE needs expert-data-parallel != data-parallel ranks): ``tests/runtime/test_sharding.py``
  does, on CPU.
* ``zero2_backward_groups`` [zero_groups]: ZeRO-2 on every chunk with four backward groups (p=2, V=2, m=8; three
  ``REDUCE`` ops per chunk and iteration, Megatron's bucketing on chunk 0) on the same default path, against the
  same groups unsharded: every rank runs the plan's ``REDUCE`` ops and waits for their reduce-scatters before the
  chunk's next backward (the wait ``runtime/sharding.py`` makes), the first iteration's losses equal and grad norm
  within 1e-5, later ones within bf16's margin. A data-parallel group of one rank finishes a reduce-scatter at once,
  so the runtime's complete late here (the shard poisoned until waited for): a missing wait fails the check.
* ``host_blocks`` [host_blocks]: a plan with host placement and the planner's ``host_blocks`` (every placement kind
  on 2 ranks, two calls): each rank's pinned pool is reserved before the first call, as large as the plan's blocks
  need, no OFFLOAD allocates a block late, and losses and gradients are the whole model's.
* ``meter`` [meter]: the activation bytes one chunk's forward keeps, measured by the runtime's meter (the CUDA
  caching allocator's counters on GPU, saved-tensor hooks on CPU) against the activation model of
  ``planning/memory.py`` at each recompute level, within 10%; on CUDA the meter's peak must be what the forward
  keeps (not its temporaries) and ``max_memory_allocated`` must keep an earlier, larger peak (no reset).
* ``meter_offload`` [meter_offload]: the meter under host placement against the plan: p=2, V=2, m=8 with every
  placement kind on every rank, the meter on (the ranks take turns, so the CUDA allocator's counters are read with
  one rank running; the second call is measured, after one that allocated the one-off workspaces); losses and
  gradients as the whole model's, and each rank's measured device peak and host peak within 10% of the simulator's
  for the same lowered plan (the activation model's own bound, which ``meter`` holds per chunk), the pinned blocks'
  peak within 20% (both round each key up to a power of two).
* ``recompute`` [recompute]: Megatron's recomputation switches (``runtime/recompute.py``) on the device: the
  gradients do not change and the kept bytes fall from none to selective to full.
* ``host_link`` (CUDA) [host_link]: pinned copy bandwidth each direction (``runtime/host_link.py``, the start-up
  measurement of training), one chunk's activations offloaded and reloaded through the runtime's offloader
  (gradients unchanged), and how much of a copy of those bytes hides behind a chunk's forward and backward (hidden
  fraction, bandwidth while overlapping). Prints the ``--pipemesh-host-link-gbps`` value the planner should use (the
  slower direction while overlapping compute).
* ``profile`` [profile]: ``pipemesh profile`` of a small bf16 GPT in a child process measures every piece (each
  micro-batch size and recompute level, the embedding, the output layer, the schedule step on every kind of chunk,
  the data loader, the optimizer, on CUDA the pinned host link); on CUDA also each piece's kept bytes read from the
  allocator within 10% of the saved-tensor meter's count of the same forward, and the profile's timer hiding 5 ms
  of Python in front of 20 ms of device work (its lead keeps the queue ahead, as training does).
* ``timing`` (CUDA) [timing]: CUDA-event op times (``runtime/stats.py``) against synchronised wall time.
* ``bench`` [bench]: the memory-fair CPU benchmark, ``python -m megatron_pipemesh.bench --quick`` with 8 ranks
  (pp4xdp2); off unless ``--bench run`` (or ``--bench auto`` on a machine with the cores for 8 ranks): it can take
  the whole time budget.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import platform
import signal
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

# The checks live in scripts/gpu_check_lib/, next to this file: on sys.path when run as ``python scripts/gpu_check.py``,
# added here when this module is imported from elsewhere (tests).
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from gpu_check_lib.bench import BENCH_RANKS, check_bench  # noqa: E402
from gpu_check_lib.common import cores, needs_cuda, setup  # noqa: E402
from gpu_check_lib.executor import DELAY_CYCLES, check_no_caching, mixed_placement, run_pipeline  # noqa: E402
from gpu_check_lib.host_blocks import check_host_blocks  # noqa: E402
from gpu_check_lib.host_link import check_host_link  # noqa: E402
from gpu_check_lib.megatron_path import check_megatron_path, transformer_engine_version  # noqa: E402
from gpu_check_lib.meter import check_meter  # noqa: E402
from gpu_check_lib.meter_offload import check_meter_offload  # noqa: E402
from gpu_check_lib.profile import check_profile  # noqa: E402
from gpu_check_lib.recompute import check_recompute  # noqa: E402
from gpu_check_lib.summary import Summary  # noqa: E402
from gpu_check_lib.timing import check_timing  # noqa: E402
from gpu_check_lib.zero_groups import check_zero2_backward_groups  # noqa: E402


CHECKS = ("executor_nccl", "executor_gloo", "executor_host", "executor_delayed_copies", "executor_no_caching",
          "megatron_path", "zero2_backward_groups", "host_link", "host_blocks", "meter", "meter_offload", "recompute",
          "profile", "timing", "bench")
"""Every check's name, in the order they run (``executor_gloo`` runs on CPU only: on CUDA the executor runs NCCL's)."""


def _timed(function: Callable[[], dict]) -> dict:
    start = time.monotonic()
    try:
        result = function()
    except Exception as error:  # noqa: BLE001 - a crashing check is a failed check, the others still run
        import traceback
        result = {"status": "fail", "error": f"{type(error).__name__}: {error}",
                  "traceback": traceback.format_exc()[-3000:]}
    result["seconds"] = round(time.monotonic() - start, 3)
    return result


def _stop_on_term(summary: Summary) -> None:
    """On SIGTERM (the shell's ``timeout``): the summary says which check was stopped, then exit 124 as timeout's."""
    def handler(signum, frame):
        summary.write(interrupted=f"stopped by SIGTERM (the time limit) during {summary.running or 'set-up'}")
        print(f"gpu_check: stopped during {summary.running}; results so far in {summary.path}", file=sys.stderr,
              flush=True)
        os._exit(124)

    signal.signal(signal.SIGTERM, handler)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-only", action="store_true",
                        help="run every check on the CPU (the CUDA-only ones report 'skipped: needs CUDA')")
    parser.add_argument("--out", default=None, help="JSON summary path (default: $OUT/gpu_check.json, else ./gpu_check.json)")
    parser.add_argument("--bench", choices=("auto", "run", "skip"), default="skip",
                        help=f"the 8-rank CPU benchmark: skip (default), run, or auto (runs with >= {BENCH_RANKS} cores)")
    parser.add_argument("--budget-s", type=float, default=470.0, help="time budget of the whole check (default 470 s)")
    parser.add_argument("--only", default=None, help="comma-separated check names: run these only")
    parser.add_argument("--delay-cycles", type=int, default=DELAY_CYCLES,
                        help=f"GPU cycles each side-stream copy waits in executor_delayed_copies (default {DELAY_CYCLES})")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.only.split(",")) - set(CHECKS)) if args.only else []
    if unknown:
        parser.error(f"--only {args.only}: no check named {', '.join(unknown)}; the checks are {', '.join(CHECKS)}")
    # Only the JSON summary goes to stdout; Megatron's logging and prints go to stderr.
    sys.stdout.flush()
    summary_stream = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    begin = time.monotonic()
    deadline = begin + args.budget_s
    out = Path(args.out or (Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else "gpu_check.json"))
    out.parent.mkdir(parents=True, exist_ok=True)

    device = setup(args.cpu_only)
    import torch
    from megatron.core import package_info

    cuda = device.type == "cuda"
    only = set(args.only.split(",")) if args.only else None
    backends = ("nccl",) if cuda else ("nccl", "gloo")  # CPU: both wait policies
    checks: Dict[str, Callable[[], dict]] = {f"executor_{backend}": (lambda backend=backend: run_pipeline(device, backend))
                                             for backend in backends}
    checks.update({
        "executor_host": lambda: run_pipeline(device, backends[0], placement=mixed_placement(4, 2, 8)),
        "executor_delayed_copies": lambda: needs_cuda(device, "side streams to delay") or run_pipeline(
            device, "nccl", placement=mixed_placement(4, 2, 8), delay_cycles=args.delay_cycles),
        "executor_no_caching": lambda: needs_cuda(device, "the CUDA caching allocator to turn off")
        or check_no_caching(out.parent, deadline),
        "megatron_path": lambda: check_megatron_path(device, "nccl" if cuda else "gloo"),
        "zero2_backward_groups": lambda: check_zero2_backward_groups(device, "nccl" if cuda else "gloo"),
        "host_link": lambda: check_host_link(device),
        "host_blocks": lambda: check_host_blocks(device),
        "meter": lambda: check_meter(device),
        "meter_offload": lambda: check_meter_offload(device),
        "recompute": lambda: check_recompute(device),
        "profile": lambda: check_profile(device, out.parent, deadline),
        "timing": lambda: check_timing(device),
        "bench": lambda: check_bench(out.parent, deadline, args.bench),
    })
    planned = [name for name in CHECKS if name in checks and (only is None or name in only)]
    summary = Summary(out, {
        "mode": "cpu-only" if args.cpu_only else ("gpu" if cuda else "cpu (no CUDA)"),
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        "cores": cores(), "torch": torch.__version__, "megatron_core": package_info.__version__,
        "transformer_engine": transformer_engine_version() if cuda else None, "seconds": 0.0}, planned)
    _stop_on_term(summary)
    for name in planned:
        summary.start(name)
        result = _timed(checks[name])
        summary.header["seconds"] = round(time.monotonic() - begin, 1)
        summary.record(name, result)
        print(f"gpu_check: {name}: {result['status']} ({result['seconds']:.1f} s)", file=sys.stderr, flush=True)
    text = summary.write(complete=True)
    print(text, file=summary_stream, flush=True)
    print(summary.line(), file=sys.stderr)
    import torch.distributed as dist
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    return 1 if summary.failed else 0


if __name__ == "__main__":
    sys.exit(main())
