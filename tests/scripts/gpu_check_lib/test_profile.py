"""gpu_check_lib/profile.py: the profile of the small GPT measures every piece; its kept bytes read from the allocator
(faked on CPU) meet the saved-tensor meter's, and a reading that lets the previous call's tensors free inside its
window does not. The check passing, with the same facts: tests/scripts/test_gpu_check.py."""
from __future__ import annotations

import textwrap

from .child import printed, run_child

_KEPT = """
    import json
    from gpu_check_lib import common, profile
    from megatron_pipemesh.integration import profile_kept
    from tests.integration.test_profile_kept import FakeCudaAllocator
    device = common.setup(cpu_only=True)
    fake = FakeCudaAllocator()
    profile_kept.allocated_bytes = fake.memory_allocated
    with fake.mode:
        rows = profile.kept_against_meter(device)
    print("rows", json.dumps({"tolerance": profile.KEPT_TOLERANCE, "rows": rows}))
"""


def test_kept_bytes_from_the_allocator_meet_the_meters_within_the_tolerance():
    """The allocator's counters faked on CPU: every piece at every micro-batch size within 10% of the meter."""
    found = printed(run_child(_KEPT, timeout=300), "rows")
    rows = found["rows"]
    assert {row["micro_batch_size"] for row in rows} == {1, 2} and len(rows) >= 2 * 5 and found["tolerance"] == 0.10
    assert all(abs(row["ratio"] - 1) <= found["tolerance"] for row in rows), rows


def test_a_reading_that_frees_the_previous_calls_tensors_inside_its_window_is_caught():
    """With the previous call's input and its gradient left to be freed inside the next forward (a piece that
    releases nothing), the allocator reads low and the comparison is out of tolerance."""
    found = printed(run_child(textwrap.dedent("""
        from megatron_pipemesh.integration import profile_kept
        kept = profile_kept.kept_bytes
        def no_release(name, piece, grad_of, exclude):
            return kept(name, profile_kept.Piece(piece.forward), grad_of, exclude)
        profile_kept.kept_bytes = no_release
        from megatron_pipemesh.integration import profile_pieces
        profile_pieces.kept_bytes = no_release
    """) + textwrap.dedent(_KEPT), timeout=300), "rows")
    assert any(abs(row["ratio"] - 1) > found["tolerance"] for row in found["rows"] if row["piece"].startswith("layer"))
