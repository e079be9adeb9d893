"""``pipemesh profile``: what the first and the last pipeline stage spend per micro-batch taking the batch from the
command's data loader.

The command's own data path is built as the training entry point builds it (:mod:`.gpt_data`: the
dataset of ``--mock-data`` or ``--data-path``, Megatron's sampler and ``--num-workers`` loader workers) and its
``get_batch`` is timed: waiting for the next batch, moving it to the device, the masks and positions. In training
the workers prepare batches while the stage computes; here each batch is taken after a pause as long as one layer's
forward and backward at that micro-batch size (at least :data:`MIN_PAUSE_S`), so the time is what the training
process itself spends, not how fast the workers produce. Megatron's runs show it as the ``batch-generator`` timer,
inside ``forward-compute``: 3-4 ms per micro-batch on this CPU with the default two workers, a fifth of the compute
of a hidden-128 GPT.

Launched on several ranks, the builder's barriers span the whole job, so rank 0 times the loader in a child process of
its own (:func:`measure_batch_s_apart`: one process, its own one-rank process group, rank 0's device), while the
other ranks wait.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
import warnings
from typing import Dict, Mapping, Sequence, Tuple

from .profile_timing import medians

MIN_PAUSE_S = 0.005
"""The least pause between two batches (the workers' head start)."""

MIN_REPEATS = 15
"""Batches timed at least (the median kept): one batch's hand-over from a worker varies by tens of percent."""

CHILD_TIMEOUT_S = 600.0
"""The most :func:`measure_batch_s_apart` waits for its child (building a large dataset's indexes takes minutes)."""

CHILD_MODULE = "megatron_pipemesh.integration.profile_batch_child"
"""The child's entry (a module of its own: it reads the command as the profile does, and the profile imports this
one)."""

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                    "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "GROUP_WORLD_SIZE")
"""The launcher's variables the child must not see: it is one process, not a rank of the job."""


def measure_batch_s(args, pauses: Mapping[int, float], warmup: int, repeats: int) -> Dict[int, float]:
    """Median seconds of the training entry's ``get_batch`` per micro-batch size of ``pauses`` (size -> the pause
    before each batch), on the command's ``args`` (Megatron's parallel state is up). Raises what building the data
    path raises (a missing ``--data-path``, a tokenizer that cannot load)."""
    from megatron.training import global_vars
    from megatron.training.datasets.data_samplers import build_pretraining_data_loader

    from .gpt_data import get_batch, train_valid_test_datasets_provider

    repeats = max(repeats, MIN_REPEATS)
    found = {}
    before = global_vars._GLOBAL_ARGS
    try:
        for size, pause in sorted(pauses.items()):
            sized = copy.copy(args)
            sized.micro_batch_size = size
            global_vars.set_args(sized)  # what get_args() gives the data path and get_batch
            samples = (warmup + repeats + 4) * size
            train, _, _ = train_valid_test_datasets_provider([samples, size, size])
            with warnings.catch_warnings():  # pin_memory without a GPU: nothing the user's run needs to hear
                warnings.simplefilter("ignore", UserWarning)
                loader = build_pretraining_data_loader(train, 0)
                batches = iter(loader)

            def one_batch(pause: float = pause, batches=batches) -> Tuple[float]:
                time.sleep(max(MIN_PAUSE_S, pause))
                start = time.perf_counter()
                get_batch(batches)
                return (time.perf_counter() - start,)

            found[size], = medians({"batch": one_batch}, warmup, repeats)["batch"]
            del one_batch, batches, loader  # the workers stop with their iterator
    finally:
        global_vars.set_args(before)
    return found


def measure_batch_s_apart(words: Sequence[str], pauses: Mapping[int, float], warmup: int, repeats: int,
                          device: int = 0) -> Dict[int, float]:
    """:func:`measure_batch_s` of the command ``words`` in a child process of its own (one rank, CUDA device
    ``device`` where there is CUDA). Raises RuntimeError with the child's error where it fails."""
    env = {key: value for key, value in os.environ.items() if key not in LAUNCH_VARIABLES}
    env.setdefault("OMP_NUM_THREADS", "1")
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = str(device)
    request = json.dumps({"words": list(words), "pauses": {str(k): v for k, v in pauses.items()}, "warmup": warmup,
                          "repeats": repeats})
    try:
        done = subprocess.run([sys.executable, "-m", CHILD_MODULE], input=request, capture_output=True, text=True,
                              env=env, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"timing the data loader took over {CHILD_TIMEOUT_S:g} s") from None
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    answer = json.loads(lines[-1]) if lines else {}
    if "seconds" not in answer:
        errors = [line for line in done.stderr.splitlines() if line.strip()]
        raise RuntimeError(answer.get("error") or (errors[-1] if errors else f"the child exited {done.returncode}"))
    return {int(size): float(seconds) for size, seconds in answer["seconds"].items()}

