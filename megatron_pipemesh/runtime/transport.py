"""Pipeline transfers of one rank: the seam between the executor and the processes.

The executor decides *when* a transfer happens (the plan: post the receive of ``F1.3``'s input, wait for it
just before ``F1.3``, send ``B0.2``'s input gradient, ...); a :class:`PipelineTransport` does it and owns
what outlives one op (as the stages of ``torch.distributed.pipelining`` own their send and receive ops):

* the running call's pending transfers: receives by the compute op that consumes them, sends in issue order
  until they completed (each link is one communicator carrying one direction, so a link's transfers match
  in FIFO order, the order the schedule validator checks);
* the call's tag: each call tags its transfers with its number (gloo matches tags; NCCL ignores them), so
  receives a failed call left posted can never take a later call's data;
* the wait policy (:class:`TransferPolicy`), chosen per call from the pipeline group's backend: timed waits
  on gloo, untimed ones on NCCL (no host synchronisation on the hot path);
* the failure state across calls: links a failed call left unusable (the next call refuses to run over
  them), the receives it left posted and the sends it left in flight (kept alive until they complete).

Implementations: :class:`DistTransport` (torch.distributed, every transfer on its link's own process group
from a provider the caller passes) and :class:`~.loopback.LoopbackTransport` (ranks as threads of one
process, for tests and ``scripts/gpu_check.py``).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from ..schedule.ops import Op, format_ops
from .errors import PipeMeshRuntimeError

LinkKey = Tuple[str, int, int]
"""One directed pipeline link: (direction 'F' or 'B', source global rank, destination global rank)."""

LinkGroups = Callable[[], Optional[Mapping[LinkKey, Any]]]
"""Provider of this rank's per-link process groups, called once per call that transfers (it may create them:
a collective call every rank makes at the same point), e.g. ``integration.parallel_state.get_pipemesh_p2p_groups``."""

Locate = Callable[[int, Op], str]
"""(step, op) -> where a failure happened, for error messages (the executor names rank, step, op and plan)."""

TAG_LIMIT = 1 << 30
"""Transfer tags cycle below this (gloo tags are 32-bit)."""


def link_name(link: LinkKey) -> str:
    """``'F 0->1'``: how errors and the broken-link list name a link."""
    return f"{link[0]} {link[1]}->{link[2]}"


def timed_waits(backend: str, device: torch.device) -> bool:
    """Whether waits on a group with ``backend`` for tensors on ``device`` may carry a timeout.

    Only gloo: its transfers run on the host, so a timed wait costs nothing and turns a dead peer into a
    clear error. On NCCL ``work.wait(timeout)`` blocks the host until the transfer has finished (an
    untimed wait only makes the current stream wait), so the runtime relies on the group's timeout and
    NCCL's watchdog there. ``backend`` may be a device map such as ``"cpu:gloo,cuda:nccl"``.
    """
    if ":" in backend:
        per_device = dict(part.split(":", 1) for part in backend.split(","))
        backend = per_device.get(torch.device(device).type, "")
    return backend == "gloo"


@dataclass(frozen=True)
class TransferPolicy:
    """How a backend's waits and failures are handled."""

    timed_waits: bool
    """Waits carry the call's timeout (see :func:`timed_waits`); untimed waits leave stuck jobs to the link
    groups' timeout and NCCL's watchdog, as with Megatron's own schedules."""
    posted_receives_break_links: bool
    """Receives a failed call left posted make their links unusable: NCCL cannot cancel them and ignores
    tags, so they would take a later call's data. On gloo they wait on their own call's tag, harmlessly."""


GLOO_POLICY = TransferPolicy(timed_waits=True, posted_receives_break_links=False)
"""gloo (transfers on the host)."""
NCCL_POLICY = TransferPolicy(timed_waits=False, posted_receives_break_links=True)
"""NCCL, and any backend but gloo."""


def policy_for(backend: str, device: torch.device) -> TransferPolicy:
    """The policy for a group with ``backend`` moving tensors on ``device``."""
    return GLOO_POLICY if timed_waits(backend, device) else NCCL_POLICY


@dataclass(eq=False, slots=True)
class Transfer:
    """One posted transfer."""

    work: Any
    """The backend's handle: ``wait()``, ``wait(timeout)``, ``is_completed()`` (a c10d Work, or a loopback one)."""
    tensor: torch.Tensor
    """The receive buffer, or the sent tensor (the executor's own, retired once the send completed)."""
    op: Op
    """The RECV_* / SEND_* op that posted it (named in errors)."""
    link: LinkKey
    """The link it travels on."""
    key: Op
    """The compute op it serves: the consumer of a receive, the producer of a send."""


class PipelineTransport:
    """One rank's pipeline transfers over the calls of a schedule.

    Subclasses connect it to processes (:meth:`rank` to :meth:`_irecv`); the call protocol is: :meth:`start_call`,
    then :meth:`post_receive` / :meth:`wait_receive` / :meth:`send` / :meth:`drain_sends` as the program says,
    then :meth:`end_call` when it ran through or :meth:`abandon` when it failed.
    """

    def __init__(self) -> None:
        self._calls = itertools.count()
        """Call counter: a call's transfer tag is its number modulo :data:`TAG_LIMIT`."""
        self.broken_links: List[str] = []
        """Links a failed call left unusable: a wait that timed out or failed (gloo closes the link's connection),
        or posted receives under :data:`NCCL_POLICY`. The next call fails naming them."""
        self.abandoned_receives = 0
        """Receives failed calls left posted (gloo: they wait forever on their own call's tag)."""
        self.abandoned_sends: List[Transfer] = []
        """Sends failed calls left in flight, kept until they complete: a gloo send whose work is dropped before
        its receiver posts is cancelled, so the peer would wait out its timeout for data this rank had sent; on
        NCCL the buffer must outlive the transfer. Completed ones are let go at the next call."""
        self._receives: Dict[Op, Transfer] = {}
        self._sends: List[Transfer] = []
        self._links: Mapping[LinkKey, Any] = {}
        self._tag = 0
        self._policy = GLOO_POLICY
        self._timeout = timedelta(minutes=30)
        self._locate: Locate = lambda step, op: f"rank {self.rank()}, step {step} ({op})"
        self._retire: Callable[[Op, torch.Tensor], None] = lambda op, tensor: None

    # Processes: what an implementation provides -----------------------------------------------
    def rank(self) -> int:
        """This rank's global rank."""
        raise NotImplementedError

    def group_ranks(self, group) -> List[int]:
        """Global ranks of ``group`` (the pipeline group), in group-rank order."""
        raise NotImplementedError

    def backend(self, group) -> str:
        """Backend name of ``group`` (picks the :class:`TransferPolicy`)."""
        raise NotImplementedError

    def all_gather_object(self, obj) -> List[Any]:
        """Every rank's ``obj``, indexed by global rank (a collective call)."""
        raise NotImplementedError

    def _link_groups(self) -> Optional[Mapping[LinkKey, Any]]:
        """This rank's link groups (fetched once per call that transfers)."""
        raise NotImplementedError

    def _missing_link_advice(self) -> str:
        """How to get the link groups, for the error naming a missing one."""
        raise NotImplementedError

    def _isend(self, tensor: torch.Tensor, dst: int, group, tag: int):
        raise NotImplementedError

    def _irecv(self, tensor: torch.Tensor, src: int, group, tag: int):
        raise NotImplementedError

    # Calls ------------------------------------------------------------------------------------
    @property
    def policy(self) -> TransferPolicy:
        """The running (or last) call's policy."""
        return self._policy

    @property
    def tag(self) -> int:
        """The running (or last) call's transfer tag."""
        return self._tag

    def start_call(self, *, pp_group, device: torch.device, timeout: timedelta, locate: Locate,
                   retire: Callable[[Op, torch.Tensor], None], uses_links: bool) -> None:
        """Begin a call: let go of abandoned sends that completed, refuse links an earlier call broke, take the
        call's tag, choose the policy from ``pp_group``'s backend for tensors on ``device``, and (when the program
        transfers, ``uses_links``) fetch the link groups. ``retire(op, tensor)`` gets each completed send's tensor."""
        self.abandoned_sends = [send for send in self.abandoned_sends if not send.work.is_completed()]
        if self.broken_links:
            raise PipeMeshRuntimeError(
                f"rank {self.rank()}: an earlier call of the PipeMesh schedule failed and left the pipeline links "
                f"{', '.join(sorted(set(self.broken_links)))} unusable (a timed-out gloo transfer closes its link; "
                "posted NCCL receives cannot be cancelled and would take later data). Restart the job (e.g. from the "
                "last checkpoint)")
        self._tag = next(self._calls) % TAG_LIMIT
        self._policy = policy_for(self.backend(pp_group), device)
        self._timeout, self._locate, self._retire = timeout, locate, retire
        self._links = (self._link_groups() or {}) if uses_links else {}

    def post_receive(self, op: Op, buffer: torch.Tensor, link: LinkKey, step: int) -> None:
        """Post the receive of ``op`` (a RECV_*) into ``buffer`` from ``link``'s source."""
        group = self._group(link, step, op)
        work = self._posted(lambda: self._irecv(buffer, link[1], group, self._tag), link, step, op,
                            f"posting the receive from pipeline rank {op.peer}")
        self._receives[op.compute] = Transfer(work, buffer, op, link, op.compute)

    def wait_receive(self, consumer: Op, step: int, what: str) -> Optional[torch.Tensor]:
        """The tensor received for ``consumer`` once it arrived (None when no receive was posted for it); ``what``
        names the transfer in errors ("receive of its input")."""
        transfer = self._receives.pop(consumer, None)
        if transfer is None:
            return None
        self._wait(transfer, step, consumer, what)
        return transfer.tensor

    def send(self, op: Op, tensor: torch.Tensor, link: LinkKey, step: int) -> None:
        """Send ``tensor`` for ``op`` (a SEND_*) to ``link``'s destination; ``tensor`` is kept until it is retired."""
        group = self._group(link, step, op)
        work = self._posted(lambda: self._isend(tensor.detach(), link[2], group, self._tag), link, step, op,
                            f"posting the send to pipeline rank {op.peer}")
        self._sends.append(Transfer(work, tensor, op, link, op.compute))

    def drain_sends(self, step: int, block: bool = False, only: Optional[Op] = None) -> None:
        """Retire completed sends, in issue order (all of them, waiting, when ``block``; only the send of compute op
        ``only``'s output, waiting for it, when given)."""
        keep = []
        for send in self._sends:
            mine = only is None or send.key == only
            if mine and (block or only is not None):
                self._wait(send, step, send.op, f"send to pipeline rank {send.op.peer}")
            if mine and (block or only is not None or send.work.is_completed()):
                self._retire(send.op, send.tensor)
            else:
                keep.append(send)
        self._sends = keep

    def end_call(self) -> None:
        """End a call whose program ran through: every posted receive must have been consumed."""
        if self._receives:
            raise PipeMeshRuntimeError(f"rank {self.rank()}: receives posted but never consumed: "
                                       f"{format_ops(self._receives)}")

    def abandon(self) -> None:
        """End a failed call: count its posted receives (under NCCL's policy they break their links) and keep its
        sends in flight alive until they complete (:attr:`abandoned_sends`; dropping a gloo send's work cancels it)."""
        if self._receives:
            self.abandoned_receives += len(self._receives)
            if self._policy.posted_receives_break_links:
                self.broken_links.extend(link_name(receive.link) for receive in self._receives.values())
        self.abandoned_sends.extend(self._sends)
        self._receives, self._sends = {}, []

    def continue_from(self, previous: "PipelineTransport") -> None:
        """Take over ``previous``'s call counter (tags) and failure state, when this transport's schedule replaces
        ``previous``'s mid-run (re-planning), so stale receives of its failed calls still cannot match."""
        self._calls, self.broken_links = previous._calls, previous.broken_links
        self.abandoned_receives, self.abandoned_sends = previous.abandoned_receives, previous.abandoned_sends

    # Helpers ----------------------------------------------------------------------------------
    def _group(self, link: LinkKey, step: int, op: Op):
        group = self._links.get(link)
        if group is None:  # never a fall-back to the shared pipeline group
            direction, src, dst = link
            raise PipeMeshRuntimeError(
                f"{self._locate(step, op)}: no process group for the pipeline link {direction} {src}->{dst} "
                f"({'activations' if direction == 'F' else 'gradients'} from global rank {src} to {dst}). "
                f"{self._missing_link_advice()}")
        return group

    def _posted(self, post: Callable[[], Any], link: LinkKey, step: int, op: Op, what: str):
        # gloo raises at the post itself when the peer's connection is already closed (a dead peer).
        try:
            return post()
        except Exception as error:
            self.broken_links.append(link_name(link))
            raise PipeMeshRuntimeError(f"{self._locate(step, op)}: {what} failed: {error}") from error

    def _wait(self, transfer: Transfer, step: int, op: Op, what: str) -> None:
        try:
            # gloo: a timed wait turns a dead peer into an error naming rank, step and op; NCCL: an untimed wait only
            # makes the current stream wait (a timed one would block the host until the transfer ends).
            completed = transfer.work.wait(self._timeout) if self._policy.timed_waits else transfer.work.wait()
        except Exception as error:  # the backend reports dead peers and timeouts as RuntimeError
            self.broken_links.append(link_name(transfer.link))
            raise PipeMeshRuntimeError(f"{self._locate(step, op)}: {what} failed: {error}") from error
        if completed is False:
            self.broken_links.append(link_name(transfer.link))
            raise PipeMeshRuntimeError(
                f"{self._locate(step, op)}: {what} timed out after {self._timeout.total_seconds():.0f} s")


class DistTransport(PipelineTransport):
    """torch.distributed: gloo (CPU; :data:`GLOO_POLICY`) or NCCL (CUDA; :data:`NCCL_POLICY`), every transfer on
    its link's own process group (one direction per communicator)."""

    def __init__(self, link_groups: Optional[LinkGroups] = None):
        super().__init__()
        self.link_groups = link_groups
        """Provider of the link groups; None: the schedule transfers nothing (pipeline size 1)."""

    def rank(self) -> int:
        return dist.get_rank()

    def group_ranks(self, group) -> List[int]:
        return dist.get_process_group_ranks(group)

    def backend(self, group) -> str:
        return dist.get_backend(group)

    def all_gather_object(self, obj) -> List[Any]:
        gathered: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, obj)
        return gathered

    def _link_groups(self) -> Optional[Mapping[LinkKey, Any]]:
        return self.link_groups() if self.link_groups is not None else None

    def _missing_link_advice(self) -> str:
        advice = ("PipeMesh sends each link's transfers on the link's own group; call megatron_pipemesh.install() "
                  "before Megatron's initialize_model_parallel (or megatron_pipemesh.integration.parallel_state."
                  "create_pipemesh_groups() on every rank after it)")
        if self.link_groups is None:
            advice += (". This schedule was given no provider of link groups: pass p2p_groups="
                       "megatron_pipemesh.integration.parallel_state.get_pipemesh_p2p_groups")
        return advice

    def _isend(self, tensor: torch.Tensor, dst: int, group, tag: int):
        return dist.isend(tensor, dst=dst, group=group, tag=tag)

    def _irecv(self, tensor: torch.Tensor, src: int, group, tag: int):
        return dist.irecv(tensor, src=src, group=group, tag=tag)
