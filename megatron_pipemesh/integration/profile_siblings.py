"""``pipemesh profile`` on CPU: the other cores kept computing while the profile times, as the other ranks of a node
compute beside a rank.

A rank of a CPU job shares the machine's caches, memory bandwidth and clock with the ranks beside it; timed alone,
its ops run faster than they will in the job (one layer's forward at micro-batch 1 of a hidden-512 GPT: 25.2 ms alone,
26.7-27.2 ms with a second profile running on the other core; a 2-rank job's ops ran 8-15% over a profile timed
alone). :func:`busy_siblings` pins this process to one core and starts one process per other core, pinned there, that
runs the command's transformer layer forward and backward in a loop until the block ends.

Each sibling is :mod:`.busy_core`.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
from typing import Iterator, List, Sequence

SIBLING_MODULE = "megatron_pipemesh.integration.busy_core"
"""What each sibling runs (a module of its own: it builds the layer as the profile does, and the profile imports
this one)."""

READY_TIMEOUT_S = 300.0
"""The most :func:`busy_siblings` waits for a sibling to start computing (it imports Megatron and builds a layer)."""

STOP_TIMEOUT_S = 30.0
"""The most it waits for a sibling to stop once told (then it is killed)."""


@contextlib.contextmanager
def busy_siblings(words: Sequence[str], count: int) -> Iterator[List[int]]:
    """Within the block, this process on its first allowed core and ``count`` siblings computing the command
    ``words``'s layer on the next ones (fewer where the process may use fewer cores); yields the siblings' cores.
    This process's core affinity is restored after. RuntimeError naming the sibling's error where one fails to
    start."""
    allowed = sorted(os.sched_getaffinity(0))
    cores = allowed[1:1 + max(0, count)]
    if not cores:
        yield []
        return
    os.sched_setaffinity(0, {allowed[0]})
    children: List[subprocess.Popen] = []
    logs = [tempfile.TemporaryFile(mode="w+") for _ in cores]  # a pipe nobody reads would fill and stop a sibling
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        for core, log in zip(cores, logs):
            child = subprocess.Popen([sys.executable, "-m", SIBLING_MODULE], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=log, text=True, env=env)
            children.append(child)
            child.stdin.write(json.dumps({"words": list(words), "core": core}) + "\n")
            child.stdin.flush()
        for core, child, log in zip(cores, children, logs):
            _await_ready(child, core, log)
        yield cores
    finally:
        for child in children:
            with contextlib.suppress(OSError):
                child.stdin.close()
        for child in children:
            try:
                child.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        for log in logs:
            log.close()
        os.sched_setaffinity(0, set(allowed))


def _await_ready(child: subprocess.Popen, core: int, log) -> None:
    """Wait for ``child``'s ``ready`` line; RuntimeError with the last line of its ``log`` (its stderr) if it ends or
    takes too long."""
    answered, ready = threading.Event(), []

    def read() -> None:  # Megatron may print before it; the line is the sign (end of output: it exited)
        for text in child.stdout:
            if text.strip() == "ready":
                ready.append(True)
                break
        answered.set()

    threading.Thread(target=read, daemon=True).start()
    if answered.wait(READY_TIMEOUT_S) and ready:
        return
    started = child.poll() is None
    child.kill()
    child.wait()
    log.seek(0)
    errors = [text for text in log.read().splitlines() if text.strip()]
    why = errors[-1] if errors else (f"it did not start within {READY_TIMEOUT_S:g} s" if started else "it exited")
    raise RuntimeError(f"the sibling computing on core {core} failed: {why}")

