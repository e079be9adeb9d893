"""tests/inflight_storage.py's check (which the distributed-optimizer training tests run under) reports a storage
re-allocated between an asynchronous collective's launch and its wait, and stays quiet when none is."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(body: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent("""
        import os, tempfile
        import torch, torch.distributed as dist
        from torch.distributed import _coalescing_manager
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        x = torch.ones(8)
    """) + textwrap.dedent(body)
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'tests' / 'inflight'}{os.pathsep}{REPO}", RANK="0")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


def test_a_storage_moved_before_the_wait_is_reported():
    sys.path.insert(0, str(REPO / "tests"))
    from inflight_storage import SUMMARY, VIOLATION

    moved = _run("""
        work = dist.all_reduce(x, async_op=True)
        x.untyped_storage().resize_(64)  # re-allocated under the op
        work.wait()
        with _coalescing_manager(async_ops=True) as cm:
            dist.all_reduce(x, async_op=True)
        x.untyped_storage().resize_(128)
        cm.wait()
    """)
    assert moved.returncode == 0, moved.stderr[-3000:]
    assert moved.stderr.count(VIOLATION) == 2 and "all_reduce" in moved.stderr and "coalesced" in moved.stderr
    assert f"{SUMMARY} rank 0 2 waits, 2 violations" in moved.stdout
    kept = _run("""
        work = dist.all_reduce(x, async_op=True)
        work.wait()
        x.untyped_storage().resize_(64)  # after the wait: fine
    """)
    assert kept.returncode == 0 and VIOLATION not in kept.stderr
    assert f"{SUMMARY} rank 0 1 waits, 0 violations" in kept.stdout
