"""Make the repository root importable when ``megatron_pipemesh`` is not installed (no editable install), and run the
longest test folders first."""
import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

FIRST = ("training",)
"""Test folders run before the others: their files (whole Megatron runs) are the longest, and pytest-xdist hands out
whole files in collection order (scripts/test.sh), so started last one of them keeps one worker busy while the other
idles."""


def pytest_collection_modifyitems(items):
    tests = Path(__file__).resolve().parent

    def first(item) -> bool:
        try:
            return Path(str(item.fspath)).resolve().relative_to(tests).parts[0] in FIRST
        except ValueError:
            return False

    items.sort(key=lambda item: not first(item))  # stable: each file's own order is kept
