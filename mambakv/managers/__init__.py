"""Moved to ``mambakv.groups``; this path stays importable for code written against mambakv 0.1
(with the names the 0.1 module imported from elsewhere)."""

from mambakv.core.block_pool import BlockPool as BlockPool
from mambakv.core.errors import InvalidSpecError as InvalidSpecError
from mambakv.core.spec import FullAttentionSpec as FullAttentionSpec
from mambakv.core.spec import KVCacheSpec as KVCacheSpec
from mambakv.core.spec import MambaCacheMode as MambaCacheMode
from mambakv.core.spec import MambaSpec as MambaSpec
from mambakv.core.spec import SlidingWindowSpec as SlidingWindowSpec
from mambakv.groups import *  # noqa: F403
from mambakv.managers import attention as attention  # (0.1's package imported its modules: mambakv.managers.mamba)
from mambakv.managers import base as base
from mambakv.managers import mamba as mamba
