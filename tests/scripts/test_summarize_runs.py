"""scripts/summarize_runs.py: parsing Megatron's iteration logs and the comparison table."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from .helpers import REPO

DATA = REPO / "tests" / "scripts" / "data"
_spec = importlib.util.spec_from_file_location("summarize_runs", REPO / "scripts" / "summarize_runs.py")
sr = importlib.util.module_from_spec(_spec)
sys.modules["summarize_runs"] = sr
_spec.loader.exec_module(sr)


def line(it, ms, loss=5.0, gbs=64, prefix="", total=30):
    return (f"{prefix} [2026-01-01 00:00:00.000000] iteration {it:8d}/{total:8d} | consumed samples: {it * gbs:12d} | "
            f"elapsed time per iteration (ms): {ms:.1f} | learning rate: 1.0E-04 | global batch size: {gbs:5d} | "
            f"lm loss: {loss:E} | loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 | "
            f"number of nan iterations:   0 |\n")


ARGS_DUMP = ("------------------------ arguments ------------------------\n"
             "  decoder_seq_length .............................. None\n"
             "  encoder_seq_length .............................. 2048\n"
             "  global_batch_size ............................... 64\n"
             "  seq_length ...................................... 2048\n"
             "-------------------- end of arguments ---------------------\n")


def write_run(dir_, times, prefix="", loss0=6.0, with_args=True, gbs=64):
    """A torchrun-like run directory: rank 0 holds the argument dump, the last rank the iteration lines."""
    r0 = dir_ / "torchrun" / "x_1" / "attempt_0" / "0"
    r1 = dir_ / "torchrun" / "x_1" / "attempt_0" / "1"
    r0.mkdir(parents=True)
    r1.mkdir(parents=True)
    (r0 / "stdout.log").write_text((ARGS_DUMP if with_args else "") + "rank 0 says hello\n")
    (r1 / "stdout.log").write_text("".join(line(i + 1, t, loss0 - 0.1 * i, gbs, prefix)
                                           for i, t in enumerate(times)))
    return dir_


def test_parse_real_megatron_log():
    """A last-rank stdout.log of a real CPU run (tiny-cpu.env, 3 iterations)."""
    with open(DATA / "megatron_last_rank_stdout.log") as fh:
        its, args = sr.parse_lines(fh)
    assert [i.iteration for i in its] == [1, 2, 3]
    assert [i.ms for i in its] == [435.3, 360.5, 248.3]
    assert its[-1].loss == pytest.approx(5.525561) and its[-1].global_batch_size == 16
    assert args == {}  # the argument dump is printed by rank 0, not this rank


def test_parse_prefixed_lines_and_args():
    """Rank prefixes parse, repeated iterations keep the last line, only two arguments are taken from the dump."""
    text = ARGS_DUMP.replace("  ", "[default0]:  ") + line(1, 10.0, prefix="[default3]:") + line(1, 12.0)
    its, args = sr.parse_lines(text.splitlines())
    assert len(its) == 1 and its[0].ms == 12.0  # the repeated iteration: last one wins
    assert args == {"seq_length": 2048, "global_batch_size": 64}  # not decoder_/encoder_seq_length


def test_median_after_warmup_tokens_and_ratio(tmp_path):
    """Medians after the warm-up, tokens/s, ratios to the best stock run, the final loss and the table row are right."""
    a = write_run(tmp_path / "depth-first", [900, 500, 100, 200, 300, 1000])
    b = write_run(tmp_path / "pipemesh", [900, 500, 100, 100, 150, 200], prefix="[default7]:")
    c = write_run(tmp_path / "1f1b", [900, 900, 400, 400, 400, 400])
    runs = [sr.read_run("1f1b", str(c)), sr.read_run("depth-first", str(a)), sr.read_run("pipemesh", str(b))]
    s = {x.name: x for x in sr.summarize(runs, warmup=2)}
    assert s["depth-first"].measured == 4 and s["depth-first"].median_ms == 250.0
    assert s["pipemesh"].median_ms == 125.0 and s["1f1b"].median_ms == 400.0
    assert s["depth-first"].tokens_per_s == pytest.approx(64 * 2048 / 0.25)
    assert s["depth-first"].stock and s["1f1b"].stock and not s["pipemesh"].stock
    assert s["depth-first"].ratio_to_best_stock == pytest.approx(1.0)
    assert s["pipemesh"].ratio_to_best_stock == pytest.approx(2.0)
    assert s["1f1b"].ratio_to_best_stock == pytest.approx(250 / 400)
    assert s["pipemesh"].final_loss == pytest.approx(5.5)
    table = sr.format_table(list(s.values()), 2)
    assert "| pipemesh | 4 | 125.0 | 1,048,576 | 2.000x | 5.5000 | ok |" in table
    assert "| depth-first (stock) |" in table


def test_file_with_most_iterations_wins(tmp_path):
    """Of a run's files the one with the most iteration lines is used; the sequence length may come from another."""
    d = write_run(tmp_path / "r", [100, 100, 100, 100])
    (d / "logs").mkdir()
    (d / "logs" / "1-node0.out").write_text(line(1, 5.0))  # a partial copy must not be used
    run = sr.read_run("r", str(d))
    assert len(run.iterations) == 4 and run.source.endswith("1/stdout.log")
    assert run.seq_length == 2048


def test_failures_are_rows_not_crashes(tmp_path):
    """Short, empty and missing runs become failed rows that say why."""
    ok = write_run(tmp_path / "ok", [5, 5, 5, 5])
    short = write_run(tmp_path / "short", [5, 5])
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "stdout.log").write_text("CUDA out of memory\n")
    runs = [sr.read_run(n, str(p)) for n, p in
            [("ok", ok), ("short", short), ("empty", empty), ("gone", tmp_path / "nope")]]
    s = {x.name: x for x in sr.summarize(runs, warmup=2)}
    assert s["ok"].status == "ok"
    assert "warm-up" in s["short"].status
    assert "no iteration lines" in s["empty"].status
    assert "does not exist" in s["gone"].status


def test_without_sequence_length_compares_times(tmp_path):
    """Without a sequence length runs are compared by iteration time; --seq-length enables tokens/s."""
    a = write_run(tmp_path / "a", [1, 1, 200, 200], with_args=False)
    b = write_run(tmp_path / "pipemesh", [1, 1, 100, 100], with_args=False)
    s = sr.summarize([sr.read_run("a", str(a)), sr.read_run("pipemesh", str(b))], warmup=2)
    assert s[0].tokens_per_s is None and s[1].ratio_to_best_stock == pytest.approx(2.0)
    s = sr.summarize([sr.read_run("a", str(a)), sr.read_run("pipemesh", str(b))], warmup=2, seq_length=1024)
    assert s[1].tokens_per_s == pytest.approx(64 * 1024 / 0.1)


def test_cli(tmp_path):
    """The script writes the table and JSON, exits 1 when a run failed and 2 on a bad argument."""
    a = write_run(tmp_path / "a", [9, 9, 2, 2, 2])
    b = write_run(tmp_path / "b", [9, 9, 1, 1, 1])
    script = str(REPO / "scripts" / "summarize_runs.py")
    res = subprocess.run([sys.executable, script, "--warmup", "2", "--stock", "a", "b",
                          "--output", str(tmp_path / "t.md"), "--json", str(tmp_path / "t.json"),
                          f"a={a}", f"b={b}"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "t.md").read_text() == res.stdout
    data = json.loads((tmp_path / "t.json").read_text())
    assert [r["name"] for r in data["runs"]] == ["a", "b"] and data["runs"][1]["ratio_to_best_stock"] == 1.0
    res = subprocess.run([sys.executable, script, f"a={a}", f"x={tmp_path / 'nope'}"], capture_output=True, text=True)
    assert res.returncode == 1 and "failed" in res.stdout
    res = subprocess.run([sys.executable, script, "justapath"], capture_output=True, text=True)
    assert res.returncode == 2 and "NAME=PATH" in res.stderr


def test_runs_on_a_bare_python(tmp_path):
    """The script (and the log parser it shares with `pipemesh bench`) needs only the standard library:
    it runs with site-packages off (-S) and PYTHONPATH ignored (-I), from another directory."""
    a = write_run(tmp_path / "a", [9, 9, 2, 2, 2])
    res = subprocess.run([sys.executable, "-I", "-S", str(REPO / "scripts" / "summarize_runs.py"), f"a={a}"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "| a (stock) | 3 | 2.0 |" in res.stdout


def test_uses_the_package_log_parser():
    """One Megatron log parser: the script's iteration lines come from megatron_pipemesh.bench.logparse."""
    from megatron_pipemesh.bench import logparse

    assert sr.logparse.parse_iteration_line.__code__.co_filename == logparse.parse_iteration_line.__code__.co_filename
    assert not hasattr(sr, "ITERATION_RE") and not hasattr(sr, "TIME_RE")
