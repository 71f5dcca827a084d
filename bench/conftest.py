"""Benchmarks import their shared workloads from bench/common.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
