"""Pipeline ranks as threads of one process: an in-process transport for tests and ``scripts/gpu_check.py``.

A :class:`LoopbackWorld` stands in for the processes and their link groups (NCCL cannot put two ranks on one
GPU, and a test of the executor should not need processes). Each rank thread gives the executor its own
:class:`LoopbackTransport` (``PipeMeshSchedule(..., transport=world.transport(rank))``) and passes
``world.pipeline_group`` as the pipeline group. A send and its receive (same link, same tag, in FIFO order)
meet in the world, and the later of the two launches the copy (:class:`CopyEngine`). On CUDA it behaves like
NCCL's point-to-point kernels (:class:`CudaCopyEngine`): each post records an event on the poster's current
stream (a thread-rank can run on a compute stream of its own), the copy runs on the link's own communication
stream after both events, and a wait makes the waiting rank's current stream wait for the copy's event (the
host never waits for the data); a transfer counts as completed once that event has. The world holds no
reference to a tensor after the match, so a rank that frees a send tensor or a receive buffer before its
transfer completed gets what NCCL would give it: a block the caching allocator hands to its next kernel while
the copy may still read or write it. ``copy_delay_cycles`` makes every copy wait that many GPU cycles on its
stream first (``torch.cuda._sleep``), so such a missing wait is caught instead of usually winning the race.

``backend`` chooses the policy the transport applies: ``'gloo'`` (timed waits) or ``'nccl'`` (untimed waits;
receives a failed call left posted break their links), so the CPU checks both. Every wait's arguments are
recorded in :attr:`LoopbackWorld.waits`.
"""
from __future__ import annotations

import collections
import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, FrozenSet, Iterable, List, Optional, Tuple

import torch

from .transport import LinkKey, PipelineTransport


def ring_links(size: int) -> FrozenSet[LinkKey]:
    """The links of one pipeline over ranks ``0..size-1``: activations r -> r+1 and gradients r+1 -> r, with the
    wrap-around between the last and the first rank that interleaved placement uses."""
    return frozenset([("F", r, (r + 1) % size) for r in range(size)] + [("B", (r + 1) % size, r) for r in range(size)])


@dataclass(frozen=True)
class LoopbackGroup:
    """A group of thread-ranks (the pipeline group the executor is given)."""

    ranks: Tuple[int, ...]
    """Global ranks, in group-rank order."""


class CopyEngine:
    """How a matched transfer's copy runs: here on the host, at once (CPU tensors); events are None."""

    def ready(self, tensor: torch.Tensor) -> Any:
        """At post time, on the poster's thread: what the copy must wait for (the poster's work on ``tensor``)."""
        return None

    def copy(self, link: Any, source: torch.Tensor, target: torch.Tensor, ready: Tuple[Any, Any]) -> Any:
        """Copy ``source`` into ``target`` after ``ready`` (the sender's and the receiver's); returns its event."""
        with torch.no_grad():
            target.copy_(source)
        return None

    def wait(self, event: Any) -> None:
        """On the waiting thread: order its later work after the copy."""

    def done(self, event: Any) -> bool:
        """Whether the copy behind ``event`` finished."""
        return True


class CudaCopyEngine(CopyEngine):
    """NCCL's way (see the module doc): poster events, one communication stream per link, event waits."""

    def __init__(self, delay_cycles: int = 0):
        self.delay_cycles = delay_cycles
        """GPU cycles each copy sleeps on its stream before it starts (0: none)."""
        self._streams: Dict[Any, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def _stream(self, link: Any, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            if link not in self._streams:
                self._streams[link] = torch.cuda.Stream(device=device)
            return self._streams[link]

    def ready(self, tensor: torch.Tensor) -> Any:
        return torch.cuda.current_stream(tensor.device).record_event()

    def copy(self, link: Any, source: torch.Tensor, target: torch.Tensor, ready: Tuple[Any, Any]) -> Any:
        stream = self._stream(link, target.device)
        for event in ready:
            stream.wait_event(event)
        with torch.cuda.stream(stream), torch.no_grad():
            if self.delay_cycles:
                torch.cuda._sleep(self.delay_cycles)
            target.copy_(source)
            return stream.record_event()

    def wait(self, event: Any) -> None:
        torch.cuda.current_stream().wait_event(event)

    def done(self, event: Any) -> bool:
        return bool(event.query())


class LoopbackWork:
    """A posted loopback transfer (the c10d ``Work`` calls the executor makes)."""

    def __init__(self, world: "LoopbackWorld"):
        self._world, self._matched, self._event = world, threading.Event(), None
        self._engine: CopyEngine = world.host_engine

    def _complete(self, event: Any, engine: CopyEngine) -> None:
        self._event, self._engine = event, engine
        self._matched.set()

    def wait(self, *args) -> bool:
        """Until the peer posted (at most ``args[0]``, a timedelta: then False, as a timed c10d wait; untimed, at most
        the world's ``host_timeout_s``, then RuntimeError, standing in for NCCL's watchdog); then, on CUDA, the
        current stream waits for the copy."""
        self._world.waits.append(args)
        limit = args[0].total_seconds() if args else self._world.host_timeout_s
        if not self._matched.wait(limit):
            if args:
                return False
            raise RuntimeError(f"loopback transfer not matched within {self._world.host_timeout_s} s")
        if self._event is not None:
            self._engine.wait(self._event)
        return True

    def is_completed(self) -> bool:
        return self._matched.is_set() and (self._event is None or self._engine.done(self._event))


class LoopbackWorld:
    """The thread-ranks ``0..size-1`` of one pipeline and their links."""

    def __init__(self, size: int, backend: str = "gloo", host_timeout_s: float = 120.0,
                 links: Optional[Iterable[LinkKey]] = None, copy_delay_cycles: int = 0,
                 engine: Optional[CopyEngine] = None):
        self.size = size
        """Number of ranks (threads)."""
        self.backend = backend
        """Backend name the transports report ('gloo' or 'nccl'): the wait policy the executor gets."""
        self.host_timeout_s = host_timeout_s
        """Longest host wait for an untimed transfer or a collective (then an error: no test hangs)."""
        self.links = frozenset(links) if links is not None else ring_links(size)
        """Links that exist; a transfer on another one fails as a missing link group does."""
        self.pipeline_group = LoopbackGroup(tuple(range(size)))
        """The pipeline group to pass to the executor (``pg_collection.pp``)."""
        self.waits: List[tuple] = []
        """Arguments of every wait, in order: ``(timedelta,)`` timed, ``()`` untimed."""
        self.host_engine = CopyEngine()
        """Copies of CPU tensors."""
        self.engine = engine
        """Copies of every tensor when given (tests); else CPU tensors take :attr:`host_engine` and CUDA tensors a
        :class:`CudaCopyEngine` with ``copy_delay_cycles``, made on first use."""
        self.copy_delay_cycles = copy_delay_cycles
        """GPU cycles each CUDA copy waits on its stream first (0: none)."""
        self._lock = threading.Lock()
        self._queues: Dict[tuple, Dict[str, Deque[Tuple[torch.Tensor, LoopbackWork, Any]]]] = {}
        self._gathered: List[Any] = [None] * size
        self._barrier = threading.Barrier(size, timeout=host_timeout_s)

    def transport(self, rank: int) -> "LoopbackTransport":
        """The transport of thread-rank ``rank`` (one per rank and schedule)."""
        return LoopbackTransport(self, rank)

    def _engine_for(self, tensor: torch.Tensor) -> CopyEngine:
        if self.engine is not None:
            return self.engine
        if not tensor.is_cuda:
            return self.host_engine
        with self._lock:
            if not isinstance(self.engine_cuda, CudaCopyEngine):
                self.engine_cuda = CudaCopyEngine(self.copy_delay_cycles)
            return self.engine_cuda

    engine_cuda: Optional[CopyEngine] = None
    """The CUDA copies' engine, once a CUDA tensor was posted."""

    def _post(self, kind: str, tensor: torch.Tensor, key: tuple) -> LoopbackWork:
        """Post a 'send' or 'recv' under ``key`` = (link, tag); the second of a pair launches the copy."""
        work = LoopbackWork(self)
        engine = self._engine_for(tensor)
        ready = engine.ready(tensor)  # on the poster's thread: its current stream
        with self._lock:
            queues = self._queues.setdefault(key, {"send": collections.deque(), "recv": collections.deque()})
            other = queues["recv" if kind == "send" else "send"]
            if not other:
                queues[kind].append((tensor, work, ready))
                return work
            peer_tensor, peer_work, peer_ready = other.popleft()
        if kind == "send":
            source, target, events = tensor, peer_tensor, (ready, peer_ready)
        else:
            source, target, events = peer_tensor, tensor, (peer_ready, ready)
        done = engine.copy(key[0], source, target, tuple(e for e in events if e is not None))
        work._complete(done, engine)
        peer_work._complete(done, engine)
        return work

    def _all_gather(self, rank: int, obj) -> List[Any]:
        self._gathered[rank] = obj
        self._barrier.wait()
        gathered = list(self._gathered)
        self._barrier.wait()  # no rank overwrites its slot before every rank has read
        return gathered


class LoopbackTransport(PipelineTransport):
    """One thread-rank's transport in a :class:`LoopbackWorld`; the link groups are the world's link keys."""

    def __init__(self, world: LoopbackWorld, rank: int):
        super().__init__()
        self.world, self._rank = world, rank

    def rank(self) -> int:
        return self._rank

    def group_ranks(self, group: LoopbackGroup) -> List[int]:
        return list(group.ranks)

    def backend(self, group) -> str:
        return self.world.backend

    def all_gather_object(self, obj) -> List[Any]:
        return self.world._all_gather(self._rank, obj)

    def _link_groups(self) -> Dict[LinkKey, LinkKey]:
        return {link: link for link in self.world.links if self._rank in link[1:]}

    def _missing_link_advice(self) -> str:
        return f"The loopback world has the links {sorted(self.world.links)} only"

    def _isend(self, tensor: torch.Tensor, dst: int, group: LinkKey, tag: int) -> LoopbackWork:
        return self.world._post("send", tensor, (group, tag))

    def _irecv(self, tensor: torch.Tensor, src: int, group: LinkKey, tag: int) -> LoopbackWork:
        return self.world._post("recv", tensor, (group, tag))


def run_ranks(world: LoopbackWorld, target: Callable[[LoopbackTransport], Any],
              timeout_s: Optional[float] = None) -> Tuple[Dict[int, Any], Dict[int, BaseException]]:
    """``target(transport)`` for every rank of ``world``, each on its own thread; returns (results, errors) by rank.
    A rank still running after ``timeout_s`` (default twice the world's host timeout) is in neither."""
    results: Dict[int, Any] = {}
    errors: Dict[int, BaseException] = {}

    def main(rank: int) -> None:
        try:
            results[rank] = target(world.transport(rank))
        except BaseException as error:  # noqa: BLE001 - reported to the caller, by rank
            errors[rank] = error

    threads = [threading.Thread(target=main, args=(rank,), name=f"pipemesh-rank{rank}", daemon=True)
               for rank in range(world.size)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + (timeout_s if timeout_s is not None else 2 * world.host_timeout_s)
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0.0))
    return dict(results), dict(errors)


@contextlib.contextmanager
def megatron_in_threads():
    """Make Megatron's process-wide state safe for rank threads running Megatron models.

    Processes each have their own; threads share it: the RNG tracker, whose ``fork()`` keeps the current
    state's name in the tracker (two threads inside ``fork()`` at once make it raise "current state name ... is
    not the same"), so the forks take turns (no transfer runs inside one); and the global memory buffer that
    attention computes its scores in (``dot_product_attention.py``), so each thread gets its own buffers
    (shared, one rank's scores could be overwritten by another's before its softmax read them). On CPU each
    thread must still enter the CPU compatibility layer's ``CudaToCpuMode`` itself (torch function modes are
    per thread).
    """
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.utils import GlobalMemoryBuffer

    class PerThreadBuffers(GlobalMemoryBuffer):
        """Megatron's buffer, its ``buffer`` dict one per thread."""

        def __init__(self):
            self._local = threading.local()

        @property
        def buffer(self):
            if not hasattr(self._local, "buffer"):
                self._local.buffer = {}
            return self._local.buffer

    tracker = tensor_parallel.get_cuda_rng_tracker()
    lock, shared_fork = threading.RLock(), tracker.fork

    @contextlib.contextmanager
    def serial_fork(*args, **kwargs):
        with lock, shared_fork(*args, **kwargs):
            yield

    tracker.fork = serial_fork
    shared_buffer, parallel_state._GLOBAL_MEMORY_BUFFER = parallel_state._GLOBAL_MEMORY_BUFFER, PerThreadBuffers()
    try:
        yield
    finally:
        del tracker.fork  # back to the class's method
        parallel_state._GLOBAL_MEMORY_BUFFER = shared_buffer
