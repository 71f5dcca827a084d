"""Moved to ``mambakv.core.events``; this path stays importable for code written against mambakv 0.1."""

from mambakv.core.events import *  # noqa: F403
