"""Moved to ``mambakv.groups``; this path stays importable for code written against mambakv 0.1."""

from mambakv.groups import *  # noqa: F403
