"""Moved to ``mambakv.groups.mamba``; this path stays importable for code written against mambakv 0.1
(with the names the 0.1 module imported from elsewhere)."""

from mambakv.core.block import KVCacheBlock as KVCacheBlock
from mambakv.core.block_pool import BlockPool as BlockPool
from mambakv.core.errors import InvalidDraftCountError as InvalidDraftCountError
from mambakv.core.errors import InvalidTokenCountError as InvalidTokenCountError
from mambakv.core.errors import as_count as as_count
from mambakv.core.request import Request as Request
from mambakv.core.spec import KVCacheSpec as KVCacheSpec
from mambakv.core.spec import MambaCacheMode as MambaCacheMode
from mambakv.core.spec import MambaSpec as MambaSpec
from mambakv.groups.base import SingleTypeKVCacheManager as SingleTypeKVCacheManager
from mambakv.groups.mamba import *  # noqa: F403
from mambakv.groups.tables import RequestBlocks as RequestBlocks
from mambakv.groups.tables import cdiv as cdiv
from mambakv.groups.tables import group_block_hashes as group_block_hashes
