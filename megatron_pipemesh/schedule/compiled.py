"""The engine's form of a lowered schedule (:mod:`.timeline`): per rank, one instruction tuple per op, with transfer
keys and channels interned as small ints, compiled once per (config, lowering options) and memoized.
"""
from __future__ import annotations

import operator
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from .config import ScheduleConfig
from .lower import LoweredSchedule, LoweringOptions, input_source, output_target
from .ops import Op, OpKind

# Instruction codes of the compiled programs (small ints: the inner loop dispatches on them).
COMPUTE_OP, RECV_OP, SEND_OP, DP_OP, HOST_OP, RELEASE_OP = range(6)


@dataclass
class Compiled:
    """A lowered schedule in the engine's form: per rank, one tuple per op whose transfer keys and
    channels are small ints (interned once per schedule, not hashed as ``(rank, Op)`` per step)."""

    config: ScheduleConfig
    ops: Tuple[Tuple[Op, ...], ...]
    """The programs compiled (identity-checked on reuse: a caller may edit a schedule's programs)."""
    code: List[List[tuple]]
    keys: int
    """Number of transfer keys (consumer rank, direction, chunk, micro-batch)."""
    channels: List[Tuple[int, int, str]]
    """Channel id -> (src, dst, direction 'F' / 'B')."""


_COMPILED: "OrderedDict[Tuple[ScheduleConfig, LoweringOptions], Compiled]" = OrderedDict()
_COMPILED_MAX = 256
_COMPILED_LOCK = threading.Lock()
"""Least-recently-used compiled schedules (the same bound as the lowering's memo)."""


def compile_schedule(schedule: LoweredSchedule) -> Compiled:
    """Each op of each rank program as a tuple the engine reads without recomputing placement:

    * compute: (code, op, input key id or -1, waits for a parameter gather, is forward, host key,
      waits for its ZeRO-3 span's GATHER, waits for its ZeRO-2/3 chunk's last REDUCE);
    * receive: (code, key id, channel id, held: the next compute op waits for it); send: (code, key id, channel
      id, producer compute op);
    * data-parallel and GATHER / REDUCE: (code, op, is PARAM_SYNC, is GATHER, is REDUCE); RELEASE: (code, op);
    * host copy: (code, op, is OFFLOAD, host key).

    Memoized per (config, options) while the programs hold the very same op objects (every
    :func:`~.lower.lower` of one (config, options) shares them)."""
    memo_key = (schedule.config, schedule.options)
    with _COMPILED_LOCK:  # rank threads (the GPU check) validate plans concurrently
        cached = _COMPILED.get(memo_key)
        if cached is not None:
            _COMPILED.move_to_end(memo_key)
    if cached is not None and len(cached.ops) == len(schedule.programs) and all(
            len(old) == len(new) and all(map(operator.is_, old, new)) for old, new in zip(cached.ops, schedule.programs)):
        return cached
    cfg = schedule.config
    key_ids: Dict[tuple, int] = {}
    channel_ids: Dict[Tuple[int, int, str], int] = {}
    code: List[List[tuple]] = []
    for rank, program in enumerate(schedule.programs):
        # (direction, chunk) -> (input source, output target), from the lowering's own placement rules.
        peers: Dict[Tuple[str, int], Tuple[Optional[Tuple[int, int]], Optional[Tuple[int, int]]]] = {}
        for op in program:
            if (op.kind._value_[-1], op.chunk) not in peers:
                for direction, kind in (("F", OpKind.FORWARD), ("B", OpKind.BACKWARD)):
                    probe = Op(kind, op.chunk, 0)
                    peers[direction, op.chunk] = (input_source(cfg, rank, probe), output_target(cfg, rank, probe))
        param_chunks = {op.chunk for op in program if op.kind is OpKind.PARAM_SYNC}
        zero3 = set() if schedule.options.forward_only else set(schedule.options.zero3_chunks)
        zero2 = set() if schedule.options.forward_only else set(schedule.options.zero2_chunks)
        producers: Dict[Tuple[str, int, Optional[int]], Op] = {}
        warmup = _warmup_forwards(program) if schedule.options.megatron_p2p else 0
        computed = 0
        out = []
        append = out.append
        for op in program:
            kind, chunk, microbatch = op.kind._value_, op.chunk, op.microbatch
            if kind == "F" or kind == "B":
                key = -1
                if peers[kind, chunk][0] is not None:
                    name = (rank, kind, chunk, microbatch) if op.peer is None else (rank, kind, chunk, microbatch, op.peer)
                    key = key_ids.setdefault(name, len(key_ids))
                forward = kind == "F"
                # A ZeRO-3 chunk waits for the GATHER of its span instead of a PARAM_SYNC; a backward of a
                # ZeRO-2/3 chunk for the reduction of the chunk's previous backward group (its REDUCE).
                append((COMPUTE_OP, op, key, forward and chunk in param_chunks and chunk not in zero3, forward,
                        (rank, chunk, microbatch), chunk in zero3, not forward and chunk in zero2))
                computed += 1
                if op.peer is None:
                    producers[kind, chunk, microbatch] = op
            elif kind == "RECV_F" or kind == "RECV_B":
                direction = kind[-1]
                source = peers[direction, chunk][0]
                key = key_ids.setdefault((rank, direction, chunk, microbatch), len(key_ids))
                append((RECV_OP, key, channel_ids.setdefault((source[0], rank, direction), len(channel_ids)),
                        1 <= computed <= warmup))
            elif kind == "SEND_F" or kind == "SEND_B":
                direction = kind[-1]
                target = peers[direction, chunk][1]
                assert target is not None
                key = key_ids.setdefault((target[0], direction, target[1], microbatch), len(key_ids))
                channel = channel_ids.setdefault((rank, target[0], direction), len(channel_ids))
                append((SEND_OP, key, channel, producers.get((direction, chunk, microbatch)) or op.compute))
            elif op.kind is OpKind.RELEASE:
                append((RELEASE_OP, op))
            elif op.kind.is_dp or op.kind.is_shard:
                append((DP_OP, op, op.kind is OpKind.PARAM_SYNC, op.kind is OpKind.GATHER, op.kind is OpKind.REDUCE))
            else:
                append((HOST_OP, op, op.kind is OpKind.OFFLOAD, (rank, chunk, microbatch)))
        code.append(out)
    compiled = Compiled(cfg, tuple(tuple(program) for program in schedule.programs), code, len(key_ids),
                         [channel for channel, _ in sorted(channel_ids.items(), key=lambda item: item[1])])
    with _COMPILED_LOCK:
        _COMPILED[memo_key] = compiled
        _COMPILED.move_to_end(memo_key)
        while len(_COMPILED) > _COMPILED_MAX:
            _COMPILED.popitem(last=False)
    return compiled


def _warmup_forwards(program) -> int:
    """Megatron's warm-up forwards of a rank: the forwards before its first backward but the last of them (the
    first of the steady 1F1B phase); all of them without a backward (evaluation)."""
    leading = 0
    for op in program:
        if op.kind is OpKind.BACKWARD:
            return max(0, leading - 1)
        if op.kind is OpKind.FORWARD:
            leading += 1
    return leading

