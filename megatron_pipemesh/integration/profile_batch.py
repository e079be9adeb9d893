"""``pipemesh profile``: what the first and the last pipeline stage spend per micro-batch taking the batch from the
command's data loader.

The command's own data path is built as the training entry point builds it (:mod:`.gpt_data`: the
dataset of ``--mock-data`` or ``--data-path``, Megatron's sampler and ``--num-workers`` loader workers) and its
``get_batch`` is timed: waiting for the next batch, moving it to the device, the masks and positions. In training
the workers prepare batches while the stage computes; here each batch is taken after a pause as long as one layer's
forward and backward at that micro-batch size (at least :data:`MIN_PAUSE_S`), so the time is what the training
process itself spends, not how fast the workers produce. Batches are taken in the profile's one loop until their
median is stable (:func:`.profile_timing.measure`): a batch's hand-over from a worker is right-skewed (2.5-4.7 ms
here, median 2.8), and the median of a fixed 15 moved by 10-30% between two profiles. Megatron's runs show it as the ``batch-generator`` timer,
inside ``forward-compute``: 3-4 ms per micro-batch on this CPU with the default two workers, a fifth of the compute
of a hidden-128 GPT.

Launched on several ranks, the builder's barriers span the whole job, so rank 0 times the loader in a child process of
its own (:func:`measure_batch_s_apart`: one process, its own one-rank process group, rank 0's device), while the
other ranks wait.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
import time
import warnings
from typing import Dict, Mapping, Sequence, Tuple

from .profile_timing import Measured, ProfileSettings, measure

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


def measure_batch_s(args, pauses: Mapping[int, float], settings: ProfileSettings) -> Dict[int, Measured]:
    """Per micro-batch size of ``pauses`` (size -> the pause before each batch), the samples of the training entry's
    ``get_batch`` (seconds; at least :data:`MIN_REPEATS`, then until stable or ``settings.max_seconds``), on the
    command's ``args`` (Megatron's parallel state is up). Raises what building the data path raises (a missing
    ``--data-path``, a tokenizer that cannot load)."""
    from megatron.training import global_vars
    from megatron.training.datasets.data_samplers import build_pretraining_data_loader

    from .gpt_data import get_batch, train_valid_test_datasets_provider

    settings = dataclasses.replace(settings, repeats=max(settings.repeats, MIN_REPEATS))
    found = {}
    before = global_vars._GLOBAL_ARGS
    try:
        for size, pause in sorted(pauses.items()):
            sized = copy.copy(args)
            sized.micro_batch_size = size
            global_vars.set_args(sized)  # what get_args() gives the data path and get_batch
            most = settings.warmup + settings.repeats + int(settings.max_seconds / max(MIN_PAUSE_S, pause)) + 4
            train, _, _ = train_valid_test_datasets_provider([most * size, size, size])
            with warnings.catch_warnings():  # pin_memory without a GPU: nothing the user's run needs to hear
                warnings.simplefilter("ignore", UserWarning)
                loader = build_pretraining_data_loader(train, 0)
                batches = iter(loader)

            def one_batch(pause: float = pause, batches=batches) -> Tuple[float]:
                time.sleep(max(MIN_PAUSE_S, pause))
                start = time.perf_counter()
                get_batch(batches)
                return (time.perf_counter() - start,)

            found[size] = measure({"batch": one_batch}, settings)["batch"]
            del one_batch, batches, loader  # the workers stop with their iterator
    finally:
        global_vars.set_args(before)
    return found


def measure_batch_s_apart(words: Sequence[str], pauses: Mapping[int, float], settings: ProfileSettings,
                          device: int = 0) -> Dict[int, Measured]:
    """:func:`measure_batch_s` of the command ``words`` in a child process of its own (one rank, CUDA device
    ``device`` where there is CUDA). Raises RuntimeError with the child's error where it fails."""
    env = {key: value for key, value in os.environ.items() if key not in LAUNCH_VARIABLES}
    env.setdefault("OMP_NUM_THREADS", "1")
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = str(device)
    request = json.dumps({"words": list(words), "pauses": {str(k): v for k, v in pauses.items()},
                          "settings": dataclasses.asdict(settings)})
    try:
        done = subprocess.run([sys.executable, "-m", CHILD_MODULE], input=request, capture_output=True, text=True,
                              env=env, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"timing the data loader took over {CHILD_TIMEOUT_S:g} s") from None
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    answer = json.loads(lines[-1]) if lines else {}
    if "samples" not in answer:
        errors = [line for line in done.stderr.splitlines() if line.strip()]
        raise RuntimeError(answer.get("error") or (errors[-1] if errors else f"the child exited {done.returncode}"))
    return {int(size): Measured((tuple(map(float, samples)),), bool(answer["stable"][size]))
            for size, samples in answer["samples"].items()}

