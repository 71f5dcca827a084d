"""Moved to ``mambakv.groups.attention``; this path stays importable for code written against mambakv 0.1."""

from mambakv.groups.attention import *  # noqa: F403
