"""Moved to ``mambakv.core.hashing``; this path stays importable for code written against mambakv 0.1."""

from mambakv.core.hashing import *  # noqa: F403
