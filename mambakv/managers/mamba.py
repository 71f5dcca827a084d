"""Moved to ``mambakv.groups.mamba``; this path stays importable for code written against mambakv 0.1."""

from mambakv.groups.mamba import *  # noqa: F403
