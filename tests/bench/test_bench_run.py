"""One real tiny `pipemesh bench --unshaped` run: two schedules, one repeat, plain loopback (no root needed)."""
import json
import subprocess
import sys
from pathlib import Path

from megatron_pipemesh.bench.runner import default_groups


ROOT = Path(__file__).resolve().parents[2]


def test_tiny_unshaped_bench(tmp_path):
    """A real tiny unshaped bench reports throughput and timers for both schedules and PipeMesh's default groups."""
    cmd = [sys.executable, "-m", "megatron_pipemesh.bench", "--unshaped", "--configs", "pp2",
           "--schedules", "interleaved", "pipemesh", "--repeats", "1", "--warmup", "1", "--iters", "2",
           "--hidden-size", "64", "--seq-length", "32", "--micro-batch-size", "1", "--microbatches", "4",
           "--json", "--out-dir", str(tmp_path)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(result.stdout)
    (entry,) = doc["configs"]
    rows = {r["schedule"]: r for r in entry["schedules"]}
    for name in ("interleaved", "pipemesh"):
        u = rows[name]["unshaped"]
        assert rows[name]["shaped"] is None
        assert u["runs"] == 1 and u["tokens_per_s_median"] > 0 and u["iteration_ms_median"] > 0
        assert all(x is not None and x > 0 for x in u["forward_backward_ms"] + u["forward_compute_ms"])
        assert "unshaped" in rows[name]["calibration"]
    forward, backward = default_groups(2, 4)  # no group flags given: the bench's default for p = 2, m = 4
    assert rows["pipemesh"]["groups"] == [list(forward), list(backward)] == [[4], [2, 2]]
    assert rows["interleaved"]["groups"] is None
    assert "pipemesh" in entry["pipemesh_vs_best_stock_unshaped"]
    assert (tmp_path / "summary.json").exists()
