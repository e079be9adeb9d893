"""Host placement of activations: the runtime side of the ``OFFLOAD c.j`` / ``RELOAD c.j`` ops.

A chunk-micro-batch whose placement level is ``'host'`` (``schedule.levers.HOST``) runs its
forward with every recompute switch off (as ``'none'``). Its saved tensors are captured *per tensor*, not with
``torch.autograd.graph.saved_tensors_hooks`` around the forward: at ``OFFLOAD`` the offloader walks the
autograd graph of the chunk's outputs and registers :meth:`ActivationOffloader.hooks`' pack/unpack
pair on each saved tensor it moves (``SavedTensor.register_hooks``), which packs it into a
:class:`_Saved` handle (a detached alias plus the view metadata); unpack returns the tensor from
wherever it lives at that moment. Why per tensor: under default hooks autograd hands every backward a
*new* tensor object for each saved tensor, so a saved Parameter loses its identity and attributes
(Megatron's gradient-accumulation fusion and Transformer Engine read ``weight.main_grad`` and set
``grad_added_to_main_grad`` on it, and with ``--overlap-grad-reduce`` DDP's hook then finds no
``param.grad``); saved tensors the offloader leaves alone -- Parameters first of all -- get no hooks
and reach the backward as themselves. The walk visits each node of the chunk's graph once (it ends at
the leaves: the chunk's input and the parameters); a tensor saved by no node reachable from the outputs
died with its graph and needs no copy. (Under an outer saved-tensor meter, which installs default
hooks and so already hides the tensors from per-tensor ones, the meter composes the same pair inside
its own: ``SavedTensorMeter.record(key, inner=...)``.)

* ``OFFLOAD c.j`` (:meth:`ActivationOffloader.offload`) copies the *storages* behind the live handles
  into one host block of the key (packed, each at an aligned offset) and drops the device references,
  so the device memory is freed. Storages are deduplicated (two saved views of one storage travel once
  and come back as views of one storage).
* ``RELOAD c.j`` (:meth:`ActivationOffloader.reload`) copies each storage back into a fresh device
  buffer and rebuilds every handle's tensor as the same view of it; the host block returns to the
  pool. :meth:`ActivationOffloader.wait` (called just before ``B c.j``) makes the backward wait for
  the reload; an unpack of a tensor still on the host is an error (the lowering puts RELOAD first).

The executor's own tensors: the chunk's **input** (the received activation, which the first layer
saves and whose ``.grad`` ``backward_step`` reads) is offloaded with the saved tensors and its
``.data`` swapped for an empty placeholder until the reload puts the reloaded view back (``swap``:
the tensor object, a leaf autograd knows, stays the same; Megatron's ``deallocate_output_tensor``
uses the same trick for sent outputs). The chunk's **output** stays (``keep``): it is the backward's
root, freed by ``deallocate_output_tensor`` after its send as usual (on the last stage it is the loss).

What is *not* offloaded (stays on the device, even when saved): parameters and registered buffers
and anything sharing their storage; tensors on another device or without a real storage (sparse, meta,
tensor subclasses without one); ``keep`` tensors and what aliases them. Parameter storages are
recognised by their storage object, not its address: a ZeRO-3 chunk's parameter buffer is freed and
re-allocated in place (a new address, the same storage) by the sharding runtime after
:meth:`ActivationOffloader.begin`, and must never be copied out.

Copies and buffers:

* CUDA: device-to-host copies run on one side stream and host-to-device copies on another (the
  link is full-duplex), both non-blocking, into pinned host blocks taken from
  :class:`HostBufferPool`, which the executor sizes at the schedule's start from the plan's block sizes
  (:meth:`ActivationOffloader.reserve`, before any receive is posted: a pinned allocation inside OFFLOAD would
  run while posted NCCL receives spin); it grows inside an OFFLOAD only when the plan priced a block too small (or
  gave no sizes: then in the first iteration only). A block's size is the key's bytes rounded up to a power of
  two (:func:`~..planning.memory.host_block_bytes`): torch's caching host allocator rounds every pinned
  block that way, so asking for exactly that size makes the pool's count the real pinned memory, and
  the planner holds its host budget to the same rounded bytes. Ordering uses events only (no
  host synchronisation): the offload stream waits for the compute stream (the forward wrote the
  tensors); the reload stream waits for the offload's completion and for the compute stream at the
  point where the device buffer was allocated; the compute stream waits for the reload before the
  backward; a host block goes back to the pool with the event of the copy that last read it and
  the next user's stream waits for that event. ``record_stream`` marks every device storage the
  side streams touched, so the caching allocator reuses it only after the copy finished.
* CPU: the same code with synchronous copies into (unpinned) pool blocks of the same sizes; "device
  memory" is freed by dropping the references to the original storages. Numerics and placement are
  therefore tested on CPU exactly as they run on CUDA, minus the streams.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, Hashable, Iterable, Iterator, List, Mapping, Optional, Tuple

import torch

from ..planning.memory import host_block_bytes

Key = Hashable


class OffloadError(RuntimeError):
    """A host copy cannot run (unknown key, wrong order); the executor adds rank, step and op."""


class _Saved:
    """What autograd holds instead of a saved tensor: the tensor, or where its bytes are."""

    __slots__ = ("tensor", "dtype", "offset", "size", "stride", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor: Optional[torch.Tensor] = tensor
        self.dtype, self.offset = tensor.dtype, tensor.storage_offset()
        self.size, self.stride = tuple(tensor.size()), tuple(tensor.stride())


def _storage_id(tensor: torch.Tensor) -> Optional[int]:
    """The identity of ``tensor``'s storage object: unlike its address, it survives ``resize_`` (the sharding
    runtime frees and re-allocates ZeRO-3 parameter buffers in place)."""
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, AttributeError):  # sparse, nested, meta, subclasses
        return None


def _storage_ptr(tensor: torch.Tensor) -> Optional[int]:
    try:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
    except (RuntimeError, NotImplementedError, AttributeError):  # sparse, nested, meta, subclasses
        return None
    return ptr if ptr and storage.nbytes() else None


_RAW = "_raw_saved_"
_SAVED_SLOTS: Dict[type, Tuple[Tuple[str, str], ...]] = {}
"""Autograd node type -> (raw saved-tensor attribute, attribute unpacking it) pairs (``dir`` once per type)."""


def _saved_slots(node) -> Tuple[Tuple[str, str], ...]:
    slots = _SAVED_SLOTS.get(type(node))
    if slots is None:
        custom = isinstance(node, torch.autograd.function.BackwardCFunction)  # ctx.save_for_backward
        slots = tuple((name, "saved_tensors" if custom and name == _RAW + "tensors" else "_saved_" + name[len(_RAW):])
                      for name in dir(node) if name.startswith(_RAW))
        _SAVED_SLOTS[type(node)] = slots
    return slots


def _graph_saved_tensors(roots: Iterable[Optional[torch.Tensor]]) -> Iterator[Tuple[object, torch.Tensor]]:
    """(``SavedTensor``, its tensor) of every tensor saved in the autograd graphs of ``roots``."""
    stack = [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for raw_name, value_name in _saved_slots(node):
            try:
                raws, values = getattr(node, raw_name), getattr(node, value_name)
            except RuntimeError:  # freed by a backward
                continue
            if not isinstance(raws, (tuple, list)):
                raws, values = (raws,), (values,)
            for raw, value in zip(raws, values):
                if isinstance(value, torch.Tensor):
                    yield raw, value
        stack.extend(following for following, _ in node.next_functions if following is not None)


_ALIGN = 64
"""Byte alignment of each storage in a key's host block (a cache line)."""


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _bytes_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over ``tensor``'s whole storage."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, 0, (storage.nbytes(),), (1,))


class HostBufferPool:
    """Reusable host blocks (pinned on CUDA) in size classes of :func:`host_block_bytes` (powers of two).

    ``reserve`` allocates blocks up front (at a schedule's start: :mod:`..schedule.host_blocks`). ``acquire``
    returns a free block of the class of ``nbytes``, else the smallest larger free one (a key priced above its real
    size still uses its reserved block), allocating only when none is free, and the event of the last copy that
    read it (None when free to use); ``release`` returns it with that event. A block is allocated at exactly its
    class size, which torch's caching host allocator does not round further: ``allocated_bytes`` is the real
    (pinned) memory.
    """

    def __init__(self, pin: bool):
        self.pin = pin
        self._free: Dict[int, List[Tuple[torch.Tensor, object]]] = {}
        self._blocks: Dict[int, int] = {}
        """Size -> blocks of that size the pool owns (free or lent)."""
        self.allocated_bytes = 0
        """Host bytes this pool ever allocated (its footprint: blocks are never given back)."""
        self.allocations = 0
        self.late_allocations = 0
        """Blocks ``acquire`` had to allocate (inside an OFFLOAD) after a reservation: 0 when the plan sized the pool."""
        self.reserved = False
        self.late_reported = False
        """The executor said so (once per pool)."""

    def _allocate(self, size: int) -> torch.Tensor:
        try:
            block = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        except RuntimeError as error:
            raise OffloadError(f"cannot allocate a {'pinned ' if self.pin else ''}host block of {size / 2**20:.1f} MiB "
                               f"for host placement (the pool holds {self.allocated_bytes / 2**30:.2f} GiB in "
                               f"{self.allocations} blocks): {error}. Give the plan less host memory "
                               "(--pipemesh-host-memory-gb) or run fewer ranks per node") from error
        self.allocations += 1
        self.allocated_bytes += size
        self._blocks[size] = self._blocks.get(size, 0) + 1
        return block

    def reserve(self, blocks: Mapping[int, int]) -> int:
        """Own at least ``blocks[size]`` blocks of each size (allocating the missing ones, free); returns bytes
        allocated now. Call it while every block is free (between calls)."""
        added = 0
        for size, count in blocks.items():
            for _ in range(count - self._blocks.get(size, 0)):
                self._free.setdefault(size, []).append((self._allocate(size), None))
                added += size
        self.reserved = self.reserved or bool(blocks)
        return added

    def acquire(self, nbytes: int) -> Tuple[torch.Tensor, object]:
        size = host_block_bytes(nbytes)
        free = self._free.get(size)
        if free:
            return free.pop()
        larger = min((s for s, blocks in self._free.items() if s > size and blocks), default=None)
        if larger is not None:
            return self._free[larger].pop()
        if self.reserved:
            self.late_allocations += 1
        return self._allocate(size), None

    def release(self, buffer: torch.Tensor, event: object = None) -> None:
        self._free.setdefault(buffer.numel(), []).append((buffer, event))


@dataclass
class _Group:
    """One offloaded storage: where it lies in its key's host block and the handles that view it."""

    nbytes: int
    handles: List[Callable[[], Optional[_Saved]]]
    """Weak references to autograd's handles (and strong ones to swapped tensors' records)."""
    offset: int = 0
    """Byte offset in the key's host block."""


@dataclass
class _Entry:
    """Host-placement state of one key (chunk, micro-batch) in the current call."""

    handles: List["weakref.ref[_Saved]"] = field(default_factory=list)
    state: str = "device"
    """'device' (captured by the forward), 'host' (offloaded), 'reloaded'."""
    groups: List[_Group] = field(default_factory=list)
    offload_done: object = None
    """CUDA event: the device-to-host copies finished (host buffers valid)."""
    reload_done: object = None
    """CUDA event: the host-to-device copies finished (the backward may run)."""
    host_bytes: int = 0
    host: Optional[torch.Tensor] = None
    """The key's host block (from the pool) while offloaded."""
    swapped: List[Tuple[torch.Tensor, _Saved]] = field(default_factory=list)
    """The caller's tensors whose ``.data`` is empty while offloaded, with where their view comes back."""
    hooks: Tuple[Callable, Callable] = (None, None)
    """The key's (pack, unpack) pair (:meth:`ActivationOffloader.hooks`)."""


class ActivationOffloader:
    """Moves the saved activations of host-placed keys to host memory and back (see module doc).

    One instance per schedule (its pool and streams live across calls); :meth:`clear` ends a call.
    ``meter`` (optional, :mod:`.memory`) is told which storages moved (``offloaded`` / ``reloaded``).
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.pool = HostBufferPool(pin=self.cuda)
        self._d2h = self._h2d = None
        if self.cuda:  # full-duplex link: one stream per direction
            self._d2h = torch.cuda.Stream(device=self.device)
            self._h2d = torch.cuda.Stream(device=self.device)
        self._entries: Dict[Key, _Entry] = {}
        self._excluded: set = set()
        self.meter = None
        self.host_bytes = 0
        """Bytes of activations currently in host memory."""
        self.peak_host_bytes = 0
        self.block_bytes = 0
        """Bytes of the host blocks holding them (each key's rounded up: the real host memory in use)."""
        self.peak_block_bytes = 0

    # Per call ------------------------------------------------------------------------------------
    def reserve(self, blocks: Mapping[int, int]) -> int:
        """Allocate the pinned blocks a call's program needs (size -> count, :func:`..schedule.host_blocks.pool_blocks`)
        that the pool does not own yet, at the call's start; returns the bytes allocated now (0 after the first call)."""
        return self.pool.reserve(blocks)

    def begin(self, excluded: Iterable[torch.Tensor] = (), meter=None) -> None:
        """Start a call: ``excluded`` storages (parameters, buffers) never move, wherever their bytes are later."""
        self.clear()
        self._excluded = {s for s in (_storage_id(t) for t in excluded) if s is not None}
        self.meter = meter
        self.peak_host_bytes = self.peak_block_bytes = 0

    def clear(self) -> None:
        """Forget every key (end of call or failure); host buffers go back to the pool."""
        for entry in self._entries.values():
            if entry.host is not None:
                self.pool.release(entry.host, entry.offload_done)
                entry.host = None
        self._entries = {}
        self.host_bytes = self.block_bytes = 0

    # Capture -------------------------------------------------------------------------------------
    def hooks(self, key: Key) -> Tuple[Callable, Callable]:
        """Start capturing ``key`` (call it before its forward) and return its (pack, unpack) pair: OFFLOAD
        registers it on each saved tensor it moves; under an outer saved-tensor meter the meter installs it
        inside its own default hooks instead (then every saved tensor is packed during the forward)."""
        if key in self._entries:
            raise OffloadError(f"chunk-micro-batch {key} was already captured in this call")
        entry = self._entries[key] = _Entry()

        def pack(tensor):
            if not isinstance(tensor, torch.Tensor):
                return tensor
            handle = _Saved(tensor.detach())  # detached alias: no reference cycle through grad_fn
            entry.handles.append(weakref.ref(handle))
            return handle

        def unpack(handle):
            if not isinstance(handle, _Saved):
                return handle
            if handle.tensor is None:
                raise OffloadError(f"the backward of chunk-micro-batch {key} needs a tensor that is still in host "
                                   "memory (RELOAD must run before the backward)")
            return handle.tensor

        entry.hooks = (pack, unpack)
        return pack, unpack

    def _hook_graph(self, entry: _Entry, roots: Iterable[Optional[torch.Tensor]], keep: set) -> None:
        """Register ``entry``'s hooks on every movable saved tensor in the autograd graphs of ``roots`` (the
        graph ends at leaves: the chunk's input and the parameters). Tensors with hooks already (another
        key's, an outer meter's) are someone else's: they stay, and so do scalars (autograd saves Python numbers
        as 0-dim tensors, which default hooks never see)."""
        for raw, value in _graph_saved_tensors(roots):
            movable = value.dim() > 0 and self._movable(value, keep) is not None
            del value  # an unpacked alias: it must not keep the storage alive
            if movable:
                try:
                    raw.register_hooks(*entry.hooks)
                except RuntimeError:  # hooked already
                    continue

    def _entry(self, key: Key, expected: str, what: str) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            raise OffloadError(f"{what}: chunk-micro-batch {key} has no captured activations (its forward did not "
                               "run with host placement in this call)")
        if entry.state != expected:
            raise OffloadError(f"{what}: chunk-micro-batch {key} is in state {entry.state!r}, expected {expected!r}")
        return entry

    def _movable(self, tensor: torch.Tensor, keep: set) -> Optional[int]:
        if isinstance(tensor, torch.nn.Parameter) or tensor.device != self.device:
            return None
        ptr = _storage_ptr(tensor)
        return None if ptr is None or ptr in keep or _storage_id(tensor) in self._excluded else ptr

    # Copies --------------------------------------------------------------------------------------
    def offload(self, key: Key, keep: Iterable[Optional[torch.Tensor]] = (),
                swap: Iterable[Optional[torch.Tensor]] = (), roots: Iterable[Optional[torch.Tensor]] = ()) -> int:
        """Launch the copy of ``key``'s saved storages to host memory and drop them from the device
        (``roots``: the forward's outputs, whose autograd graphs hold the saved tensors; ``keep``: tensors the
        caller holds that must stay, e.g. the chunk's output; ``swap``: tensors the caller holds whose storage
        may go, their ``.data`` emptied until :meth:`reload`, e.g. the input). Returns bytes."""
        entry = self._entry(key, "device", "OFFLOAD")
        keep_ptrs = {p for p in (_storage_ptr(t) for t in keep if isinstance(t, torch.Tensor)) if p is not None}
        if not entry.handles:  # not packed during the forward (no outer meter): hook the graph's saved tensors
            self._hook_graph(entry, roots, keep_ptrs)
        groups: Dict[int, Tuple[torch.Tensor, _Group]] = {}
        for ref in entry.handles:
            handle = ref()
            if handle is None or handle.tensor is None:
                continue  # its graph died during the forward (e.g. dropped intermediate results)
            ptr = self._movable(handle.tensor, keep_ptrs)
            if ptr is None:
                continue
            if ptr not in groups:
                source = _bytes_view(handle.tensor)
                groups[ptr] = (source, _Group(source.numel(), []))
            groups[ptr][1].handles.append(ref)
        entry.handles = []
        for tensor in swap:  # the caller's own reference to a moving storage: emptied, restored at reload
            ptr = _storage_ptr(tensor) if isinstance(tensor, torch.Tensor) else None
            if ptr in groups and tensor.device == self.device:
                record = _Saved(tensor.detach())
                groups[ptr][1].handles.append(lambda record=record: record)  # a strong "reference"
                entry.swapped.append((tensor, record))
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        stream = self._d2h
        if self.cuda:
            ready = torch.cuda.current_stream(self.device).record_event()
            stream.wait_event(ready)  # the forward wrote these tensors on the compute stream
        with torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext():
            offset = 0
            for _, group in groups.values():
                group.offset, offset = offset, offset + _aligned(group.nbytes)
            if groups:
                entry.host, previous_reader = self.pool.acquire(offset)
                if previous_reader is not None:
                    stream.wait_event(previous_reader)
            for source, group in groups.values():
                entry.host[group.offset:group.offset + group.nbytes].copy_(source, non_blocking=self.cuda)
                if self.cuda:
                    source.record_stream(stream)  # freed storage is reused only after the copy
            if self.cuda:
                entry.offload_done = stream.record_event()
        for _, group in groups.values():  # the device copies are now referenced by nobody here
            for ref in group.handles:
                handle = ref()
                if handle is not None:
                    handle.tensor = None
        moved = [(ptr, group.nbytes) for ptr, (_, group) in groups.items()]
        entry.groups = [group for _, group in groups.values()]
        entry.host_bytes = sum(n for _, n in moved)
        entry.state = "host"
        self.host_bytes += entry.host_bytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        self.block_bytes += entry.host.numel() if entry.host is not None else 0
        self.peak_block_bytes = max(self.peak_block_bytes, self.block_bytes)
        if self.meter is not None:
            self.meter.offloaded(key, moved)
        return entry.host_bytes

    def reload(self, key: Key) -> int:
        """Launch the copy of ``key``'s storages back to the device; returns bytes."""
        entry = self._entry(key, "host", "RELOAD")
        stream = self._h2d
        targets = [torch.empty(group.nbytes, dtype=torch.uint8, device=self.device) for group in entry.groups]
        if self.cuda:
            # The buffers were allocated in the compute stream's order, and the host bytes must be complete.
            stream.wait_event(torch.cuda.current_stream(self.device).record_event())
            if entry.offload_done is not None:
                stream.wait_event(entry.offload_done)
        with torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext():
            for target, group in zip(targets, entry.groups):
                target.copy_(entry.host[group.offset:group.offset + group.nbytes], non_blocking=self.cuda)
                if self.cuda:
                    target.record_stream(stream)
            if self.cuda:
                entry.reload_done = stream.record_event()
        if entry.host is not None:
            self.block_bytes -= entry.host.numel()
            self.pool.release(entry.host, entry.reload_done)  # reusable once this copy has read it
            entry.host = None
        moved = []
        for target, group in zip(targets, entry.groups):
            storage = target.untyped_storage()
            for ref in group.handles:
                handle = ref()
                if handle is not None:
                    handle.tensor = torch.empty(0, dtype=handle.dtype, device=self.device).set_(
                        storage, handle.offset, handle.size, handle.stride)
            moved.append((storage.data_ptr(), group.nbytes))
        for tensor, record in entry.swapped:
            tensor.data = record.tensor
            record.tensor = None
        entry.swapped = []
        entry.groups = []
        entry.state = "reloaded"
        self.host_bytes -= entry.host_bytes
        if self.meter is not None:
            self.meter.reloaded(key, moved)
        return entry.host_bytes

    def wait(self, key: Key) -> None:
        """Just before ``key``'s backward: the compute stream waits for its reload (no host sync)."""
        entry = self._entry(key, "reloaded", "backward")
        if entry.reload_done is not None:
            torch.cuda.current_stream(self.device).wait_event(entry.reload_done)

    def release(self, key: Key) -> None:
        """``key``'s backward finished."""
        self._entries.pop(key, None)

    def placed(self, key: Key) -> bool:
        return key in self._entries

