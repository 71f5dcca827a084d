"""Moved to ``mambakv.groups.base``; this path stays importable for code written against mambakv 0.1
(with the names the 0.1 module imported from elsewhere)."""

from mambakv.core.block import KVCacheBlock as KVCacheBlock
from mambakv.core.block_pool import BlockPool as BlockPool
from mambakv.core.errors import HashBlockSizeMismatchError as HashBlockSizeMismatchError
from mambakv.core.errors import InvalidTokenCountError as InvalidTokenCountError
from mambakv.core.request import Request as Request
from mambakv.core.spec import KVCacheSpec as KVCacheSpec
from mambakv.groups.base import *  # noqa: F403
