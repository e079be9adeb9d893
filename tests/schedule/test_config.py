"""ScheduleConfig: presets, and validation errors that name the flag, the values and a valid example."""
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pipemesh.schedule import ScheduleConfig, ScheduleConfigError, check_groups, uniform_groups

EXAMPLE_MARK = "Example of a valid setting"


def megatron_groups(m: int, g: int):
    """Group sizes implied by Megatron's get_schedule_table: full groups of g, then the remainder."""
    return [g] * (m // g) + ([m % g] if m % g else [])


def config_from_example(error: ScheduleConfigError, pp: int, vpp: int, m: int) -> ScheduleConfig:
    """Build the ScheduleConfig the error message proposes (raises if the proposal is invalid)."""
    example = str(error).split(EXAMPLE_MARK + ": ", 1)[1]
    groups = re.fullmatch(r"--forward-groups ([\d ]+) --backward-groups ([\d ]+)", example)
    if groups:
        fwd, bwd = (tuple(int(x) for x in g.split()) for g in groups.groups())
        return ScheduleConfig(pp, vpp, m, fwd, bwd)
    single = re.fullmatch(r"--pipeline-model-parallel-size (\d+)", example)
    if single:
        return ScheduleConfig(int(single[1]), vpp, max(m, int(single[1])))
    single = re.fullmatch(r"--num-virtual-stages-per-pipeline-rank (\d+)", example)
    if single:
        return ScheduleConfig(pp, int(single[1]), m)
    single = re.fullmatch(r"(\d+) or more micro-batches", example)
    if single:
        return ScheduleConfig(pp, vpp, int(single[1]))
    single = re.fullmatch(r"--microbatch-group-size-per-virtual-pipeline-stage (\d+)", example)
    if single:
        return ScheduleConfig.uniform(pp, vpp, m, int(single[1]))
    raise AssertionError(f"unrecognised example in {error}")


# ---------------------------------------------------------------------------------------------
# Presets


def test_depth_first_is_groups_of_p():
    """depth_first = Megatron default: groups of p in both directions (and the default config)."""
    cfg = ScheduleConfig.depth_first(4, 2, 12)
    assert cfg.forward_groups == cfg.backward_groups == (4, 4, 4)
    assert ScheduleConfig(4, 2, 12) == cfg
    assert cfg.preset_name() == "depth-first"


def test_breadth_first_is_one_group():
    """breadth_first = one group of m in both directions."""
    cfg = ScheduleConfig.breadth_first(4, 2, 12)
    assert cfg.forward_groups == cfg.backward_groups == (12,)
    assert cfg.preset_name() == "breadth-first"


def test_backward_defaults_to_forward():
    """Omitting the backward groups reuses the forward groups."""
    cfg = ScheduleConfig(4, 2, 12, (8, 4))
    assert cfg.backward_groups == (8, 4)
    assert ScheduleConfig(4, 2, 12, (8, 4), (6, 6)).preset_name() is None


@pytest.mark.parametrize("pp,m,g,expected", [
    (4, 12, 4, (4, 4, 4)),
    (4, 12, 6, (6, 6)),
    (4, 12, 12, (12,)),
    (2, 7, 5, (5, 2)),        # remainder group of 2 >= p
    (3, 11, 4, (4, 4, 3)),    # remainder group of 3 >= p
    (2, 9, 3, (3, 3, 3)),
    (4, 13, 9, (9, 4)),
])
def test_uniform_matches_megatron_grouping(pp, m, g, expected):
    """uniform(g): groups of g, the last one takes the remainder (as get_schedule_table does)."""
    cfg = ScheduleConfig.uniform(pp, 2, m, g)
    assert cfg.forward_groups == cfg.backward_groups == expected
    assert list(expected) == megatron_groups(m, g)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 60), st.integers(1, 60))
def test_uniform_groups_any_size(m, g):
    """uniform_groups(m, g) == [g]*(m//g) + [m % g] for any g <= m."""
    g = min(g, m)
    assert uniform_groups(m, g) == megatron_groups(m, g)


@pytest.mark.parametrize("pp,m,g", [(4, 10, 4), (3, 10, 4), (2, 7, 3)])
def test_uniform_rejects_small_remainder(pp, m, g):
    """uniform(g) with 0 < m % g < p is rejected, like Megatron (dependency bubbles)."""
    with pytest.raises(ScheduleConfigError) as info:
        ScheduleConfig.uniform(pp, 2, m, g)
    assert EXAMPLE_MARK in str(info.value)
    config_from_example(info.value, pp, 2, m)


def test_describe_and_placement():
    """describe() quotes both flags; stage/place follow Megatron's interleaved layout."""
    cfg = ScheduleConfig(4, 2, 12, (8, 4), (6, 6))
    assert cfg.describe() == "p=4 V=2 m=12 --forward-groups 8 4 --backward-groups 6 6"
    assert cfg.num_stages == 8
    for rank in range(4):
        for chunk in range(2):
            assert cfg.stage(rank, chunk) == chunk * 4 + rank
            assert cfg.place(cfg.stage(rank, chunk)) == (rank, chunk)


# ---------------------------------------------------------------------------------------------
# Validation rules: each raises ScheduleConfigError naming flag + values + a valid example.

# (id, pp, vpp, m, forward, backward, flag named, values quoted)
INVALID = [
    ("pp<2", 1, 2, 8, (), (), "--pipeline-model-parallel-size", "1"),
    ("vpp<1", 4, 0, 8, (), (), "--num-virtual-stages-per-pipeline-rank", "0"),
    ("m<p", 4, 2, 3, (3,), (3,), "micro-batches", "3"),
    ("zero-group", 4, 2, 8, (0, 8), (4, 4), "--forward-groups", "0 8"),
    ("negative-group", 4, 2, 8, (4, 4), (-4, 12), "--backward-groups", "-4 12"),
    ("float-group", 4, 2, 8, (4.5, 3.5), (4, 4), "--forward-groups", "4.5 3.5"),
    ("string-group", 4, 2, 8, ("4", "4"), (4, 4), "--forward-groups", "4 4"),
    ("bool-group", 2, 2, 2, (True, True), (2,), "--forward-groups", "True True"),
    ("backward-sum", 4, 2, 8, (4, 4), (4,), "--backward-groups", "4"),
    ("forward-sum", 4, 2, 12, (8, 8), (6, 6), "--forward-groups", "8 8"),
    ("group<p-forward", 4, 2, 8, (2, 6), (4, 4), "--forward-groups", "2 6"),
    ("group<p-backward", 4, 2, 12, (8, 4), (6, 3, 3), "--backward-groups", "6 3 3"),
    ("group<p-trailing", 4, 2, 8, (6, 2), (4, 4), "--forward-groups", "6 2"),
    ("underflow", 4, 2, 12, (4, 4, 4), (4, 8), "--backward-groups", "4 8"),
    ("underflow-first", 2, 3, 8, (2, 6), (4, 4), "--backward-groups", "4 4"),
]


@pytest.mark.parametrize("name,pp,vpp,m,fwd,bwd,flag,values", INVALID, ids=[row[0] for row in INVALID])
def test_invalid_config_message(name, pp, vpp, m, fwd, bwd, flag, values):
    """The error names the flag and the values, and proposes a setting that is itself valid."""
    with pytest.raises(ScheduleConfigError) as info:
        ScheduleConfig(pp, vpp, m, fwd, bwd)
    message = str(info.value)
    assert flag in message
    assert values in message
    assert EXAMPLE_MARK in message
    assert "\n" not in message  # one paragraph
    assert isinstance(info.value, ValueError)
    config_from_example(info.value, pp, vpp, m)


def test_underflow_message_names_both_lists():
    """`4 4 4 / 4 8` (p=4, m=12): the message quotes both lists and the prefix sums."""
    with pytest.raises(ScheduleConfigError) as info:
        ScheduleConfig(4, 2, 12, (4, 4, 4), (4, 8))
    message = str(info.value)
    assert "--forward-groups 4 4 4 --backward-groups 4 8" in message
    assert "12" in message and "8" in message


def test_acceptance_case_sum_mismatch():
    """`--forward-groups 4 4 --backward-groups 4` with m=8, p=4 is a sum error on the backward flag."""
    with pytest.raises(ScheduleConfigError) as info:
        ScheduleConfig(4, 2, 8, (4, 4), (4,))
    assert info.value.flag == "--backward-groups"
    assert "sum" in info.value.rule
    assert str(info.value).startswith("--backward-groups 4 is invalid")


@pytest.mark.parametrize("group", [0, -1, 13])
def test_uniform_rejects_out_of_range_size(group):
    """uniform() with a size outside [1, m] names Megatron's group-size flag and the value."""
    with pytest.raises(ScheduleConfigError) as info:
        ScheduleConfig.uniform(4, 2, 12, group)
    message = str(info.value)
    assert "--microbatch-group-size-per-virtual-pipeline-stage" in message
    assert str(group) in message and EXAMPLE_MARK in message
    config_from_example(info.value, 4, 2, 12)


def test_uniform_example_is_valid_when_m_not_multiple_of_p():
    """uniform(p=4, m=10, g=0) must propose a group size that works for m=10."""
    with pytest.raises(ScheduleConfigError) as info:
        ScheduleConfig.uniform(4, 2, 10, 0)
    config_from_example(info.value, 4, 2, 10)


def test_group_smaller_than_p_via_uniform():
    """uniform(g < p) is rejected by the group >= p rule on the forward flag."""
    with pytest.raises(ScheduleConfigError) as info:
        ScheduleConfig.uniform(4, 2, 8, 2)
    assert info.value.flag == "--forward-groups"
    assert "smaller than the pipeline size p=4" in str(info.value)


# ---------------------------------------------------------------------------------------------
# check_groups against an independent oracle of the documented rules.


def oracle_valid(pp, m, fwd, bwd) -> bool:
    if pp < 2 or m < pp:
        return False
    for groups in (fwd, bwd):
        if not groups or sum(groups) != m or min(groups) < pp:
            return False
    f = b = 0
    for i in range(max(len(fwd), len(bwd))):
        f += fwd[i] if i < len(fwd) else 0
        b += bwd[i] if i < len(bwd) else 0
        if b > f:
            return False
    return True


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_check_groups_matches_rules(data):
    """check_groups accepts exactly the lists the documented rules accept; rejections carry a valid example."""
    pp = data.draw(st.integers(2, 5), label="pp")
    m = data.draw(st.integers(pp, 4 * pp), label="m")
    lists = st.lists(st.integers(1, m), min_size=1, max_size=5)
    fwd, bwd = data.draw(lists, label="fwd"), data.draw(lists, label="bwd")
    if oracle_valid(pp, m, fwd, bwd):
        check_groups(pp, 2, m, fwd, bwd)
    else:
        with pytest.raises(ScheduleConfigError) as info:
            check_groups(pp, 2, m, fwd, bwd)
        assert EXAMPLE_MARK in str(info.value)
        config_from_example(info.value, pp, 2, m)
