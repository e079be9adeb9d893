"""Do separately built instances of one transformer layer compute at the same speed? Builds ``--instances`` copies of
the command's layer (as ``pipemesh profile`` builds its one), with allocations of varying size between them (a
process's earlier work), and times each instance's forward + backward at ``--micro-batch`` round-robin, one core,
one thread; prints each instance's median and the spread between instances.

    .venv/bin/python scripts/layer_instances_check.py [--megatron-args "..."] [--instances 6] [--micro-batch 1]

:func:`prepared` and :func:`layer_call` also serve ``scripts/layer_drift_check.py``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.profile_repeatability import LLAMA  # noqa: E402


def prepared(megatron_args: str):
    """This process on core 0 with one thread, Megatron imported with the CPU layer applied, the command read as the
    profile reads it: (Megatron's args, the command as planned, as run here, the teardown)."""
    sys.argv = sys.argv[:1]
    from megatron_pipemesh.integration.bootstrap import prepare_megatron_import

    prepare_megatron_import()
    import torch

    from megatron_pipemesh.integration.cpu_compat import apply_cpu_compat
    from megatron_pipemesh.integration.profile import command_args, start_process_group

    apply_cpu_compat()
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {0})
    args, planned, run = command_args(megatron_args.split(), False)
    return args, planned, run, start_process_group(False)


def layer_call(args, run, micro_batch: int) -> Callable[[], float]:
    """A new instance of the command's layer (as the profile builds it); the returned call times one forward +
    backward of it, seconds."""
    import torch

    from megatron_pipemesh.integration.profile import ProfileSettings
    from megatron_pipemesh.integration.profile_models import gpt, level_args, megatron_quiet, with_main_grads
    from megatron_pipemesh.integration.profile_steps import loader_attention_mask

    with megatron_quiet():
        model, _ = gpt(level_args(args, "none"), run.model.layer_spec, ProfileSettings(), False, pre=False,
                       post=False)
    with_main_grads(model)
    mask = loader_attention_mask(args, 1, torch.device("cpu"))
    hidden = torch.randn(args.seq_length, micro_batch, args.hidden_size)

    def once() -> float:
        began = time.perf_counter()
        model.set_input_tensor(hidden.clone().requires_grad_(True))
        out = model(input_ids=None, position_ids=None, attention_mask=mask)
        out.backward(torch.ones_like(out) * 1e-3)
        return time.perf_counter() - began

    return once


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-args", default=LLAMA)
    parser.add_argument("--instances", type=int, default=6)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=30)
    options = parser.parse_args()
    args, _, run, end = prepared(options.megatron_args)
    import torch

    calls, keep = [], []
    for index in range(options.instances):
        keep.append(torch.empty((index * 7919) % 50000 + 1000))  # the heap moves between builds, as in a profile
        calls.append(layer_call(args, run, options.micro_batch))
    for once in calls:
        once(), once()
    times = [[] for _ in calls]
    for _ in range(options.rounds):
        for index, once in enumerate(calls):
            times[index].append(once())
    medians = [statistics.median(t) * 1e3 for t in times]
    for index, median in enumerate(medians):
        print(f"instance {index}: {median:.2f} ms forward + backward (median of {options.rounds})")
    print(f"instances' medians {min(medians):.2f}-{max(medians):.2f} ms: slowest "
          f"{100 * (max(medians) / min(medians) - 1):+.1f}% over fastest; mean of all {statistics.mean(medians):.2f}")
    end()
    return 0


if __name__ == "__main__":
    sys.exit(main())
