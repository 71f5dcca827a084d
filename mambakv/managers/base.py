"""Moved to ``mambakv.groups.base``; this path stays importable for code written against mambakv 0.1."""

from mambakv.groups.base import *  # noqa: F403
