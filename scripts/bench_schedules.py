#!/usr/bin/env python3
"""Benchmark stock Megatron schedules against PipeMesh (same as ``pipemesh bench``).

    python scripts/bench_schedules.py --quick
    python scripts/bench_schedules.py --configs pp2 pp2xdp2 --rate 400mbit --repeats 3 --json --plot bench.png
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_pipemesh.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
