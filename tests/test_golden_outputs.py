"""The numbers and plan digests the user sees, pinned: ``pipemesh show`` / ``simulate`` / ``plan`` for the README's
examples, ``pipemesh plan --megatron-args`` for the README's GPT-1.3B command and the suite's tiny GPT, the study's
first four rows and the bench's predictions for its default and ``--quick`` runs.

A refactor that changes none of these keeps this test passing with the fixture untouched. A deliberate behaviour
change rewrites the fixture with ``PIPEMESH_WRITE_GOLDEN=1`` (the same command as the test; only the cases that ran
are rewritten) and its commit message says which numbers moved and why.

Text output is compared whole, except the search's wall/CPU seconds; JSON output and predictions are compared
number by number at a relative tolerance of 1e-9 (a refactor may reorder a sum; a cost changed by 1% fails).
Plan digests hash what the runtime runs: the lowered program (its options included) and every chunk-micro-batch's
placement level (:func:`run_plan_digest`).
"""
import hashlib
import json
import math
import os
import re
import shlex
from pathlib import Path

import pytest

from tests.cli.test_commands import run
from megatron_pipemesh.schedule import ScheduleConfig, lower
from megatron_pipemesh.schedule.plan import RunPlan

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "golden_outputs.json"
WRITE = os.environ.get("PIPEMESH_WRITE_GOLDEN") == "1"
"""PIPEMESH_WRITE_GOLDEN=1: record the outputs of the cases that run instead of comparing them."""
REL_TOL = 1e-9

# ---------------------------------------------------------------------------------------------
# The commands (README.md "The `pipemesh` command" and "What should I run?")

SCHEDULE = "--pp 4 --vpp 2 -m 12 --forward-groups 8 4 --backward-groups 6 6"
MODEL = "--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048"
SIMULATE = f"simulate {SCHEDULE} {MODEL} --dp 2 --dp-gbps 25 --p2p-gbps 25 --device-tflops 125"
PLAN = f"plan --pp 4 --vpp 2 -m 12 {MODEL} --dp 2 --device-memory-gb 12"

CLI_CASES = {
    "show": f"show {SCHEDULE}",
    "show_json": f"show {SCHEDULE} --json",
    "show_lowered": f"show {SCHEDULE} --lowered",
    "show_lowered_json": f"show {SCHEDULE} --lowered --json",
    "show_picture": f"show {SCHEDULE} --picture",
    "show_lowered_sharding": f"show {SCHEDULE} --lowered --sharding optim optim_grads_params",
    "simulate": SIMULATE,
    "simulate_json": SIMULATE + " --json",
    "simulate_placement": SIMULATE + " --memory-budget-gb 20 --activation-placement auto --host-memory-gb 48",
    "simulate_sharding": SIMULATE + " --sharding optim optim_grads_params",
    "simulate_direct_costs": f"simulate {SCHEDULE} --forward-ms 1 --dp-reduce-ms 20 --dp-gather-ms 20 --p2p-ms 0.01",
    "plan": PLAN,
    "plan_json": PLAN + " --json",
    "plan_placement": PLAN + " --activation-placement auto --host-memory-gb 48",
    "plan_placement_json": PLAN + " --activation-placement auto --host-memory-gb 48 --json",
    "plan_sharding_auto": PLAN + " --sharding auto",
}
"""name -> ``pipemesh`` argv; a name ending in ``_json`` prints JSON, compared number by number."""

PLAN_FILE_CASES = {
    "plan_file": PLAN,
    "plan_file_placement": PLAN + " --activation-placement auto --host-memory-gb 48",
    "plan_file_sharding_auto": PLAN + " --sharding auto",
}
"""name -> ``pipemesh plan`` argv whose ``--output`` plan file is pinned by its digest and prediction."""

GPT_13B_ADVICE = ("plan --nodes 16 --gpus-per-node 1 --nic-gbps 6.25 --gpu A10G --host-memory-gb 48 --quiet "
                  "--megatron-args '--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 "
                  "--max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 64 --bf16 "
                  "--use-distributed-optimizer --pipeline-model-parallel-size 4 --transformer-impl local --mock-data "
                  "--tokenizer-type NullTokenizer --vocab-size 50257 --train-iters 1000 --lr 1e-4'")
"""README "What should I run?": GPT-1.3B on 16 single-GPU A10G VMs (about 10 CPU-s of search)."""

# tests/cli/test_megatron_args.py's tiny GPT and cluster, at a given device rate: without --gpu / --device-tflops the costs
# are this machine's measured CPU matmul rate, which no fixture can pin.
TINY_ADVICE = ("plan --nodes 1 --gpus-per-node 4 --device-memory-gib 1 --nic-gbps 0.25 --device-tflops 0.05 --quiet "
               "--json --megatron-args '--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
               "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 8 --train-iters 3 --lr 1e-3 "
               "--min-lr 1e-4 --lr-decay-style cosine --eval-iters 0 --eval-interval 1000 --log-interval 1 "
               "--num-workers 0 --seed 1234 --mock-data --tokenizer-type NullTokenizer --vocab-size 257 "
               "--hidden-dropout 0 --attention-dropout 0 --pipeline-model-parallel-size 2 "
               "--num-virtual-stages-per-pipeline-rank 2'")

STUDY_ROWS = 4
"""The study's first rows (GPT-1.3B TP1 PP4 DP4 at 6.25 and 25 Gbit/s, Transformer Engine and local spec)."""
BENCH_CORES = 2
"""The bench scales each rank's device rate by cores / ranks when ranks outnumber cores: pinned at 2 cores."""


# ---------------------------------------------------------------------------------------------
# Helpers


def run_cli(argv):
    """``pipemesh`` in-process: its stdout, after checking it exited 0."""
    code, out, err = run(argv)
    assert code == 0, f"pipemesh {shlex.join(argv)} exited {code}: {err}"
    return out


def run_plan_digest(plan: RunPlan) -> str:
    """What the runtime runs for ``plan``: its lowered program (with Megatron's param and grad syncs; the digest
    covers the lowering options) and the placement level of every chunk-micro-batch that is not kept on the device.
    The only place this test reads a plan's attributes: a refactor that renames them changes this adapter, never
    the fixture."""
    lowered = plan.lower(param_sync=True, grad_sync=True).digest()
    levels = sorted([list(key), str(lever)] for key, lever in plan.placement.items())
    text = json.dumps({"lowered": lowered, "placement": levels}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def groups_digest(pp, vpp, microbatches, forward, backward) -> str:
    """The lowered digest of a schedule given by its groups (the advice's rows carry groups, not plan objects)."""
    return lower(ScheduleConfig(pp, vpp, microbatches, tuple(forward), tuple(backward))).digest()


def mask_search_time(text: str) -> str:
    """The advice's second line says how long the search took: wall and CPU seconds vary run to run."""
    return re.sub(r" in [0-9.]+ s \([0-9.]+ CPU-s\)", " in <s> s (<s> CPU-s)", text)


def flag_values(flags, name):
    """The values after ``name`` in a flag list, up to the next flag."""
    if name not in flags:
        return None
    rest = flags[flags.index(name) + 1:]
    values = []
    for item in rest:
        if item.startswith("--"):
            break
        values.append(int(item))
    return values


def differences(expected, actual, where="$"):
    """Where ``actual`` differs from ``expected``: floats at :data:`REL_TOL`, everything else exactly."""
    if isinstance(expected, float) or isinstance(actual, float):
        if isinstance(expected, (int, float)) and isinstance(actual, (int, float)) and not isinstance(expected, bool) \
                and not isinstance(actual, bool):
            if math.isclose(expected, actual, rel_tol=REL_TOL, abs_tol=1e-15) or (math.isnan(expected) and math.isnan(actual)):
                return []
        return [f"{where}: expected {expected!r}, got {actual!r}"]
    if isinstance(expected, dict) and isinstance(actual, dict):
        out = [f"{where}: keys {sorted(set(expected) ^ set(actual))} in only one of expected / actual"] \
            if set(expected) != set(actual) else []
        for key in sorted(set(expected) & set(actual), key=str):
            out += differences(expected[key], actual[key], f"{where}.{key}")
        return out
    if isinstance(expected, list) and isinstance(actual, list):
        if len(expected) != len(actual):
            return [f"{where}: {len(expected)} items expected, got {len(actual)}"]
        return [d for i, (e, a) in enumerate(zip(expected, actual)) for d in differences(e, a, f"{where}[{i}]")]
    if isinstance(expected, str) and isinstance(actual, str) and expected != actual:
        lines = [(i, e, a) for i, (e, a) in enumerate(zip(expected.splitlines(), actual.splitlines())) if e != a]
        first = (f"; first differing line {lines[0][0] + 1}:\n  expected {lines[0][1]!r}\n  got      {lines[0][2]!r}"
                 if lines else f" ({len(expected.splitlines())} lines expected, {len(actual.splitlines())} got)")
        return [f"{where}: text differs{first}"]
    return [] if expected == actual else [f"{where}: expected {expected!r}, got {actual!r}"]


@pytest.fixture(scope="module")
def golden():
    """The recorded outputs; with PIPEMESH_WRITE_GOLDEN=1, the cases that ran are written back at the end."""
    recorded = json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}
    if not WRITE:
        assert recorded, f"{FIXTURE} is missing: record it with PIPEMESH_WRITE_GOLDEN=1"
    fresh = {}
    yield recorded, fresh
    if WRITE and fresh:
        recorded.update(fresh)
        recorded["_about"] = ("pipemesh outputs pinned by tests/test_golden_outputs.py (first recorded at 87a515c). "
                              "Rewrite with PIPEMESH_WRITE_GOLDEN=1 only for a deliberate behaviour change.")
        FIXTURE.parent.mkdir(parents=True, exist_ok=True)
        FIXTURE.write_text(json.dumps(dict(sorted(recorded.items())), indent=1, sort_keys=True) + "\n")


def check(golden, name, actual):
    """Compare ``actual`` to the fixture's ``name`` (or record it)."""
    recorded, fresh = golden
    actual = json.loads(json.dumps(actual))  # the fixture's own types: tuples as lists, keys as strings
    if WRITE:
        fresh[name] = actual
        return
    assert name in recorded, f"{name} is not in {FIXTURE.name}: record it with PIPEMESH_WRITE_GOLDEN=1"
    found = differences(recorded[name], actual, name)
    assert not found, "\n".join(found[:20]) + (f"\n... {len(found) - 20} more" if len(found) > 20 else "")


# ---------------------------------------------------------------------------------------------
# show / simulate / plan


@pytest.mark.parametrize("name", sorted(CLI_CASES))
def test_cli_output(golden, name):
    """The whole stdout (text) or every value (``--json``) of a README example."""
    out = run_cli(shlex.split(CLI_CASES[name]))
    check(golden, name, json.loads(out) if name.endswith("_json") else out)


@pytest.mark.parametrize("name", sorted(PLAN_FILE_CASES))
def test_plan_file(golden, name, tmp_path):
    """The plan file ``pipemesh plan --output`` writes: the plan's digest and its prediction."""
    path = tmp_path / "plan.json"
    out = run_cli(shlex.split(PLAN_FILE_CASES[name]) + ["--output", str(path)])
    plan = RunPlan.from_dict(json.loads(path.read_text()))
    check(golden, name, {"digest": run_plan_digest(plan), "predicted": plan.predicted,
                         "stdout": out.replace(str(path), "<PLAN>")})


# ---------------------------------------------------------------------------------------------
# pipemesh plan --megatron-args


def advice_rows(data):
    """Each row of ``--json`` advice with the digest of its PipeMesh groups (stock rows: None)."""
    rows = {}
    for name, row in data["rows"].items():
        if row is None:
            rows[name] = None
            continue
        forward = flag_values(row["flags"], "--forward-groups")
        backward = flag_values(row["flags"], "--backward-groups")
        digest = (groups_digest(row["pp"], row["vpp"], row["microbatches"], forward, backward)
                  if forward else None)
        rows[name] = {**row, "groups_digest": digest}
    return rows


def test_advice_readme_gpt_1_3b(golden):
    """README "What should I run?": the table, the rows' flags and the command to run, as printed."""
    check(golden, "advice_readme_gpt_1_3b", mask_search_time(run_cli(shlex.split(GPT_13B_ADVICE))))


def test_advice_tiny_json(golden):
    """The suite's tiny GPT command: every row's flags, predicted time, tokens/s, peaks and group digest."""
    data = json.loads(run_cli(shlex.split(TINY_ADVICE)))
    kept = {k: v for k, v in data.items() if k not in ("rows", "search_s", "search_cpu_s")}  # seconds vary
    check(golden, "advice_tiny_json", {**kept, "rows": advice_rows(data)})


# ---------------------------------------------------------------------------------------------
# The study and the bench


def test_study_first_rows(golden):
    """The study's first rows: every number of :func:`run_row` but its CPU seconds, and the digest of the plan the
    row reports (PipeMesh's best over V, recompute-only or with host placement, whichever is faster, as run_row
    chooses)."""
    from megatron_pipemesh.planning.costs import GB
    from megatron_pipemesh.planning.memory import MEMORY_MARGIN
    from megatron_pipemesh.study.rows import row_specs
    from megatron_pipemesh.study.study import COMMODITY, pipemesh_auto, run_row

    rows = []
    for row in COMMODITY[:STUDY_ROWS]:
        out = {k: v for k, v in run_row(row).items() if k not in ("row_cpu_s", "advice_cpu_s")}
        model, cluster = row_specs(row)
        budget = row.memory_gb * GB * (1 - MEMORY_MARGIN)
        alone = pipemesh_auto(model, cluster, row.pp, row.microbatches, budget)
        placed = pipemesh_auto(model, cluster, row.pp, row.microbatches, budget, alone.result.iteration_s, "auto")
        plan = placed if placed is not None and placed.result.iteration_s < alone.result.iteration_s else alone
        assert plan.result.iteration_s == out["pipemesh_auto"]["iteration_s"]  # the plan the row reports
        rows.append({**out, "plan_digest": run_plan_digest(plan.run_plan()),
                     "plan_iteration_s": plan.result.iteration_s})
    check(golden, "study_first_rows", rows)


@pytest.mark.parametrize("flags", [[], ["--quick"]], ids=["default", "quick"])
def test_bench_predictions(golden, flags, tmp_path):
    """The bench's rows for its default and ``--quick`` runs as planned before anything runs: each row's setting,
    predicted iteration time, peaks and fit, and the digest of each PipeMesh row's plan file."""
    from megatron_pipemesh.bench.cli import build_parser, build_specs, resolve

    setup = resolve(build_parser().parse_args(["bench"] + flags))
    gbps = setup["shaping"].payload_bytes_per_s * 8 / 1e9  # as cmd_bench: the shaped rate's payload
    configs = {}
    for config in setup["configs"]:
        budget, specs = build_specs(setup, config, gbps, str(tmp_path), BENCH_CORES)
        rows = []
        for spec in specs:
            digest = (run_plan_digest(RunPlan.from_dict(json.loads(Path(spec.plan_path).read_text())))
                      if spec.plan_path else None)
            rows.append({"name": spec.name, "describe": spec.describe(), "stock_flags": list(spec.stock_flags),
                         "predicted_iteration_s": spec.predicted_iteration_s,
                         "predicted_peak_bytes": spec.predicted_peak_bytes, "predicted_fits": spec.predicted_fits,
                         "default": spec.default, "plan_digest": digest})
        configs[config.name] = {"budget_bytes": budget, "rows": rows}
    check(golden, "bench_" + ("quick" if flags else "default"), configs)
