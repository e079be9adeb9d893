"""``pipemesh bench --network-check``: real flows on the per-rank network against the product's network model.

For each rate the per-rank network is built (:mod:`.netns`, the NIC queue of ``--nic-queue``), three gloo ranks
run the scenarios of :func:`.flow_scenarios.check_scenarios` inside their namespaces (:mod:`.flow_probe`), and
each measure is compared with what :mod:`megatron_pipemesh.planning.network` (the simulator's max-min fair
sharing of every rank's egress and ingress) predicts for the same transfers at the NIC's payload rate
(:attr:`.netns.Shaping.payload_bytes_per_s`). Nothing is fitted: no latency, no overhead, no rate correction.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

from ..planning.network import (Flow, collective_with_flows_finish_times, fair_share_finish_times,
                                ring_allreduce_flows)
from ..cli.common import emit_json
from .flow_probe import parse_runs
from .flow_scenarios import ALL_REDUCE, MIB, SENDS, Scenario, check_scenarios


@dataclass(frozen=True)
class NetworkCheckSettings:
    """What the network check measures."""

    rates_mbit: Tuple[float, ...] = (100.0, 400.0)
    """NIC rates (Mbit/s each way per rank): around the bench's --quick rate (250 Mbit/s)."""
    sizes_bytes: Tuple[int, ...] = (8 * MIB, 32 * MIB)
    """Transfer sizes: one chunk's fp32 gradients of the --quick GPT (about 7 MB) and a whole rank's; large against
    the 256 KiB token-bucket burst, which a lone flow's first bytes pass at once (3% of 8 MiB)."""
    pipeline_fraction: float = 0.25
    """Each pipeline send next to the ring all-reduce moves this fraction of the all-reduce's size."""
    warmup: int = 1
    """Runs of every scenario before the measured ones (connections opened, windows grown)."""
    repeats: int = 3
    """Measured runs of every scenario (round-robin); each case reports their median."""
    tolerance: float = 0.10
    """Largest relative difference between prediction and measurement that passes."""
    timeout_s: float = 180.0
    """Seconds one rate's worker run may take (every transfer wait inside it uses it too)."""

    @property
    def world(self) -> int:
        return max(s.world for s in self.scenarios())

    def scenarios(self) -> List[Scenario]:
        return check_scenarios(self.sizes_bytes, self.pipeline_fraction)


def predict_s(scenario: Scenario, bytes_per_s: float) -> Dict[str, float]:
    """Seconds of each measure of ``scenario`` when every rank's egress and ingress carry ``bytes_per_s``, shared
    max-min fairly (:mod:`megatron_pipemesh.planning.network`; the ring all-reduce as its 2(d-1) steps)."""
    ranks = range(scenario.world)
    egress = ingress = {r: bytes_per_s for r in ranks}
    flows = [Flow(s.src, s.dst, s.nbytes) for s in scenario.sends]
    out: Dict[str, float] = {}
    if scenario.all_reduce is not None:
        steps = ring_allreduce_flows(scenario.all_reduce.ranks, scenario.all_reduce.nbytes)
        out[ALL_REDUCE], ends = collective_with_flows_finish_times(steps, flows, egress, ingress)
    else:
        ends = fair_share_finish_times(flows, egress, ingress)
    if flows:
        out[SENDS] = max(ends)
    return out


def build_cases(runs: Sequence[dict], scenarios: Sequence[Scenario], rate_mbit: float, bytes_per_s: float,
                tolerance: float) -> List[dict]:
    """One case per (scenario, measure) at one rate: the median of its runs next to the model's prediction."""
    cases = []
    for scenario in scenarios:
        mine = [r["seconds"] for r in runs if r["scenario"] == scenario.name]
        predicted = predict_s(scenario, bytes_per_s)
        ops = sorted({k for seconds in mine for k in seconds if k not in scenario.measures})
        for measure in scenario.measures:
            values = [seconds[measure] for seconds in mine if measure in seconds]
            measured = statistics.median(values) if values else None
            error = (predicted[measure] - measured) / measured if measured else None
            cases.append({
                "name": f"{scenario.name} {measure} @ {rate_mbit:g} Mbit/s", "scenario": scenario.name,
                "measure": measure, "rate_mbit": rate_mbit, "measured_s": measured, "predicted_s": predicted[measure],
                "error": error, "within_tolerance": error is not None and abs(error) <= tolerance,
                "measured_runs_s": values,
                "spread": (max(values) - min(values)) / measured if measured and len(values) > 1 else 0.0,
                "ops_s": {op: statistics.median(s[op] for s in mine if op in s) for op in ops},
                "transfers": scenario.to_dict()})
    return cases


def measure_rate(settings: NetworkCheckSettings, shaping, out_dir: str, log: Callable[[str], None]) -> List[dict]:
    """Build the per-rank network of ``shaping``, run the worker on it, return its measured runs (removing the
    namespaces on every exit)."""
    from .runner import error_excerpt, run_workers

    spec_path = os.path.join(out_dir, f"spec-{shaping.rate_mbit:g}mbit.json")
    with open(spec_path, "w", encoding="utf-8") as handle:
        json.dump({"scenarios": [s.to_dict() for s in settings.scenarios()], "warmup": settings.warmup,
                   "repeats": settings.repeats, "timeout_s": settings.timeout_s}, handle, indent=1)
    log_path = os.path.join(out_dir, f"flows-{shaping.rate_mbit:g}mbit.log")
    log(f"network check: {shaping.describe()}: {len(settings.scenarios())} scenarios x "
        f"({settings.warmup} warm-up + {settings.repeats}) runs; log {log_path}")
    code, wall, text = run_workers(shaping, settings.world, ("-m", "megatron_pipemesh.bench.flow_probe"), [spec_path],
                                   log_path, settings.timeout_s)
    if code != 0:
        what = (f"did not finish within {settings.timeout_s:g} s (the flows at {shaping.rate_mbit:g} Mbit/s)"
                if code == 124 else f"failed (exit {code})")
        raise RuntimeError(f"network check at {shaping.rate_mbit:g} Mbit/s {what}: {error_excerpt(text, 6)}")
    log(f"network check: {shaping.rate_mbit:g} Mbit/s measured in {wall:.0f} s")
    return parse_runs(text)


def run_check(settings: NetworkCheckSettings, base_shaping, out_dir: str, log: Callable[[str], None]) -> dict:
    """Every rate of ``settings`` on the network of ``base_shaping`` (its NIC queue, burst and queue depth; the
    rate replaced): the network-check document (``cases`` with ``name``, ``measured_s``, ``predicted_s``)."""
    from dataclasses import replace

    started = time.monotonic()
    cases: List[dict] = []
    for rate in settings.rates_mbit:
        shaping = replace(base_shaping, rate_mbit=rate)
        runs = measure_rate(settings, shaping, out_dir, log)
        cases += build_cases(runs, settings.scenarios(), rate, shaping.payload_bytes_per_s, settings.tolerance)
    errors = [abs(c["error"]) for c in cases if c["error"] is not None]
    return {
        "network": {"topology": "per-rank", "nic_queue": base_shaping.nic_queue, "burst_bytes": base_shaping.burst_bytes,
                    "queue_ms": base_shaping.queue_ms, "rates_mbit": list(settings.rates_mbit),
                    "payload_fraction": base_shaping.payload_bytes_per_s / base_shaping.bytes_per_s},
        "model": "megatron_pipemesh.planning.network: every rank's egress and ingress at the NIC's payload rate, shared "
                 "max-min fairly; a ring all-reduce as 2(d-1) steps, each at its slowest hop",
        "fitted": "nothing (latency 0, no per-transfer overhead)",
        "sizes_bytes": list(settings.sizes_bytes), "pipeline_fraction": settings.pipeline_fraction,
        "warmup": settings.warmup, "repeats": settings.repeats, "tolerance": settings.tolerance,
        "all_within_tolerance": bool(cases) and all(c["within_tolerance"] for c in cases),
        "worst_abs_error": max(errors) if errors else None, "wall_s": time.monotonic() - started,
        "out_dir": out_dir, "cases": cases,
    }


def format_check(document: dict) -> str:
    """The measured-against-predicted table of a network-check document."""
    net = document["network"]
    lines = [f"network check: per-rank NIC ({net['nic_queue']} queue, burst {net['burst_bytes']} B), "
             f"{document['repeats']} runs per case (median), predicted by {document['model']}; fitted: "
             f"{document['fitted']}",
             f"{'case':<46} {'measured s':>10} {'spread':>7} {'predicted s':>11} {'error':>7}"]
    lines.append("-" * len(lines[-1]))
    for case in document["cases"]:
        measured = case["measured_s"]
        lines.append(f"{case['name']:<46} {measured if measured is not None else float('nan'):>10.3f} "
                     f"{100 * case['spread']:>6.1f}% {case['predicted_s']:>11.3f} "
                     + (f"{100 * case['error']:>+6.1f}%" if case["error"] is not None else f"{'-':>7}")
                     + ("" if case["within_tolerance"] else "  OUTSIDE"))
    worst = document["worst_abs_error"]
    lines.append(f"{sum(c['within_tolerance'] for c in document['cases'])} of {len(document['cases'])} cases within "
                 f"{100 * document['tolerance']:g}% (worst {100 * worst:.1f}%); wall {document['wall_s']:.0f} s"
                 if worst is not None else "no case measured")
    return "\n".join(lines)


def cmd_network_check(args, shaping) -> int:
    """Run the check on the network ``shaping`` describes and print / write it (``--json``); exit 0 when every
    prediction is within the tolerance, 1 otherwise."""
    import tempfile

    from .netns import NamespaceError

    out_dir = args.out_dir or tempfile.mkdtemp(prefix="pipemesh-netcheck-")
    os.makedirs(out_dir, exist_ok=True)
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    try:
        document = run_check(NetworkCheckSettings(), shaping, out_dir, log)
    except NamespaceError as error:
        from ..cli.common import UsageError

        raise UsageError(str(error)) from error
    with open(os.path.join(out_dir, "network-check.json"), "w", encoding="utf-8") as handle:
        json.dump(document, handle, indent=1)
    if not emit_json(document, args.json):
        print(format_check(document))
    return 0 if document["all_within_tolerance"] else 1
