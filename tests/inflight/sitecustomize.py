"""Loaded at start-up by a child process whose PYTHONPATH starts here: turns on tests/inflight_storage.py's check."""
import importlib.util
import os

_path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "inflight_storage.py")
_spec = importlib.util.spec_from_file_location("inflight_storage", _path)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
_module.install()
