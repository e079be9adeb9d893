"""planning/planner_options.py: the planner's options refuse bad values by name, and the structured search the
advice and the study share."""
import pytest

from megatron_pipemesh.planning.planner_options import PlannerOptions, structured_options
from megatron_pipemesh.schedule.levers import PLACEMENT_MODES, RECOMPUTE_ONLY


def test_bad_options_are_named():
    assert PlannerOptions().activation_placement == RECOMPUTE_ONLY == PLACEMENT_MODES[0]
    with pytest.raises(ValueError, match="activation placement 'host': use one of recompute-only, auto, device"):
        PlannerOptions(activation_placement="host")
    with pytest.raises(ValueError, match="reload_lookahead 0 must be an integer >= 1"):
        PlannerOptions(reload_lookahead=0)
    with pytest.raises(ValueError, match="host memory budget must be >= 0"):
        PlannerOptions(host_budget_bytes=-1.0)


def test_structured_options_try_the_multiples_of_p_and_m():
    options = structured_options(4, 10, "auto", 2e9, fit_limit=3)
    assert options.first_forward_candidates == options.last_backward_candidates == (4, 8, 10)
    assert (options.activation_placement, options.host_budget_bytes, options.fit_limit) == ("auto", 2e9, 3)
    assert structured_options(2, 4).activation_placement == RECOMPUTE_ONLY
