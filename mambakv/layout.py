"""Moved to ``mambakv.device.layout``; this path stays importable for code written against mambakv 0.1."""

from mambakv.device.layout import *  # noqa: F403
