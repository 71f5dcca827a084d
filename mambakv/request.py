"""Moved to ``mambakv.core.request``; this path stays importable for code written against mambakv 0.1."""

from mambakv.core.request import *  # noqa: F403
