"""Planning layer: the text timeline picture (``pipemesh show --picture``)."""
import pytest

from megatron_pipemesh.planning.ascii import render_ascii
from megatron_pipemesh.schedule import ScheduleConfig, lower
from megatron_pipemesh.schedule.timeline import execute


@pytest.mark.parametrize("config", [
    ScheduleConfig(2, 2, 12, (8, 4), (6, 6)),
    ScheduleConfig(4, 2, 12, (8, 4), (6, 6)),
    ScheduleConfig(2, 3, 104, (100, 4), (52, 52)),
    ScheduleConfig(2, 2, 4, (2, 2), (2, 2)),
])
def test_picture_columns_align_for_any_m(config):
    """Every op name starts at its own column (start time x cell width) and is separated from the next by
    blanks, so two-digit micro-batch indices (``F0.10``) never run into the next op."""
    timeline = execute(lower(config))
    picture = render_ascii(timeline).splitlines()
    assert len(picture) == config.pp
    for rank, row in enumerate(picture):
        prefix = f"rank {rank} | "
        assert row.startswith(prefix)
        body = row[len(prefix):]
        tokens = [(i, t) for i, t in enumerate(body) if t != " " and (i == 0 or body[i - 1] == " ")]
        words = body.split()
        ops = [w for w in words if w != "."]
        assert ops == [str(e.op) for e in timeline.compute[rank]]
        starts = [i for (i, _), w in zip(tokens, words) if w != "."]
        cell = starts[1] // round(timeline.compute[rank][1].start) if len(starts) > 1 else None
        for event, column in zip(timeline.compute[rank], starts):
            assert column == round(event.start) * cell, (rank, str(event.op))
        assert cell > max(len(op) for op in ops)
