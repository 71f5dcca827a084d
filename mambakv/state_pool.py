"""Moved to ``mambakv.device.state_pool``; this path stays importable for code written against mambakv 0.1."""

from mambakv.device.state_pool import *  # noqa: F403
