"""Measured activation memory: what the runtime actually holds for each (chunk, micro-batch).

Two meters with one interface, chosen by :func:`make_memory_meter` from the device:

* :class:`SavedTensorMeter` (CPU, or anywhere on request): installs
  ``torch.autograd.graph.saved_tensors_hooks`` around one forward and accounts every tensor autograd
  saves for the backward. Bytes are counted per *storage* (a view keeps its whole storage alive;
  the same storage saved twice counts once), parameters and tensors sharing storage with them are
  not activations and are skipped. A key's storages stay live until :meth:`release` (called when
  that key's backward finished). The pack hook stores a *detached* alias, never the tensor itself:
  returning the tensor would create a reference cycle through its ``grad_fn`` for saved outputs and
  keep them alive after the backward (the meter must not change what it measures).
* :class:`AllocatorMeter` (CUDA): ``torch.cuda.memory_allocated()`` before/after each forward and
  ``max_memory_allocated()`` over the iteration, relative to the allocation at :meth:`begin`. A
  forward's delta includes everything it left allocated (saved tensors and its output).

Both also account tensors the runtime itself keeps alive for a key (:meth:`track` / :meth:`untrack`:
the chunk's output held until its backward, freed early when Megatron's ``deallocate_output_tensor``
runs after the send); on CUDA these are already inside the allocator numbers and ignored.

Host placement (:mod:`.offload`): ``record(key, inner=hooks)`` composes the offloader's saved-tensor
hooks with the meter's (only the innermost hooks of a stack see the tensors), and the offloader
reports the storages it moves (:meth:`offloaded` / :meth:`reloaded`). ``live_bytes`` / ``peak_bytes``
are *device-resident* bytes (an offloaded storage stops counting once it left the device; on CUDA
the allocator sees it freed once the copy finished); ``host_bytes`` / ``peak_host_bytes`` count the
activations in host memory.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Dict, Hashable, Iterable, Iterator, Optional, Tuple

import torch

Key = Hashable


_AMBIENT: list = []
"""Meters measuring a whole training call from outside the runtime (innermost last)."""


@contextlib.contextmanager
def measuring(meter) -> Iterator[None]:
    """Make ``meter`` the ambient meter while a whole call runs under it (the bench's meter): the executor
    hands it the saves of host-placed chunk-micro-batches, whose own hooks hide them from outer ones, and
    the offloader's copies (:meth:`SavedTensorMeter.offloaded` / :meth:`~SavedTensorMeter.reloaded`)."""
    _AMBIENT.append(meter)
    try:
        yield
    finally:
        _AMBIENT.remove(meter)


def ambient_meter():
    """The innermost meter of :func:`measuring`, or None."""
    return _AMBIENT[-1] if _AMBIENT else None


def _storage(tensor: torch.Tensor) -> Optional[Tuple[int, int]]:
    """(data pointer, bytes) of ``tensor``'s storage; None for tensors without real storage."""
    try:
        storage = tensor.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, AttributeError):  # sparse, nested, meta, fake, ...
        return None
    if ptr == 0 or nbytes == 0:
        return None
    return ptr, nbytes


class SavedTensorMeter:
    """Saved-for-backward bytes per key (live, peak), deduplicated by storage, parameters excluded."""

    kind = "saved-tensors"

    def __init__(self, parameters: Iterable[torch.Tensor] = ()):
        self._excluded: set = set()
        self.exclude(parameters)
        self._held: Dict[Key, Dict[int, int]] = {}
        """Live keys -> {storage pointer: bytes} they keep alive (saved tensors and tracked ones)."""
        self._tracked: Dict[Key, Dict[int, int]] = {}
        self._refs: Dict[int, int] = {}
        self._aliases: Dict[Tuple[Key, int], list] = {}
        """(key, storage pointer) -> [number of live saved aliases]."""
        """Storage pointer -> number of live keys holding it (live bytes count each storage once)."""
        self.saved_bytes: Dict[Key, int] = {}
        """Bytes saved for backward by each key's forward (deduplicated within the key)."""
        self.tracked_bytes: Dict[Key, int] = {}
        """Bytes of runtime-held tensors (pipeline outputs) of each key, at their largest."""
        self.live_bytes = 0
        self.peak_bytes = 0
        self._host: Dict[Key, int] = {}
        self.host_bytes = 0
        """Activation bytes currently offloaded to host memory."""
        self.peak_host_bytes = 0
        self.offloaded_bytes: Dict[Key, int] = {}
        """Bytes each key moved to host memory."""

    # Set-up ----------------------------------------------------------------------------------
    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        """Never count these tensors' storages (parameters, buffers, main grads)."""
        for tensor in tensors:
            found = _storage(tensor)
            if found is not None:
                self._excluded.add(found[0])

    def begin(self) -> None:
        """Start of an iteration (kept for interface parity with :class:`AllocatorMeter`)."""

    # Accounting ------------------------------------------------------------------------------
    def _add(self, key: Key, ptr: int, nbytes: int) -> bool:
        held = self._held.setdefault(key, {})
        if ptr in held:
            return False
        held[ptr] = nbytes
        count = self._refs.get(ptr, 0)
        self._refs[ptr] = count + 1
        if count == 0:
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return True

    def _drop(self, key: Key, ptr: int) -> None:
        held = self._held.get(key, {})
        nbytes = held.pop(ptr, None)
        if nbytes is None:
            return
        count = self._refs.pop(ptr) - 1
        if count:
            self._refs[ptr] = count
        else:
            self.live_bytes -= nbytes

    def _countable(self, tensor) -> Optional[Tuple[int, int]]:
        if not isinstance(tensor, torch.Tensor) or isinstance(tensor, torch.nn.Parameter):
            return None
        found = _storage(tensor)
        if found is None or found[0] in self._excluded:
            return None
        return found

    @contextlib.contextmanager
    def record(self, key: Key, inner: Optional[Tuple[Callable, Callable]] = None) -> Iterator[None]:
        """Account every tensor saved for backward inside the block to ``key``; ``inner``: (pack, unpack)
        hooks to run inside the meter's (the offloader's)."""
        self.saved_bytes.setdefault(key, 0)
        inner_pack, inner_unpack = inner or (None, None)

        def pack(tensor):
            if not isinstance(tensor, torch.Tensor):
                return inner_pack(tensor) if inner_pack else tensor
            # A detached alias: same storage, no grad_fn, so no reference cycle (see module doc).
            packed = inner_pack(tensor) if inner_pack else tensor.detach()
            found = self._countable(tensor)
            if found is not None:
                self._add(key, *found)
                aliases = self._aliases.setdefault((key, found[0]), [0])
                aliases[0] += 1
                # Some packs are dropped at once (CPU dropout saves its mask even inside the no_grad
                # forward of a checkpoint): a storage stops counting when its last alias dies.
                weakref.finalize(packed, self._alias_dead, key, found[0])
            return packed

        def unpack(packed):
            return inner_unpack(packed) if inner_unpack else packed

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
        self.saved_bytes[key] = sum(self._held.get(key, {}).values())

    def _alias_dead(self, key: Key, ptr: int) -> None:
        aliases = self._aliases.get((key, ptr))
        if aliases is None:
            return
        aliases[0] -= 1
        if aliases[0] == 0:
            del self._aliases[(key, ptr)]
            if ptr not in self._tracked.get(key, {}):
                self._drop(key, ptr)

    def track(self, key: Key, tensor: Optional[torch.Tensor]) -> None:
        """Count a tensor the runtime keeps for ``key`` (e.g. a chunk output until its backward)."""
        found = self._countable(tensor) if tensor is not None else None
        if found is None:
            return
        if self._add(key, *found):
            self._tracked.setdefault(key, {})[found[0]] = found[1]
            self.tracked_bytes[key] = max(self.tracked_bytes.get(key, 0), sum(self._tracked[key].values()))

    def untrack(self, key: Key) -> None:
        """The runtime freed ``key``'s tracked tensors (e.g. Megatron deallocated a sent output)."""
        for ptr in self._tracked.pop(key, {}):
            self._drop(key, ptr)

    def offloaded(self, key: Key, storages: Iterable[Tuple[int, int]]) -> None:
        """The offloader moved ``key``'s (storage pointer, bytes) to host memory; their device copies
        are gone (a storage other keys still hold stays live for them)."""
        moved = 0
        for ptr, nbytes in storages:
            self._aliases.pop((key, ptr), None)  # the offloader's handles now own these bytes
            self._drop(key, ptr)
            moved += nbytes
        self._host[key] = self._host.get(key, 0) + moved
        self.offloaded_bytes[key] = self.offloaded_bytes.get(key, 0) + moved
        self.host_bytes += moved
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)

    def reloaded(self, key: Key, storages: Iterable[Tuple[int, int]]) -> None:
        """``key``'s storages are back on the device (new (pointer, bytes)) until its :meth:`release`."""
        for ptr, nbytes in storages:
            self._add(key, ptr, nbytes)
        self.host_bytes -= self._host.pop(key, 0)

    def release(self, key: Key) -> None:
        """``key``'s backward finished: everything it held is free."""
        self.host_bytes -= self._host.pop(key, 0)
        self._tracked.pop(key, None)
        for ptr in list(self._held.get(key, {})):
            self._drop(key, ptr)
            self._aliases.pop((key, ptr), None)
        self._held.pop(key, None)

    def live_keys(self) -> Tuple[Key, ...]:
        return tuple(self._held)


class AllocatorMeter:
    """CUDA caching-allocator deltas per key; peak over the iteration relative to :meth:`begin`."""

    kind = "cuda-allocator"

    def __init__(self, device: Optional[torch.device] = None):
        self.device = device
        self.baseline = 0
        self.saved_bytes: Dict[Key, int] = {}
        """Bytes each key's forward left allocated (saved tensors + output; may include caches)."""
        self.tracked_bytes: Dict[Key, int] = {}
        self.peak_bytes = 0
        self._host: Dict[Key, int] = {}
        self.host_bytes = 0
        self.peak_host_bytes = 0
        self.offloaded_bytes: Dict[Key, int] = {}

    def begin(self) -> None:
        torch.cuda.synchronize(self.device)
        self.baseline = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        """Allocated before :meth:`begin`, so already in the baseline."""

    @property
    def live_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device) - self.baseline

    def _update_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, torch.cuda.max_memory_allocated(self.device) - self.baseline)

    @contextlib.contextmanager
    def record(self, key: Key, inner: Optional[Tuple[Callable, Callable]] = None) -> Iterator[None]:
        before = torch.cuda.memory_allocated(self.device)
        try:
            with torch.autograd.graph.saved_tensors_hooks(*inner) if inner else contextlib.nullcontext():
                yield
        finally:
            self.saved_bytes[key] = self.saved_bytes.get(key, 0) + torch.cuda.memory_allocated(self.device) - before
            self._update_peak()

    def track(self, key: Key, tensor: Optional[torch.Tensor]) -> None:
        """Already counted by the allocator."""

    def untrack(self, key: Key) -> None:
        """Already counted by the allocator."""

    def offloaded(self, key: Key, storages: Iterable[Tuple[int, int]]) -> None:
        """Host bytes only: the allocator sees the device copies freed once the copy finished."""
        moved = sum(nbytes for _, nbytes in storages)
        self._host[key] = self._host.get(key, 0) + moved
        self.offloaded_bytes[key] = self.offloaded_bytes.get(key, 0) + moved
        self.host_bytes += moved
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)

    def reloaded(self, key: Key, storages: Iterable[Tuple[int, int]]) -> None:
        self.host_bytes -= self._host.pop(key, 0)

    def release(self, key: Key) -> None:
        self.host_bytes -= self._host.pop(key, 0)
        self._update_peak()


def model_tensors(chunks: Iterable[torch.nn.Module]) -> Iterator[torch.Tensor]:
    """Parameters and registered buffers of model chunks: never activations. (``nn.Module.buffers`` is
    called unbound because Megatron's DDP wrapper shadows ``buffers`` with its list of gradient buffers.)"""
    for chunk in chunks:
        yield from chunk.parameters()
        yield from torch.nn.Module.buffers(chunk)


def make_memory_meter(device: torch.device, parameters: Iterable[torch.Tensor] = ()):
    """:class:`AllocatorMeter` on a CUDA device, :class:`SavedTensorMeter` elsewhere."""
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        return AllocatorMeter(torch.device(device))
    return SavedTensorMeter(parameters)
