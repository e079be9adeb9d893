"""``pipemesh profile``: the bytes a piece's forward keeps for its backward.

On CPU the runtime's saved-tensor meter (:class:`..runtime.memory.SavedTensorMeter`: storages autograd saves,
parameters excluded). On CUDA the caching allocator's count across the forward less its output (workspace and
rounding included, as the device will hold them), read with everything of the call before already freed: the
previous call's output and graph and a layer's input tensor (``TransformerBlock.set_input_tensor`` only rebinds it,
so the old one, with its gradient, would be freed inside the next forward and read as bytes the forward gave back).
``scripts/gpu_check.py``'s ``profile`` check holds the two within 10% of each other on a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class Piece:
    """One piece the profile times (a layer at a recompute level, the embedding, the output layer and loss)."""

    forward: Callable[[], object]
    """Makes the piece's input (a layer's received activation) and runs its forward; returns the output."""
    release: Callable[[], None] = lambda: None
    """Drops what the last call left referenced beyond its output and graph (a layer's input tensor, which holds
    its gradient), so that freeing it cannot fall inside the next reading of the allocator."""
    recomputes: Optional[object] = None
    """Where the piece recomputes in its backward: the model whose forwards inside the backward are timed
    (:class:`.profile_timing.ForwardsInBackward`); None: nothing recomputed."""


def kept_bytes(name: str, piece: Piece, grad_of: Callable[[object], object], exclude) -> int:
    """The bytes ``piece``'s forward keeps for its backward (see the module), measured on one forward, whose
    backward then runs with ``grad_of(output)``; ``exclude``: the parameters (and their ``main_grad`` buffers) the
    meter does not count. The caller holds no output or graph of an earlier call."""
    import torch

    from ..runtime.memory import SavedTensorMeter

    piece.release()
    meter = SavedTensorMeter(exclude)
    before = allocated_bytes()
    with meter.record(name):
        out = piece.forward()
    kept = allocated_bytes() - before - tensor_bytes(out) if before is not None else meter.saved_bytes.get(name, 0)
    torch.autograd.backward(out, grad_of(out))
    return int(max(0, kept))


def allocated_bytes() -> Optional[int]:
    """Bytes the CUDA allocator holds once the device is idle; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def tensor_bytes(out) -> int:
    """Bytes of the tensors in ``out`` (a tensor, or a tuple / list / dict of them)."""
    import torch

    if isinstance(out, torch.Tensor):
        return out.numel() * out.element_size()
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return sum(tensor_bytes(item) for item in out)
    return 0
