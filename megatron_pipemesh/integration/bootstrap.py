"""Fixes that must be in place *before* ``megatron`` is imported on the supported stack.

megatron-core 0.19.2 (the PyPI wheel) cannot be imported as-is in two common situations:

* ``triton`` is not installed (CPU machines, slim images).  ``import megatron.core`` reaches
  ``megatron/core/transformer/moe/ops/paged_stash.py:4`` (``import triton``) through
  ``core/__init__`` -> ``distributed`` -> ``finalize_model_grads`` -> ``pipeline_parallel`` ->
  ``schedules.py:27`` -> ``transformer/moe/paged_stash.py:12``.  The kernels in that module are only
  used by MoE paged stashing (CUDA only).  Upstream fix proposal: NVIDIA/Megatron-LM PR #6891.
* Python < 3.12: ``megatron/training/models/gpt.py:5`` and ``megatron/training/models/hybrid.py:5``
  do ``from typing import ..., override`` (``typing.override`` exists from Python 3.12 on; this is
  why the wheel declares ``Requires-Python >=3.12`` although it is tagged cp311).

:func:`prepare_megatron_import` applies the narrowest possible fix for each, only when needed, and is
idempotent.  It never stubs the ``triton`` package itself: ``torch._dynamo`` probes
``triton.language`` and would crash on a fake package whenever ``torch.compile`` runs.
"""
from __future__ import annotations

import importlib.util
import sys
import types
import typing

__all__ = ["prepare_megatron_import", "PAGED_STASH_MODULE", "PAGED_STASH_BLOCK_SIZE", "applied_fixes"]

#: The one megatron module that imports triton at module level.
PAGED_STASH_MODULE = "megatron.core.transformer.moe.ops.paged_stash"
#: ``GLOBAL_BLOCK_SIZE`` in ``megatron/core/transformer/moe/ops/paged_stash.py:7`` (0.19.2).
PAGED_STASH_BLOCK_SIZE = 1024

_STUB_MARKER = "__pipemesh_stub__"


def _triton_importable() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def _install_paged_stash_stub() -> bool:
    """Register a stand-in for ``PAGED_STASH_MODULE`` if triton is missing. Returns True if active."""
    existing = sys.modules.get(PAGED_STASH_MODULE)
    if existing is not None:
        return bool(getattr(existing, _STUB_MARKER, False))
    if _triton_importable():
        return False
    stub = types.ModuleType(PAGED_STASH_MODULE)
    stub.__doc__ = (
        "megatron_pipemesh stand-in for megatron's MoE paged-stash triton kernels (triton is not "
        "installed; the kernels are CUDA-only and unused unless MoE paged stashing is enabled)."
    )
    stub.GLOBAL_BLOCK_SIZE = PAGED_STASH_BLOCK_SIZE
    stub.paged_stash_copy_kernel = None
    stub.paged_stash_pop_kernel = None
    stub.__all__ = ["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"]
    setattr(stub, _STUB_MARKER, True)
    sys.modules[PAGED_STASH_MODULE] = stub
    # If the parent package is already imported, make the attribute visible there as well.
    parent = sys.modules.get(PAGED_STASH_MODULE.rpartition(".")[0])
    if parent is not None and not hasattr(parent, "paged_stash"):
        parent.paged_stash = stub
    return True


def _install_typing_override() -> bool:
    """Alias ``typing.override`` on Python < 3.12. Returns True if the alias is (now) ours."""
    if sys.version_info >= (3, 12):
        return False
    if hasattr(typing, "override"):
        return getattr(typing.override, "__module__", "") == "typing_extensions"
    try:
        from typing_extensions import override
    except ImportError:  # pragma: no cover - typing_extensions is a torch dependency
        def override(func):  # minimal equivalent of PEP 698's decorator
            try:
                func.__override__ = True
            except (AttributeError, TypeError):
                pass
            return func
    typing.override = override
    return True


def applied_fixes() -> dict:
    """Which bootstrap fixes are currently active (for diagnostics and tests)."""
    mod = sys.modules.get(PAGED_STASH_MODULE)
    return {
        "paged_stash_stub": bool(getattr(mod, _STUB_MARKER, False)),
        "typing_override_alias": sys.version_info < (3, 12)
        and getattr(getattr(typing, "override", None), "__module__", "") == "typing_extensions",
    }


def prepare_megatron_import() -> dict:
    """Apply the pre-import fixes (idempotent); return :func:`applied_fixes`.

    Call before the first ``import megatron``.  Harmless if megatron is already imported (the stub is
    then not needed, or was already registered).
    """
    _install_paged_stash_stub()
    _install_typing_override()
    return applied_fixes()
