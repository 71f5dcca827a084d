"""Moved to ``mambakv.core.block_pool``; this path stays importable for code written against mambakv 0.1."""

from mambakv.core.block_pool import *  # noqa: F403
