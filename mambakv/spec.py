"""Moved to ``mambakv.core.spec``; this path stays importable for code written against mambakv 0.1."""

from mambakv.core.spec import *  # noqa: F403
