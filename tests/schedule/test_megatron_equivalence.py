"""Groups of p (and uniform groups of g) reproduce megatron-core's interleaved 1F1B op order exactly.

Megatron's order is rebuilt from megatron-core's own ``get_schedule_table`` and
``get_pp_rank_microbatches`` (imported, not re-typed): forward k = table[k] -> F{chunk}.{mb},
backward k = B{V-1-chunk}.{mb}; warm-up forwards, then (F, B) pairs, then the remaining backwards
(``forward_backward_pipelining_with_interleaving``).
"""
import contextlib
import importlib.util
import io
import json
import sys
import types
import warnings

import pytest

from megatron_pipemesh.command import main as cli_main
from megatron_pipemesh.schedule import ScheduleConfig, compute_program


def _prepare_megatron_import() -> None:
    """Use the package's bootstrap if present; otherwise stub only the triton-backed paged_stash module."""
    try:
        from megatron_pipemesh.integration.bootstrap import prepare_megatron_import
    except ImportError:
        name = "megatron.core.transformer.moe.ops.paged_stash"
        if importlib.util.find_spec("triton") is None and name not in sys.modules:
            stub = types.ModuleType(name)
            stub.GLOBAL_BLOCK_SIZE = 1024  # the value in megatron-core 0.19.2's paged_stash.py
            stub.paged_stash_copy_kernel = None
            stub.paged_stash_pop_kernel = None
            sys.modules[name] = stub
    else:
        prepare_megatron_import()


if importlib.util.find_spec("megatron") is None:  # megatron-core is optional for the package itself
    pytest.skip("megatron-core is not installed", allow_module_level=True)
_prepare_megatron_import()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.pipeline_parallel import schedules
get_schedule_table = schedules.get_schedule_table
get_pp_rank_microbatches = schedules.get_pp_rank_microbatches


class _FakeGroup:
    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


class _FakeP2P:
    """What get_pp_rank_microbatches reads from a P2PCommunicator."""

    def __init__(self, pp: int, rank: int, vpp: int):
        self.pp_group = _FakeGroup(pp, rank)
        self.virtual_pipeline_model_parallel_size = vpp


def megatron_order(pp: int, vpp: int, m: int, group: int, rank: int):
    """Per-rank op order of megatron-core's interleaved schedule, as text."""
    total, _, warmup, remaining = get_pp_rank_microbatches(
        m, vpp, group, forward_only=False, p2p_communicator=_FakeP2P(pp, rank, vpp))
    table = get_schedule_table(m, vpp, group)
    assert len(table) == total == m * vpp
    forwards = [f"F{chunk}.{mb}" for mb, chunk in table]
    backwards = [f"B{vpp - 1 - chunk}.{mb}" for mb, chunk in table]
    order = forwards[:warmup]
    for k in range(remaining):
        order += [forwards[warmup + k], backwards[k]]
    return order + backwards[remaining:]


def megatron_accepts(pp: int, m: int, group: int) -> bool:
    """forward_backward_pipelining_with_interleaving's checks on microbatch_group_size_per_vp_stage."""
    return pp <= group <= m and not (0 < m % group < pp)


GRID = [(pp, vpp, m, g)
        for pp in range(2, 6) for vpp in range(2, 5) for m in range(pp, 3 * pp + 3)
        for g in range(pp, m + 1) if megatron_accepts(pp, m, g)]


DEPTH_FIRST = [c for c in GRID if c[3] == c[0] and c[2] % c[0] == 0]


def _ids(cases):
    return ["p{}-V{}-m{}-g{}".format(*case) for case in cases]


@pytest.mark.parametrize("pp,vpp,m,g", DEPTH_FIRST, ids=_ids(DEPTH_FIRST))
def test_depth_first_equals_megatron(pp, vpp, m, g):
    """ScheduleConfig.depth_first (groups of p) == Megatron's default interleaved schedule, every rank."""
    cfg = ScheduleConfig.depth_first(pp, vpp, m)
    for rank in range(pp):
        assert [str(op) for op in compute_program(cfg, rank)] == megatron_order(pp, vpp, m, pp, rank), f"rank {rank}"


@pytest.mark.parametrize("pp,vpp,m,g", GRID, ids=_ids(GRID))
def test_uniform_equals_megatron(pp, vpp, m, g):
    """ScheduleConfig.uniform(g) == Megatron with microbatch_group_size_per_vp_stage = g, every rank."""
    cfg = ScheduleConfig.uniform(pp, vpp, m, g)
    # Group sizes agree with the table Megatron builds (each run of chunk-0 entries is one group).
    chunks = [chunk for _, chunk in get_schedule_table(m, vpp, g)]
    runs = [k for k in range(len(chunks)) if chunks[k] == 0 and (k == 0 or chunks[k - 1] != 0)]
    assert list(cfg.forward_groups) == [chunks[k:].index(1) for k in runs]
    for rank in range(pp):
        assert [str(op) for op in compute_program(cfg, rank)] == megatron_order(pp, vpp, m, g, rank), f"rank {rank}"


def test_grid_is_not_trivial():
    """The grid includes remainder groups and multi-group uniform sizes, not only groups of p."""
    assert len(GRID) > 200
    assert any(m % g for _, _, m, g in GRID)
    assert any(g != pp and g != m for pp, _, m, g in GRID)


def test_acceptance_cli_show_json_matches_megatron():
    """`pipemesh show --json` for p=4, V=2, m=8, 4 4 / 4 4 prints Megatron's order for every rank."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main(["show", "--pp", "4", "--vpp", "2", "--microbatches", "8",
                         "--forward-groups", "4", "4", "--backward-groups", "4", "4", "--json"])
    assert code == 0
    ranks = json.loads(out.getvalue())["ranks"]
    assert ranks == [megatron_order(4, 2, 8, 4, rank) for rank in range(4)]
