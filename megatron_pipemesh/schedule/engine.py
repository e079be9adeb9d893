"""The timeline's engine (:mod:`.timeline`, whose docstring gives the rules it runs): one function with local state
runs the compiled programs (:mod:`.compiled`) in time order, a heap of compute ends and fixed-length transfers beside
the shared network's own ends.
"""
from __future__ import annotations

import heapq
from collections import deque
from typing import Deque, Dict, List, Optional, Tuple

from .compiled import COMPUTE_OP, DP_OP, RECV_OP, RELEASE_OP, SEND_OP, compile_schedule
from .events import (CommEvent, ComputeEvent, Costs, DeadlineExceeded, DeadlockError, FinalCollective, Links,
                     Timeline)
from .lower import SEND_WAITS, LoweredSchedule, input_source
from .ops import Op, OpKind, format_ops

# heap event kinds: a rank's compute op ended; a transfer without shared links ended; a rank's compute on shared
# cores starts (its input arrives then)
_RESUME, _END, _CORE = 0, 1, 2
_INF = float("inf")


def _shy(tail: float, deadline: float) -> float:
    """A little less than ``tail`` (by a billionth of it), or 0 where that little is lost in ``deadline``'s last bits:
    what may come off the deadline so that a clock past the cut certainly ends past the deadline, after rounding."""
    return tail * (1 - 1e-9) if tail > 1e-6 * abs(deadline) else 0.0


class Engine:
    def __init__(self, schedule: LoweredSchedule, costs: Costs, deadline: float = _INF,
                 tails: Optional[List[float]] = None):
        self.s, self.costs, self.cfg = schedule, costs, schedule.config
        self.deadline = deadline
        p = self.cfg.pp
        self.tails = list(tails) if tails is not None else [0.0] * p
        if len(self.tails) != p:
            raise ValueError(f"tails needs one value per pipeline rank ({p}), got {len(self.tails)}")
        self.compiled = compile_schedule(schedule)
        self.index = [0] * p
        self.arrival: List[Optional[Tuple[float, float]]] = [None] * self.compiled.keys  # (arrival, send time)
        host_copy = getattr(costs, "host_copy", None)
        self.host_copy = host_copy if callable(host_copy) else (lambda rank, op: 0.0)
        self.copies_on_compute = bool(getattr(costs, "host_copies_on_compute", False))
        links = getattr(costs, "links", None)
        self.links: Optional[Links] = links() if callable(links) else None
        compute_route = getattr(self.links, "compute_route", None)
        cores = [compute_route(rank) for rank in range(p)] if callable(compute_route) else []
        self.cores: Optional[List[object]] = cores if any(route is not None for route in cores) else None
        """Per rank: the route of its compute on shared cores (or None); None when no rank shares cores."""
        finals = getattr(costs, "final_collectives", None)
        self.finals: Tuple[FinalCollective, ...] = tuple(finals()) if callable(finals) and not schedule.options.forward_only else ()
        self.timeline = Timeline(schedule, [[] for _ in range(p)], [], [0.0] * p)

    def run(self) -> Timeline:
        """The semantics of the module docstring, in time order.

        Each rank runs its instructions at its stream's free time until a compute op, which either starts
        (the rank resumes at its end) or waits for a transfer, gather, reduction or reload (the rank resumes when it
        ends). Transfers run on FIFO channels; on shared links (``costs.links()``) their pace follows the
        network, otherwise each takes its own duration. Written as one function with local state (it is the
        simulator's inner loop)."""
        compiled, costs, timeline, cfg = self.compiled, self.costs, self.timeline, self.cfg
        p = cfg.pp
        compute_cost, transfer_cost, dp_cost, host_cost = costs.compute, costs.transfer, costs.data_parallel, self.host_copy
        code, channels = compiled.code, compiled.channels
        index, arrival = self.index, self.arrival
        rank_end, comms, compute_events = timeline.rank_end, timeline.comms, timeline.compute
        free = [0.0] * p
        blocked = [False] * p
        posted: List[Optional[float]] = [None] * compiled.keys
        queues: List[Deque[Tuple[int, float, Op]]] = [deque() for _ in channels]
        in_flight: List[Optional[tuple]] = [None] * len(channels)
        dp_queue: List[Deque[tuple]] = [deque() for _ in range(p)]
        dp_flight: List[Optional[tuple]] = [None] * p
        host_queue = {"d2h": [deque() for _ in range(p)], "h2d": [deque() for _ in range(p)]}
        host_flight: Dict[str, List[Optional[tuple]]] = {"d2h": [None] * p, "h2d": [None] * p}
        param_ready: List[Dict[int, Optional[float]]] = [
            {op.chunk: None for op, is_param in ((ins[1], ins[2]) for ins in program if ins[0] == DP_OP) if is_param}
            for program in code]
        # ZeRO-3 chunk -> end of its open GATHER (None while released or gathering)
        gathered: List[Dict[int, Optional[float]]] = [{c: None for c in self.s.options.zero3_chunks} for _ in range(p)]
        # ZeRO-2/3 chunk -> end of its last REDUCE (None while it runs; absent before the first)
        reduced: List[Dict[int, Optional[float]]] = [{} for _ in range(p)]
        offloaded: Dict[Tuple[int, int, int], Optional[float]] = {}  # None: the copy is running
        reloaded: Dict[Tuple[int, int, int], Optional[float]] = {}
        links = self.links
        copies_on_compute = self.copies_on_compute
        send_wait = self.s.options.send_wait
        sends_hold = send_wait in SEND_WAITS[1:]  # "posted" / "delivered": Megatron's schedules
        holds: List[List[Tuple[int, bool]]] = [[] for _ in range(p)]  # per rank: (key, is a receive) its next compute waits for
        send_waiters: Dict[int, int] = {}  # send key -> the rank blocked on it
        behind_data = self.s.options.notices_behind_data
        # channel -> the channels from its receiver back to its sender (a ready notice queues behind their transfer)
        reverse = [[c for c, (s2, d2, _) in enumerate(channels) if s2 == dst and d2 == src] for src, dst, _ in channels]
        notices: List[List[Tuple[int, int]]] = [[] for _ in channels]  # channel -> (key, its channel) notices behind it
        notice_left: Dict[int, int] = {}  # key -> transfers its notice still waits behind
        self.holds = holds
        net = links.new_network() if links is not None else None
        p2p_routes = [links.p2p_route(src, dst) if links is not None else None for src, dst, _ in channels]
        dp_routes = [links.dp_route(r) if links is not None else None for r in range(p)]
        host_routes = {lane: [links.host_route(r, lane == "d2h") if links is not None else None for r in range(p)]
                       for lane in ("d2h", "h2d")}
        finals, final_left, final_started = self.finals, [len(f.transfers) for f in self.finals], [False] * len(self.finals)
        cores = self.cores
        # Per rank on shared cores: (one-core seconds, the ComputeEvent or the host copy's (op, offload, host key,
        # start)) of the op its core runs or is about to run.
        core_job: List[Optional[tuple]] = [None] * p
        heap: List[tuple] = []
        seq = [0]
        clock = [0.0]
        deadline = self.deadline
        # With a deadline, per rank and instruction: the compute seconds of its compute ops from there on (one core
        # each); a rank's ops run one after another, so its end is at least an op's start plus that, and the
        # iteration at least that plus the rank's tail.
        left: Optional[List[List[float]]] = None
        slack = 1e-9 * abs(deadline)  # sums in another order may round past a schedule ending exactly then
        cuts = [deadline + slack - _shy(tail, deadline) for tail in self.tails]
        # An event at time t is no later than some rank's end (what it delivers is computed on afterwards), so the
        # iteration ends at t plus the least tail or later.
        least_tail = _shy(min(self.tails), deadline) if self.tails else 0.0
        clock_cut = deadline - least_tail
        if deadline < _INF:
            left = []
            for rank, program in enumerate(code):
                suffix, total = [0.0] * (len(program) + 1), 0.0
                for i in range(len(program) - 1, -1, -1):
                    if program[i][0] == COMPUTE_OP:
                        total += compute_cost(rank, program[i][1])
                    suffix[i] = total
                left.append(suffix)

        def launch(token: tuple, seconds: float, route) -> None:
            """Start a transfer now: on the shared network when it has a route, else for its own duration."""
            if net is not None and route is not None and seconds > 0.0:
                net.start(token, route, seconds)
            else:
                seq[0] += 1
                heapq.heappush(heap, (clock[0] + seconds, seq[0], _END, token))

        def start_channel(channel: int) -> None:
            queue = queues[channel]
            if in_flight[channel] is not None or not queue or posted[queue[0][0]] is None:
                return
            key, sent, producer = queue.popleft()
            src, dst, _ = channels[channel]
            busy, latency = transfer_cost(src, dst, producer)
            in_flight[channel] = (key, sent, producer, clock[0], latency)
            launch(("p2p", channel), busy, p2p_routes[channel])

        def start_dp(rank: int) -> None:
            if dp_flight[rank] is not None or not dp_queue[rank]:
                return
            op, is_param, is_gather, is_reduce = dp_queue[rank].popleft()
            dp_flight[rank] = (op, is_param, is_gather, is_reduce, clock[0])
            launch(("dp", rank), dp_cost(rank, op), dp_routes[rank])

        def start_host(lane: str, rank: int) -> None:
            queue = host_queue[lane][rank]
            if host_flight[lane][rank] is not None or not queue:
                return
            op, offload, host_key = queue[0]
            if not offload and offloaded.get(host_key, 0.0) is None:
                return  # a reload starts once its offload has ended
            queue.popleft()
            host_flight[lane][rank] = (op, offload, host_key, clock[0])
            launch((lane, rank), host_cost(rank, op), host_routes[lane][rank])

        def run_on_core(rank: int) -> None:
            """Start the rank's core job now: a flow of its one-core seconds on its share of the cores."""
            route = cores[rank]
            launch(("core", rank), core_job[rank][0] / route.lone_bytes_per_s, route)

        def wake(rank: int) -> None:
            if blocked[rank]:
                blocked[rank] = False
                step(rank)

        def wake_sender(key: int) -> None:
            """The send ``key`` a blocked rank waits for is done: it resumes at the current time (an event, not a
            nested step: this runs inside the receiver's step)."""
            rank = send_waiters.pop(key, None)
            if rank is not None and blocked[rank]:
                blocked[rank] = False
                seq[0] += 1
                heapq.heappush(heap, (clock[0], seq[0], _RESUME, rank))

        def try_finals() -> None:
            for k, final in enumerate(finals):
                if final_started[k] or not all(index[r] == len(code[r]) and dp_flight[r] is None and not dp_queue[r]
                                               for r in final.ranks):
                    continue
                final_started[k] = True
                for j, (src, dst, seconds, _) in enumerate(final.transfers):
                    launch(("final", k, j, clock[0]), seconds, links.embedding_route(src, dst) if links is not None else None)

        def ended(token: tuple) -> None:
            """A transfer ended now: record it, release what waited on it, start the next on its channel."""
            now = clock[0]
            kind = token[0]
            if kind == "p2p":
                channel = token[1]
                key, sent, producer, start, latency = in_flight[channel]
                in_flight[channel] = None
                src, dst, _ = channels[channel]
                if notices[channel]:
                    deliver_notices(channel)
                arrival[key] = (now + latency, sent)
                comms.append(CommEvent(src, dst, producer, start, now + latency, "p2p"))
                if send_waiters:
                    wake_sender(key)  # a sender waiting for delivery, or a receiver for its warm-up receive
                wake(dst)
                start_channel(channel)
            elif kind == "dp":
                rank = token[1]
                op, is_param, is_gather, is_reduce, start = dp_flight[rank]
                dp_flight[rank] = None
                comms.append(CommEvent(rank, rank, op, start, now, "dp"))
                if is_param:
                    param_ready[rank][op.chunk] = now
                elif is_gather:
                    gathered[rank][op.chunk] = now
                elif is_reduce:
                    reduced[rank][op.chunk] = now
                if now > rank_end[rank]:
                    rank_end[rank] = now
                wake(rank)
                start_dp(rank)
                if finals:
                    try_finals()
            elif kind == "final":
                k, j, start = token[1], token[2], token[3]
                final = finals[k]
                src, dst, _, chunk = final.transfers[j]
                comms.append(CommEvent(src, dst, Op(OpKind.GRAD_SYNC, chunk), start, now + final.latency_s, "embedding"))
                final_left[k] -= 1
                if final_left[k] == 0:
                    for r in final.ranks:
                        rank_end[r] = max(rank_end[r], now + final.latency_s)
            elif kind == "core":  # the rank's compute op or host copy on shared cores ended; the rank steps on
                rank = token[1]
                job = core_job[rank][1]
                core_job[rank] = None
                if job.__class__ is ComputeEvent:
                    job.end = now
                else:
                    op, offload, host_key, start = job
                    (offloaded if offload else reloaded)[host_key] = now
                    comms.append(CommEvent(rank, rank, op, start, now, "d2h" if offload else "h2d"))
                if now > rank_end[rank]:
                    rank_end[rank] = now
                free[rank] = now
                step(rank)
            else:
                lane, rank = kind, token[1]
                op, offload, host_key, start = host_flight[lane][rank]
                host_flight[lane][rank] = None
                (offloaded if offload else reloaded)[host_key] = now
                comms.append(CommEvent(rank, rank, op, start, now, lane))
                if offload:
                    start_host("h2d", rank)
                else:
                    wake(rank)
                start_host(lane, rank)

        def post(key: int, channel: int, at: float) -> None:
            """The receive ``key`` is posted as its sender sees it, at ``at``: its transfer may start."""
            posted[key] = at
            if send_waiters and send_wait == "posted":
                wake_sender(key)
            start_channel(channel)

        def deliver_notices(channel: int) -> None:
            """The transfer on ``channel`` left: the ready notices queued behind it reach their senders."""
            waiting, notices[channel] = notices[channel], []
            for key, its_channel in waiting:
                notice_left[key] -= 1
                if notice_left[key] == 0:
                    del notice_left[key]
                    post(key, its_channel, clock[0])

        def hold(rank: int, resume_at: int, end: float) -> None:
            """The rank's stream is busy until ``end``; it resumes there at instruction ``resume_at``."""
            if end > rank_end[rank]:
                rank_end[rank] = end
            index[rank], free[rank] = resume_at, end
            seq[0] += 1
            heapq.heappush(heap, (end, seq[0], _RESUME, rank))

        def step(rank: int) -> None:
            """Run ``rank``'s instructions from its stream's free time until a compute op starts or waits."""
            program = code[rank]
            i, n, now = index[rank], len(program), free[rank]
            events = compute_events[rank]
            while i < n:
                ins = program[i]
                what = ins[0]
                if what == COMPUTE_OP:
                    _, op, key, waits_param, forward, host_key, waits_gather, waits_reduce = ins
                    data_ready, waited_on, comm_part = 0.0, "", 0.0
                    if key >= 0:
                        got = arrival[key]
                        if got is None:
                            blocked[rank] = True
                            break
                        data_ready, waited_on = got[0], "p2p"
                        sent = got[1]
                        comm_part = got[0] - (now if now > sent else sent)
                        if not comm_part > 0.0:
                            comm_part = 0.0
                    if waits_param or waits_gather:
                        ready = (gathered if waits_gather else param_ready)[rank][op.chunk]
                        if ready is None:
                            blocked[rank] = True
                            break
                        if ready > data_ready:
                            data_ready, waited_on = ready, "param"
                            comm_part = ready - now
                    back = None
                    if not forward and host_key in reloaded:
                        back = reloaded[host_key]
                        if back is None:
                            blocked[rank] = True
                            break
                    if back is not None and back > max(data_ready, now):
                        data_ready, waited_on = back, "host"
                        comm_part = back - now
                    if holds[rank]:  # Megatron waits on the sends it issued since its previous compute op
                        done = None
                        for sent_key, received in holds[rank]:
                            if send_wait == "posted" and not received:
                                done = posted[sent_key]
                            else:
                                got = arrival[sent_key]
                                done = None if got is None else got[0]
                            if done is None:
                                send_waiters[sent_key] = rank
                                break
                            if done > max(data_ready, now):
                                data_ready, waited_on = done, "p2p"
                                comm_part = done - now
                        if done is None:
                            blocked[rank] = True
                            break
                        holds[rank].clear()
                    if waits_reduce:
                        reduce_end = reduced[rank].get(op.chunk, 0.0)
                        if reduce_end is None:
                            blocked[rank] = True
                            break
                        if reduce_end > max(data_ready, now):
                            data_ready, waited_on = reduce_end, "reduce"
                            comm_part = reduce_end - now
                    start = data_ready if data_ready > now else now
                    if left is not None and start + left[rank][i] > cuts[rank]:
                        raise DeadlineExceeded(deadline, start + left[rank][i] + self.tails[rank])
                    if 0.0 > comm_part:
                        comm_part = 0.0
                    if start - now < comm_part:
                        comm_part = start - now
                    if cores is not None and cores[rank] is not None:
                        # On shared cores: a flow from its start; the event's end is set when the flow ends.
                        event = ComputeEvent(rank, op, start, start, now, data_ready, waited_on, comm_part)
                        events.append(event)
                        core_job[rank] = (compute_cost(rank, op), event)
                        index[rank] = i + 1
                        if start > now:
                            seq[0] += 1
                            heapq.heappush(heap, (start, seq[0], _CORE, rank))
                        else:
                            run_on_core(rank)
                        return
                    end = start + compute_cost(rank, op)
                    events.append(ComputeEvent(rank, op, start, end, now, data_ready, waited_on, comm_part))
                    hold(rank, i + 1, end)
                    return
                if what == RECV_OP:
                    if ins[3]:
                        holds[rank].append((ins[1], True))
                    ahead = [c for c in reverse[ins[2]] if in_flight[c] is not None] if behind_data else ()
                    if ahead:  # the ready notice leaves behind this rank's transfers to the sender
                        notice_left[ins[1]] = len(ahead)
                        for c in ahead:
                            notices[c].append((ins[1], ins[2]))
                    else:
                        post(ins[1], ins[2], now)
                elif what == SEND_OP:
                    queues[ins[2]].append((ins[1], now, ins[3]))
                    if sends_hold:
                        holds[rank].append((ins[1], False))
                    start_channel(ins[2])
                elif what == DP_OP:
                    if ins[4]:
                        reduced[rank][ins[1].chunk] = None
                    dp_queue[rank].append((ins[1], ins[2], ins[3], ins[4]))
                    start_dp(rank)
                elif what == RELEASE_OP:
                    op = ins[1]
                    gathered[rank][op.chunk] = None
                    comms.append(CommEvent(rank, rank, op, now, now, "release"))
                else:
                    _, op, offload, host_key = ins
                    lane = "d2h" if offload else "h2d"
                    if copies_on_compute:  # the copy holds the stream; the rank resumes at its end
                        if cores is not None and cores[rank] is not None:  # a memcpy on the rank's thread: a core
                            core_job[rank] = (host_cost(rank, op), (op, offload, host_key, now))
                            index[rank] = i + 1
                            run_on_core(rank)
                            return
                        end = now + host_cost(rank, op)
                        (offloaded if offload else reloaded)[host_key] = end
                        comms.append(CommEvent(rank, rank, op, now, end, lane))
                        hold(rank, i + 1, end)
                        return
                    (offloaded if offload else reloaded)[host_key] = None
                    host_queue[lane][rank].append((op, offload, host_key))
                    start_host(lane, rank)
                i += 1
            index[rank], free[rank] = i, now
            if i == n and finals:
                try_finals()

        for rank in range(p):
            step(rank)
        while True:
            t_net = net.next_time() if net is not None else _INF
            t_heap = heap[0][0] if heap else _INF
            if t_net <= t_heap:
                if t_net == _INF:
                    break
                if t_net > clock_cut:
                    raise DeadlineExceeded(deadline, t_net + least_tail)
                clock[0], done = net.pop()
                for token in done:
                    ended(token)
                continue
            when, _, kind, payload = heapq.heappop(heap)
            if when > clock_cut:
                raise DeadlineExceeded(deadline, when + least_tail)
            clock[0] = when
            if net is not None:
                net.now = when  # no flow ends before it (t_net > when): advance()'s check, without its second look
            if kind == _RESUME:
                step(payload)
            elif kind == _END:
                ended(payload)
            else:
                run_on_core(payload)
        stuck = [r for r in range(p) if index[r] < len(code[r])]
        if stuck:
            self.param_ready = param_ready
            raise DeadlockError(self._deadlock_message(stuck))
        return timeline

    def _deadlock_message(self, stuck: List[int]) -> str:
        lines = [f"schedule deadlocks ({self.cfg.describe()}): no rank can make progress."]
        for rank in stuck:
            step = self.index[rank]
            op = self.s.programs[rank][step]
            source = input_source(self.cfg, rank, op)
            key = self.compiled.code[rank][step][2]
            if source and self.arrival[key] is None:
                why = f"waits for its input from rank {source[0]}"
            elif self.holds[rank]:
                why = f"waits for its sends to be received (send_wait {self.s.options.send_wait}) before it starts"
            else:
                why = f"waits for the parameter gather of chunk {op.chunk}"
            lines.append(f"rank {rank}, step {step}: {op} {why}")
        for rank, program in enumerate(self.s.programs):
            mark = self.index[rank] if rank in stuck else None
            lines.append(f"rank {rank}: {format_ops(program, mark)}")
        return "\n".join(lines)

