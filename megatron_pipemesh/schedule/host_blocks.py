"""The pinned host blocks one rank's program holds at once: what the runtime's pool allocates before the first call.

Host placement copies each OFFLOADed chunk-micro-batch into one pinned block and gives the block back at its
RELOAD (``runtime/offload.py``); blocks are never freed, and a block serves any later key of its size. So the pool a
program needs is, per block size, the most keys of that size between their OFFLOAD and their RELOAD in program
order. Allocating those blocks at the schedule's start keeps every pinned allocation (a ``cudaHostAlloc``, and the
allocator's retries after a failure) out of the first iteration, where an OFFLOAD runs while posted NCCL receives
spin on the device.

Pure: no torch.
"""
from __future__ import annotations

from typing import Dict, Iterable, Mapping

from .ops import Op, OpKind


def pool_blocks(program: Iterable[Op], block_bytes: Mapping[int, int]) -> Dict[int, int]:
    """Block size -> blocks of that size ``program`` holds at most at once, with the key of chunk ``c`` in a block of
    ``block_bytes[c]`` bytes (chunks missing from ``block_bytes``: unknown size, not counted)."""
    held: Dict[int, int] = {}
    peak: Dict[int, int] = {}
    for op in program:
        size = block_bytes.get(op.chunk)
        if not size or op.kind not in (OpKind.OFFLOAD, OpKind.RELOAD):
            continue
        held[size] = held.get(size, 0) + (1 if op.kind is OpKind.OFFLOAD else -1)
        peak[size] = max(peak.get(size, 0), held[size])
    return {size: count for size, count in sorted(peak.items()) if count > 0}


def pool_bytes(blocks: Mapping[int, int]) -> int:
    """Pinned bytes of the blocks :func:`pool_blocks` counted."""
    return sum(size * count for size, count in blocks.items())
