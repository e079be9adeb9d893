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
"""
from __future__ import annotations

import copy
import statistics
import time
import warnings
from typing import Dict, Mapping

MIN_PAUSE_S = 0.005
"""The least pause between two batches (the workers' head start)."""

MIN_REPEATS = 15
"""Batches timed at least (the median kept): one batch's hand-over from a worker varies by tens of percent."""


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
            seconds = []
            for _ in range(warmup + repeats):
                time.sleep(max(MIN_PAUSE_S, pause))
                start = time.perf_counter()
                get_batch(batches)
                seconds.append(time.perf_counter() - start)
            del batches, loader  # the workers stop with their iterator
            found[size] = statistics.median(seconds[warmup:])
    finally:
        global_vars.set_args(before)
    return found
