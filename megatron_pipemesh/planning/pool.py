"""Worker processes for the planner's searches: the advice's layout search (:mod:`.parallel_search`) and the study's
rows (:func:`..study.study.run_study`) start their workers here, so both start them the same way and never nest.

Workers are forked: they inherit what the parent already imported (the CLI has imported megatron-core for its parser;
forking after that import is fine on Linux CPU), so none imports anything again. A worker never starts workers of its
own: inside one, :func:`jobs_here` is 1, so a study row's advice searches in its row's worker.

Each pool may carry a small board of shared numbers (:attr:`WorkerPool.board`), written by the parent and read by the
workers while they run (the layout search publishes there the times that let a worker drop a candidate early).

A worker ends with its parent, however the parent ends: on Linux the kernel kills it when the parent dies
(``prctl(PR_SET_PDEATHSIG, SIGKILL)``, set as it starts, so a parent killed with SIGKILL leaves no worker behind);
elsewhere a thread of the worker watches its parent and ends it within :data:`WATCH_S`. A worker ignores SIGINT and
SIGTERM: a Ctrl-C in the terminal, or a SIGTERM to the process group (``timeout``, Slurm's ``scancel``), reaches every
process, and the parent decides what to do with it (:meth:`WorkerPool.close` with ``abandon``: end the workers at once,
with SIGKILL).

Pure: no torch.
"""
from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any, Callable, Iterable, List, Optional, Sequence

_in_worker = False
_board: Optional[Sequence[float]] = None

PR_SET_PDEATHSIG = 1
"""Linux prctl option: the signal a process gets when its parent dies."""

WATCH_S = 1.0
"""Where the kernel cannot end a worker with its parent: how often the worker's watch thread looks for its parent."""


def _start_worker(board, parent: int) -> None:
    global _in_worker, _board
    _in_worker = True
    _board = board
    # The parent handles the terminal's Ctrl-C and a SIGTERM sent to the whole group (timeout, scancel, kill -- -PGID):
    # a worker that ran the handler it inherited would print the parent's message and stop nothing.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if not _die_with(parent):
        threading.Thread(target=_watch, args=(parent,), name="watch parent", daemon=True).start()


def _die_with(parent: int) -> bool:
    """Ask the kernel to kill this process when its parent dies (Linux); False where it cannot. A parent that died
    before the request leaves this process to init: it ends at once."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:
        os._exit(1)
    return True


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_S)
    os._exit(1)


def in_worker() -> bool:
    """True inside a worker of a :class:`WorkerPool`."""
    return _in_worker


def board() -> Optional[Sequence[float]]:
    """Inside a worker: its pool's shared numbers (None without a board, or outside a worker)."""
    return _board


def default_jobs() -> int:
    """The cores this process may run on (a ``taskset`` narrows them), else the machine's."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1


def jobs_here(jobs: Optional[int]) -> int:
    """The worker processes a search may start: ``jobs`` (None or 0: :func:`default_jobs`), and 1 inside a worker."""
    if _in_worker:
        return 1
    return max(1, jobs or default_jobs())


class WorkerPool:
    """``jobs`` forked worker processes (a context manager); ``board_size`` shared numbers in :attr:`board`."""

    def __init__(self, jobs: int, board_size: int = 0):
        if jobs < 1:
            raise ValueError(f"a worker pool needs at least one worker, got jobs={jobs}")
        context = multiprocessing.get_context("fork")
        self.board = context.RawArray("d", board_size) if board_size else None
        """Numbers the parent writes and its workers read (:func:`board` in a worker); None without a board."""
        self._executor = ProcessPoolExecutor(jobs, mp_context=context, initializer=_start_worker,
                                             initargs=(self.board, os.getpid()))

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self, abandon: bool = False) -> None:
        """Drop the tasks not started, wait for those running, end the workers; ``abandon``: end the workers at once,
        without waiting for their tasks (a search stopped by a signal)."""
        if abandon:
            self.abandon()
        self._executor.shutdown(wait=True, cancel_futures=True)

    def abandon(self) -> None:
        """End every worker now (SIGKILL): what they were computing is lost, and their futures fail."""
        processes = list((getattr(self._executor, "_processes", None) or {}).values())
        for process in processes:
            if process.is_alive():
                process.kill()
        for process in processes:
            process.join(timeout=5)

    def pids(self) -> List[int]:
        """The worker processes' ids (those started so far)."""
        return sorted((getattr(self._executor, "_processes", None) or {}).keys())

    def submit(self, fn: Callable, *args: Any) -> Future:
        return self._executor.submit(fn, *args)

    def map(self, fn: Callable, *iterables: Iterable) -> List:
        """``fn`` over the items, in their order."""
        return list(self._executor.map(fn, *iterables))
