"""planning/pool.py: worker processes end with their parent however it ends (SIGKILL included), ignore the terminal's
Ctrl-C, and can be ended at once."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

from megatron_pipemesh.planning.pool import WorkerPool

PARENT = textwrap.dedent("""
    import sys, time
    from megatron_pipemesh.planning.pool import WorkerPool
    pool = WorkerPool(2)
    pool.submit(time.sleep, 0).result()
    print(*pool.pids(), flush=True)
    pool.submit(time.sleep, 600)
    pool.submit(time.sleep, 600)
    time.sleep(600)
""")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pids, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(_gone(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return False


def test_workers_end_when_their_parent_is_killed():
    """A parent killed with SIGKILL runs no clean-up of its own: its workers, busy in a task, still end at once (the
    kernel's parent-death signal); without it they would sleep on, children of init."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(workers) == 2 and all(psutil.Process(pid).ppid() == parent.pid for pid in workers)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        assert _wait_gone(workers, 5.0), [pid for pid in workers if not _gone(pid)]
    finally:
        if parent.poll() is None:
            parent.kill()


def _ignores_sigint_and_sigterm() -> bool:
    return signal.getsignal(signal.SIGINT) == signal.SIG_IGN and signal.getsignal(signal.SIGTERM) == signal.SIG_IGN


def test_workers_ignore_sigint_and_sigterm_and_abandon_ends_them_at_once():
    """The terminal's Ctrl-C, or a SIGTERM to the process group, reaches the workers too: they leave it to the parent
    (which would otherwise hear its stop message once per worker). close(abandon=True) ends workers in the middle of a
    task without waiting for it."""
    before = signal.signal(signal.SIGTERM, lambda *_: None)  # a parent's handler, which forked workers inherit
    try:
        pool = WorkerPool(2)
        assert pool.submit(_ignores_sigint_and_sigterm).result() is True
    finally:
        signal.signal(signal.SIGTERM, before)
    pool.submit(time.sleep, 600)
    pool.submit(time.sleep, 600)
    time.sleep(0.5)
    workers = pool.pids()
    started = time.monotonic()
    pool.close(abandon=True)
    assert time.monotonic() - started < 10 and _wait_gone(workers, 5.0)
