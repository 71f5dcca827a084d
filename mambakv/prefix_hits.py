"""Moved to ``mambakv.hits``; this path stays importable for code written against mambakv 0.1."""

from mambakv.hits import *  # noqa: F403
