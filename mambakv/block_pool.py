"""Moved to ``mambakv.core.block_pool``; this path stays importable for code written against mambakv 0.1
(with the names the 0.1 module imported from elsewhere)."""

from mambakv.core.block import FreeBlockQueue as FreeBlockQueue
from mambakv.core.block import KVCacheBlock as KVCacheBlock
from mambakv.core.block_pool import *  # noqa: F403
from mambakv.core.errors import DoubleFreeError as DoubleFreeError
from mambakv.core.errors import InvalidBlockError as InvalidBlockError
from mambakv.core.errors import InvalidTokenCountError as InvalidTokenCountError
from mambakv.core.errors import OutOfBlocksError as OutOfBlocksError
