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
* :class:`AllocatorMeter` (CUDA): the same quantity from the caching allocator's counters
  (``torch.cuda.memory_stats``), read at op boundaries: a key holds what its forward left allocated
  (after minus before the op: temporaries freed inside the op never count) and its input, until its
  backward. Freed blocks the allocator may not reuse yet (``record_stream`` pending: an offloaded
  storage until its device-to-host copy finished) count too. It never resets the allocator's peak
  counters (Megatron reports ``max_memory_allocated`` itself).

What "activation bytes" means (both meters): the device bytes the schedule holds for chunk-micro-batches
between a forward and its backward -- saved tensors, the input, the output until it is freed after its
send; model state, gradients, receive buffers not yet consumed, ZeRO gathers and every temporary of an op
(logits and loss terms, sequence-parallel gathers, a backward's recomputation) are not. ``peak_bytes`` is
the largest sum over the call. Known differences: the CPU meter sees each save as it happens (a peak
inside a forward, and, metering a whole call, a backward's recomputed saves), the CUDA meter sees op
boundaries only; the CPU meter counts the input where it is saved, the CUDA meter always.

Both also account tensors the runtime itself keeps alive for a key (:meth:`track` / :meth:`untrack`:
the chunk's output held until its backward, freed early when Megatron's ``deallocate_output_tensor``
runs after the send; on CUDA the output is inside the forward's delta and ``untrack`` subtracts it).

Host placement (:mod:`.offload`): ``record(key, inner=hooks)`` composes the offloader's saved-tensor
hooks with the meter's (only the innermost hooks of a stack see the tensors), and the offloader
reports the storages it moves (:meth:`offloaded` / :meth:`reloaded`). ``live_bytes`` / ``peak_bytes``
are *device-resident* bytes (an offloaded storage stops counting once it left the device; on CUDA
once its copy finished and the allocator may reuse the block); ``host_bytes`` / ``peak_host_bytes``
count the activations in host memory.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Dict, Hashable, Iterable, Iterator, List, Optional, Tuple

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

    def hold_input(self, key: Key, tensor: Optional[torch.Tensor]) -> None:
        """Nothing to add: the input counts where autograd saves it (a Megatron chunk's first layer always does)."""

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


ALLOCATED = "allocated_bytes.all.current"
"""``torch.cuda.memory_stats`` key: bytes of live allocations (drops at ``free()``, record_stream or not)."""
ACTIVE = "active_bytes.all.current"
"""``torch.cuda.memory_stats`` key: bytes of live allocations and of freed blocks still waiting for the events of
the streams they were recorded on (``record_stream``): the caching allocator reuses those only after the events
completed (it checks them when it next allocates)."""


def cuda_memory_stats(device: Optional[torch.device]) -> Dict[str, int]:
    """The two counters the meter reads (host bookkeeping, no synchronisation). From the allocator's nested
    statistics: ``torch.cuda.memory_stats`` flattens all of them in Python, a cost on every op boundary."""
    nested = torch.cuda.memory_stats_as_nested_dict(device)
    return {name: nested.get(group, {}).get("all", {}).get("current", 0)
            for name, group in ((ALLOCATED, "allocated_bytes"), (ACTIVE, "active_bytes"))}


class AllocatorMeter:
    """Activation bytes per key from the CUDA caching allocator's counters read at op boundaries.

    What counts (the semantics of :class:`SavedTensorMeter`, measured from the allocator): for each key, the bytes
    its forward left allocated (``allocated`` after minus before the :meth:`record` block, so temporaries freed
    inside the op -- logits, loss terms, sequence-parallel gathers, recomputation scratch -- never count), plus its
    input (:meth:`hold_input`: allocated by the receive, kept until the backward), less its output once the runtime
    freed it (:meth:`untrack`) and what host placement moved out (:meth:`offloaded`), plus what the reload brought
    back (:meth:`reloaded`), until its backward ended (:meth:`release`). Freed blocks the allocator cannot reuse yet
    (``active - allocated``: storages freed with ``record_stream`` whose side-stream copy has not finished, above all
    an offloaded storage until its device-to-host copy is done) count as device memory too. ``peak_bytes`` is the
    largest such sum where activations grow (the end of every recorded forward, every reload). Model state,
    receive buffers not yet consumed, gradients and ZeRO gathers belong to no key and never count. The meter never
    resets the allocator's peak counters: Megatron's memory report (``max_memory_allocated``) stays what it is.
    ``stats``: the counters' source (:func:`cuda_memory_stats` of ``device``; tests may pass their own)."""

    kind = "cuda-allocator"

    def __init__(self, device: Optional[torch.device] = None,
                 stats: Optional[Callable[[Optional[torch.device]], Dict[str, int]]] = None):
        self.device = device
        self._stats = stats or cuda_memory_stats
        self.baseline = 0
        """Bytes allocated at :meth:`begin` (model state and whatever else was live then)."""
        self.saved_bytes: Dict[Key, int] = {}
        """Bytes each key's forward left allocated (saved tensors, output, one-off caches of a first forward) plus
        its held input."""
        self.tracked_bytes: Dict[Key, int] = {}
        """Empty: the outputs the runtime holds are inside ``saved_bytes`` already (kept for interface parity)."""
        self.peak_bytes = 0
        self._held: Dict[Key, int] = {}
        """Live keys -> device bytes they hold now."""
        self._outputs: Dict[Key, int] = {}
        """Bytes of each key's output the runtime still holds (subtracted when it is freed)."""
        self._inputs: Dict[Key, set] = {}
        """Storage pointers of each key's held inputs (each counted once)."""
        self._frames: List[list] = []
        """Open :meth:`record` blocks: [key, allocated at entry, bytes of nested blocks]."""
        self._host: Dict[Key, int] = {}
        self.host_bytes = 0
        self.peak_host_bytes = 0
        self.offloaded_bytes: Dict[Key, int] = {}

    # Reading the allocator -------------------------------------------------------------------------
    def _read(self) -> Tuple[int, int]:
        """(allocated, freed-but-not-reusable) bytes now."""
        stats = self._stats(self.device)
        allocated = int(stats.get(ALLOCATED, 0))
        return allocated, max(int(stats.get(ACTIVE, allocated)) - allocated, 0)

    @property
    def live_bytes(self) -> int:
        """Bytes the live keys hold plus freed blocks not reusable yet."""
        return sum(self._held.values()) + self._read()[1]

    def _sample_peak(self) -> None:
        """Where activations grow: the keys' bytes plus the blocks still waiting for their copies. (Not sampled where
        they shrink: the allocator checks pending events only when it next allocates, so a block whose copy finished
        would still look pending there.)"""
        self.peak_bytes = max(self.peak_bytes, sum(self._held.values()) + self._read()[1])

    # Set-up -----------------------------------------------------------------------------------------
    def begin(self) -> None:
        """Start of a call: forget the previous call's keys (no allocator counter is reset)."""
        self.baseline = self._read()[0]
        self.peak_bytes = 0
        self._held, self._outputs, self._inputs, self._frames = {}, {}, {}, []

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        """Allocated before :meth:`begin`: in the baseline, never in a key's delta."""

    # Accounting -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def record(self, key: Key, inner: Optional[Tuple[Callable, Callable]] = None) -> Iterator[None]:
        """Account what the block (one forward of ``key``) leaves allocated to ``key``; ``inner``: (pack, unpack)
        saved-tensor hooks to install around it (host placement's). A block inside another block of the same key
        adds nothing (the outer one counts it); inside another key's block it counts for its own key only."""
        if any(frame[0] == key for frame in self._frames):
            with torch.autograd.graph.saved_tensors_hooks(*inner) if inner else contextlib.nullcontext():
                yield
            return
        frame = [key, self._read()[0], 0]
        self._frames.append(frame)
        try:
            with torch.autograd.graph.saved_tensors_hooks(*inner) if inner else contextlib.nullcontext():
                yield
        finally:
            assert self._frames[-1] is frame  # blocks nest (one meter per thread)
            self._frames.pop()
            delta = self._read()[0] - frame[1]
            own = delta - frame[2]
            if self._frames:
                self._frames[-1][2] += delta
            self.saved_bytes[key] = self.saved_bytes.get(key, 0) + own
            self._held[key] = self._held.get(key, 0) + own
            self._sample_peak()

    def hold_input(self, key: Key, tensor: Optional[torch.Tensor]) -> None:
        """``key``'s input, allocated before its forward (the receive's buffer), is kept until its backward."""
        found = _storage(tensor) if isinstance(tensor, torch.Tensor) else None
        if found is None or found[0] in self._inputs.setdefault(key, set()):
            return
        self._inputs[key].add(found[0])
        self.saved_bytes[key] = self.saved_bytes.get(key, 0) + found[1]
        self._held[key] = self._held.get(key, 0) + found[1]
        self._sample_peak()

    def track(self, key: Key, tensor: Optional[torch.Tensor]) -> None:
        """``key``'s output, which its forward allocated (already counted): remembered to subtract at :meth:`untrack`."""
        found = _storage(tensor) if isinstance(tensor, torch.Tensor) else None
        if found is not None:
            self._outputs[key] = found[1]

    def untrack(self, key: Key) -> None:
        """The runtime freed ``key``'s output (Megatron's ``deallocate_output_tensor`` after the send)."""
        freed = self._outputs.pop(key, 0)
        if key in self._held:
            self._held[key] = max(self._held[key] - freed, 0)

    def offloaded(self, key: Key, storages: Iterable[Tuple[int, int]]) -> None:
        """Host placement moved ``key``'s storages to host memory and freed their device copies. Those stop counting
        for the key, but stay device memory until their copy's event completed: the allocator shows them as freed yet
        not reusable (``active - allocated``), which every later sample adds."""
        moved = sum(nbytes for _, nbytes in storages)
        if key in self._held:
            self._held[key] = max(self._held[key] - moved, 0)
        self._host[key] = self._host.get(key, 0) + moved
        self.offloaded_bytes[key] = self.offloaded_bytes.get(key, 0) + moved
        self.host_bytes += moved
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)

    def reloaded(self, key: Key, storages: Iterable[Tuple[int, int]]) -> None:
        """The reload allocated ``key``'s storages on the device again (until its :meth:`release`)."""
        self._held[key] = self._held.get(key, 0) + sum(nbytes for _, nbytes in storages)
        self.host_bytes -= self._host.pop(key, 0)
        self._sample_peak()

    def release(self, key: Key) -> None:
        """``key``'s backward finished: everything it held is free (a second release does nothing)."""
        self.host_bytes -= self._host.pop(key, 0)
        self._held.pop(key, None)
        self._outputs.pop(key, None)
        self._inputs.pop(key, None)

    def live_keys(self) -> Tuple[Key, ...]:
        return tuple(self._held)


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
