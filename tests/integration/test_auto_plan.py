"""Plan files (--pipemesh-plan) with placement levels: integration/auto_plan.py's load_plan."""
import json

import pytest

from megatron_pipemesh.integration.auto_plan import load_plan


def _write(tmp_path, entries, pp=2, vpp=2, m=4):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"pp": pp, "vpp": vpp, "microbatches": m, "forward_groups": [4], "backward_groups": [4],
                                "recompute": [{"rank": r, "chunk": c, "microbatch": j, "level": lv}
                                              for (r, c, j), lv in entries.items()]}))
    return str(path)


def test_plan_file_with_host_levels_loads(tmp_path):
    """'host' entries load next to recompute levels, and the summary counts both."""
    plan = {(0, 0, 0): "host", (1, 1, 3): "host", (0, 1, 2): "full"}
    resolved = load_plan(_write(tmp_path, plan), 2, 2, 4)
    assert resolved.placement == plan
    assert "1 recomputed and 2 host-placed chunk-micro-batches" in resolved.describe()


def test_plan_file_levels_and_keys_checked(tmp_path):
    """Unknown levels and entries outside p, V, m are rejected naming the file."""
    with pytest.raises(ValueError, match="unknown placement level.*'disk'.*host"):
        load_plan(_write(tmp_path, {(0, 0, 0): "disk"}), 2, 2, 4)
    with pytest.raises(ValueError, match=r"entries \[\(2, 0, 0\)\].*outside"):
        load_plan(_write(tmp_path, {(2, 0, 0): "host"}), 2, 2, 4)
