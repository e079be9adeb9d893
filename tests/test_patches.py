"""patches/megatron-lm-pretrain_gpt.patch applies to Megatron-LM's pretrain_gpt.py import block."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

PATCH = Path(__file__).resolve().parents[1] / "patches" / "megatron-lm-pretrain_gpt.patch"
# The first lines of Megatron-LM's pretrain_gpt.py (core_r0.19.0 and main share this block).
UPSTREAM_HEAD = '''# Copyright (c) 2023, NVIDIA CORPORATION.  All rights reserved.

"""Pretrain and SFT GPT."""

# Capture the true program start time BEFORE any heavy imports
import time
_PROGRAM_START_TIME = time.time()

import json
from functools import partial
from typing import List, Optional, Tuple

import torch

from gpt_builders import gpt_builder
from megatron.core import parallel_state
'''


def _apply(folder: Path) -> str:
    subprocess.run(["git", "init", "-q"], cwd=folder, check=True)
    subprocess.run(["git", "apply", str(PATCH)], cwd=folder, check=True)
    return (folder / "pretrain_gpt.py").read_text()


def test_patch_adds_install_before_megatron_imports(tmp_path):
    """The patch inserts megatron_pipemesh.install() after `import torch` and before Megatron's imports."""
    (tmp_path / "pretrain_gpt.py").write_text(UPSTREAM_HEAD)
    text = _apply(tmp_path)
    assert text.index("megatron_pipemesh.install()") < text.index("from gpt_builders import")
    assert text.index("import torch") < text.index("import megatron_pipemesh")


@pytest.mark.skipif(not os.environ.get("MEGATRON_LM_DIR"), reason="set MEGATRON_LM_DIR to a Megatron-LM checkout")
def test_patch_applies_to_a_real_checkout(tmp_path):
    """The patch applies to a real Megatron-LM pretrain_gpt.py."""
    shutil.copy(Path(os.environ["MEGATRON_LM_DIR"]) / "pretrain_gpt.py", tmp_path / "pretrain_gpt.py")
    assert "megatron_pipemesh.install()" in _apply(tmp_path)
