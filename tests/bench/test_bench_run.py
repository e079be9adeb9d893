"""One real tiny memory-fair `pipemesh bench --unshaped` run: depth-first and PipeMesh auto inside one budget."""
import json
import subprocess
import sys
from pathlib import Path



ROOT = Path(__file__).resolve().parents[2]


def test_tiny_unshaped_memory_fair_bench(tmp_path):
    """Both rows run, every rank's measured peak is reported and within the auto budget (the plan and the
    stock choice are predicted to fit), PipeMesh auto has its ratio to the best stock row, --json FILE is written."""
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "megatron_pipemesh.bench", "--unshaped", "--configs", "pp2",
           "--schedules", "depth-first", "pipemesh-auto", "--repeats", "1", "--warmup", "1", "--iters", "1",
           "--hidden-size", "64", "--seq-length", "32", "--micro-batch-size", "1", "--microbatches", "4",
           "--activation-budget-mb", "auto", "--json", str(out), "--out-dir", str(tmp_path / "bench")]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(out.read_text())
    (entry,) = doc["configs"]
    budget = entry["activation_budget_bytes"]
    rows = {r["name"]: r for r in doc["rows"]}
    assert set(rows) == {"interleaved-V2-g2", "pipemesh-auto"}
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and len(row["peak_activation_bytes"]) == 2
        assert all(0 < p <= budget for p in row["peak_activation_bytes"]) and row["fits"] is True
    assert entry["best_stock"] == "interleaved-V2-g2"
    assert rows["pipemesh-auto"]["ratio_to_best_stock"] > 0
    assert "best stock (fastest that fits): interleaved-V2-g2" in result.stdout
