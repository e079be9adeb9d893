"""A check, for tests, that no tensor's storage is freed or moved while a collective or transfer on it is in flight.

A gloo (or NCCL) operation keeps the raw address of its tensors: if the storage under one is freed or re-allocated
before the operation's wait (``untyped_storage().resize_``, ``tensor.data = ...``), the backend writes or reads
freed memory (on CPU it may corrupt the heap; on NCCL it corrupts silently). :func:`install` wraps the
``torch.distributed`` calls Megatron and PipeMesh make asynchronously (``isend``, ``irecv``, ``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``all_reduce``, their ``_base`` forms, and ``_coalescing_manager`` for the ops coalesced
in it): it notes each tensor's storage address and size at launch and compares them at the wait. A change prints a
line starting with :data:`VIOLATION`, naming the op and where it was launched; at exit each process prints
:data:`SUMMARY` with the number of waits checked, so a test can tell that the check ran.

Activated in a child process by putting ``tests/inflight`` first on its ``PYTHONPATH`` (a ``sitecustomize``
there calls :func:`install` before Megatron imports torch.distributed's functions).
"""
from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import traceback

VIOLATION = "in-flight storage changed"
SUMMARY = "in-flight storage check:"

_state = threading.local()
_checked = {"waits": 0, "violations": 0}


def _snapshot(tensors):
    import torch

    out = []
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.numel() > 0:
            storage = tensor.untyped_storage()
            out.append((tensor, storage.data_ptr(), storage.nbytes()))
    return out


def _check(name: str, snapshot, launched: str) -> None:
    _checked["waits"] += 1
    for tensor, ptr, nbytes in snapshot:
        storage = tensor.untyped_storage()
        if storage.data_ptr() != ptr or storage.nbytes() != nbytes:
            _checked["violations"] += 1
            sys.stderr.write(f"{VIOLATION}: rank {os.environ.get('RANK')} {name} of a tensor {tuple(tensor.shape)}: "
                             f"storage {ptr:#x} ({nbytes} B) at launch, {storage.data_ptr():#x} "
                             f"({storage.nbytes()} B) at its wait; launched at\n{launched}")
            sys.stderr.flush()


class _Checked:
    """A backend work whose wait checks the storages first."""

    def __init__(self, work, name, snapshot, launched):
        self._work, self._name, self._snapshot, self._launched = work, name, snapshot, launched

    def wait(self, *args, **kwargs):
        _check(self._name, self._snapshot, self._launched)
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, attribute):
        return getattr(self._work, attribute)


def _flatten(values):
    for value in values:
        if isinstance(value, (list, tuple)):
            yield from value
        else:
            yield value


def _wrap(function, name: str):
    def wrapped(*args, **kwargs):
        tensors = list(_flatten(list(args) + [v for k, v in kwargs.items() if k != "group"]))
        work = function(*args, **kwargs)
        pending = getattr(_state, "pending", None)
        if pending is not None:  # coalesced: the manager's wait checks them
            pending.extend(tensors)
            return work
        if work is not None and (kwargs.get("async_op") or name in ("isend", "irecv")):
            return _Checked(work, name, _snapshot(tensors), "".join(traceback.format_stack(limit=8)))
        return work

    wrapped.__name__ = getattr(function, "__name__", name)
    wrapped.__doc__ = function.__doc__
    return wrapped


def install() -> None:
    """Wrap torch.distributed (once per process)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if getattr(c10d, "_pipemesh_inflight_check", False):
        return
    for name in ("isend", "irecv", "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce",
                 "_all_gather_base", "_reduce_scatter_base"):
        wrapped = _wrap(getattr(c10d, name), name)
        setattr(c10d, name, wrapped)
        setattr(dist, name, wrapped)
    original = c10d._coalescing_manager

    @contextlib.contextmanager
    def coalescing_manager(group=None, device=None, async_ops=False):
        outer = getattr(_state, "pending", None)
        _state.pending = []
        launched = "".join(traceback.format_stack(limit=8))
        try:
            with original(group, device, async_ops) as manager:
                yield manager
        finally:
            tensors, _state.pending = _state.pending, outer
        if async_ops:
            snapshot, wait = _snapshot(tensors), manager.wait

            def checked_wait(*args, **kwargs):
                _check("coalesced", snapshot, launched)
                return wait(*args, **kwargs)

            manager.wait = checked_wait

    c10d._coalescing_manager = coalescing_manager
    dist._coalescing_manager = coalescing_manager
    c10d._pipemesh_inflight_check = True
    atexit.register(lambda: print(f"{SUMMARY} rank {os.environ.get('RANK')} {_checked['waits']} waits, "
                                  f"{_checked['violations']} violations", flush=True))
