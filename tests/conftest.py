"""Make the repository root importable when ``megatron_pipemesh`` is not installed (no editable install)."""
import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
