#!/usr/bin/env python
"""Megatron GPT pretraining with PipeMesh available (``--pipeline-schedule pipemesh``).

Thin wrapper around ``megatron_pipemesh.training.pretrain_gpt.main``; accepts every Megatron-LM flag.
Run it with torchrun, e.g.::

    torchrun --nproc-per-node 2 scripts/pretrain_gpt.py --pipeline-model-parallel-size 2 ...
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_pipemesh.training.pretrain_gpt import main  # noqa: E402

if __name__ == "__main__":
    main()
