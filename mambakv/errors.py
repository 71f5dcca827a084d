"""Moved to ``mambakv.core.errors``; this path stays importable for code written against mambakv 0.1."""

from mambakv.core.errors import *  # noqa: F403
