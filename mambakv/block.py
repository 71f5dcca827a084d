"""Moved to ``mambakv.core.block``; this path stays importable for code written against mambakv 0.1."""

from mambakv.core.block import *  # noqa: F403
