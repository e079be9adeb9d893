"""`planning/advice_error.py`: each row's interval and the row the advice runs."""
import json
from types import SimpleNamespace

import pytest

from megatron_pipemesh.planning.advice_error import (ERRORS_FILE, KINDS, ErrorTable, choose, error_file, gain_errors,
                                                     load_errors, row_kind, worst_errors)
from megatron_pipemesh.planning.advice_rows import ParallelLayout

PP2, PP1 = ParallelLayout(tp=1, pp=2, dp=1), ParallelLayout(tp=1, pp=1, dp=2)
ERRORS = ErrorTable({"user": 0.02, "same layout": 0.03, "changed V": 0.08, "changed micro-batch size": 0.10,
                     "changed layout": 0.15})


def row(name, seconds, layout=PP2, vpp=1, mbs=None, fits=True):
    return SimpleNamespace(name=name, iteration_s=seconds, layout=layout, vpp=vpp, micro_batch_size=mbs, fits=fits)


def test_the_kind_is_the_largest_change_to_the_command():
    user = row("user", 1.0)
    assert row_kind(user, user) == "user"
    assert row_kind(row("best_stock", 1.0), user) == "same layout"
    assert row_kind(row("best_stock", 1.0, vpp=2), user) == "changed V"
    assert row_kind(row("best_layout", 1.0, vpp=2, mbs=1), user) == "changed micro-batch size"
    assert row_kind(row("best_layout_stock", 1.0, layout=PP1, mbs=1), user) == "changed layout"


def test_a_gain_beyond_its_error_changes_the_command():
    """No gain errors measured: a row's gain error is its time error plus the command's. 0.7 s +17% (at most 0.819 s)
    stays below the user's 1.0 s: the layout row runs; its printed interval is its time error alone."""
    choice = choose([row("user", 1.0), row("best_layout_stock", 0.7, layout=PP1)], ERRORS)
    assert choice.run == "best_layout_stock" and not choice.kept
    assert choice.reason == ("predicted 43% faster than your command, beyond the advice's error (±17% for a row of "
                             "kind 'changed layout' against your command)")
    assert choice.intervals["best_layout_stock"].to_dict() == {"kind": "changed layout", "error": 0.15,
                                                               "interval_s": [pytest.approx(0.595),
                                                                              pytest.approx(0.805)],
                                                               "gain_error": pytest.approx(0.17)}


def test_a_gain_inside_the_error_keeps_the_command_and_says_by_how_much():
    """0.9 s +12% reaches 1.008 s, above the user's 1.0 s: keep the command, naming the gain and the error."""
    choice = choose([row("user", 1.0), row("best_layout", 0.9, vpp=2, mbs=1)], ERRORS)
    assert choice.run == "user" and choice.kept
    assert choice.reason == ("keep your command: the best row (best_layout) is predicted 11% faster, inside the "
                             "advice's error of ±12% (±12% for a row of kind 'changed micro-batch size' against your "
                             "command)")


def test_the_measured_gain_error_decides_not_the_sum_of_the_time_errors():
    """Both predictions 8-10% off in the same direction (the same profile, the same machine) cancel in their ratio:
    with a measured gain error of 4% the 11%-faster row runs, where the time errors (10% + 2%) would keep the
    command."""
    errors = ErrorTable(dict(ERRORS.by_kind), "", {"changed micro-batch size": 0.04})
    choice = choose([row("user", 1.0), row("best_layout", 0.9, vpp=2, mbs=1)], errors)
    assert choice.run == "best_layout" and not choice.kept
    assert "(±4% for a row of kind 'changed micro-batch size' against your command)" in choice.reason
    assert choice.intervals["best_layout"].error == 0.10 and choice.intervals["user"].gain_error == 0.0
    assert errors.gain_of("changed layout") == 0.04  # unmeasured: the largest measured of the kinds before it


def test_the_profiles_spread_widens_every_interval_until_the_gain_is_inside_it():
    """The same rows as the first case: with a 20% spread in the profile the layout row's gain is inside the error."""
    rows = [row("user", 1.0), row("best_layout_stock", 0.7, layout=PP1)]
    assert choose(rows, ERRORS, spread=0.0).run == "best_layout_stock"
    wide = choose(rows, ERRORS, spread=0.2)
    assert wide.run == "user" and wide.kept and wide.intervals["user"].error == pytest.approx((0.02**2 + 0.2**2) ** 0.5)
    assert wide.intervals["user"].gain_error == pytest.approx(0.2)
    assert "±20% for the profile's spread on your command" in wide.reason


def test_among_rows_within_the_fastest_rows_error_the_least_change_runs():
    """The layout row is fastest (0.70 s, up to 0.805 s); the V row's 0.74 s -8% (0.68 s) overlaps it and changes
    less: the V row runs, and the reason names the fastest."""
    rows = [row("user", 1.0), row("best_stock", 0.74, vpp=2), row("best_layout_stock", 0.70, layout=PP1)]
    choice = choose(rows, ERRORS)
    assert choice.run == "best_stock"
    assert "the fastest row (best_layout_stock, 0.700 s) is within the error of this one, which changes less " \
           "(changed V)" in choice.reason


def test_a_command_that_does_not_fit_is_changed_and_rows_that_do_not_fit_never_run():
    rows = [row("user", 1.0, fits=False), row("best_stock", 0.99), row("best_layout", 0.5, fits=False)]
    choice = choose(rows, ERRORS)
    assert choice.run == "best_stock" and choice.reason.startswith("your command does not fit the memory")
    assert choose([row("user", 1.0, fits=False)], ERRORS).run is None


def test_a_kind_without_a_measurement_takes_the_largest_error_of_the_kinds_that_change_more():
    table = ErrorTable({"user": 0.01, "changed V": 0.05, "changed micro-batch size": 0.06})
    assert table.of("same layout") == 0.06 and table.of("changed V") == 0.05
    assert table.of("changed layout") == 0.06  # nothing changes more: the largest measured


def test_the_ledgers_table_is_the_worst_error_per_kind_and_loads_back(tmp_path):
    by_kind = worst_errors([("user", 0.97), ("changed V", 1.12), ("changed V", 0.95), ("user", 1.01)])
    assert by_kind == {"user": pytest.approx(0.03), "changed V": pytest.approx(0.12)}
    # A row 12% over beside a command 10% over: its speed over the command was 1.8% under-predicted.
    gains = gain_errors([("user", 1.10, 1.10), ("changed V", 1.12, 1.10), ("changed V", 0.95, 1.01)])
    assert gains == {"changed V": pytest.approx(1 - 0.95 / 1.01)}
    path = tmp_path / "errors.json"
    path.write_text(error_file(by_kind, "ledger of today", gains))
    assert load_errors(str(path)) == ErrorTable(by_kind, "ledger of today", gains)
    path.write_text(json.dumps({"by_kind": {"changed PP": 0.1}}))
    with pytest.raises(ValueError, match="unknown kinds of row"):
        load_errors(str(path))
    path.write_text(json.dumps({"by_kind": {"user": 0.1}, "gain_by_kind": {"changed PP": 0.1}}))
    with pytest.raises(ValueError, match=r"unknown kinds of row \['changed PP'\]"):
        load_errors(str(path))
    with pytest.raises(ValueError, match="scripts/advice_accuracy.sh --write-errors writes it"):
        load_errors(str(tmp_path / "missing.json"))


def test_the_shipped_table_loads_and_names_its_source():
    table = load_errors(ERRORS_FILE)
    assert set(table.by_kind) <= set(KINDS) and table.source and all(0 <= e < 1 for e in table.by_kind.values())
    assert table.gain_by_kind and "user" not in table.gain_by_kind


def test_a_row_that_clears_the_command_runs_though_a_row_that_changes_less_does_not_clear_it():
    """The ledger's first command: the V row (1.560 s +-6%) reaches the command's 1.686 s -4%, the micro-batch row
    (1.467 s +-7%, the fastest) does not: the micro-batch row runs (it measured 1.24x, the V row 1.10x)."""
    errors = ErrorTable({"user": 0.04, "changed V": 0.06, "changed micro-batch size": 0.07})
    rows = [row("user", 1.686), row("best_stock", 1.560, vpp=2), row("best_layout", 1.467, vpp=2, mbs=1)]
    choice = choose(rows, errors)
    assert choice.run == "best_layout" and not choice.kept
