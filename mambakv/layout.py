"""Moved to ``mambakv.device.layout``; this path stays importable for code written against mambakv 0.1
(with the names the 0.1 module imported from elsewhere)."""

from mambakv.core.errors import InvalidSpecError as InvalidSpecError
from mambakv.core.spec import DTYPE_SIZES as DTYPE_SIZES
from mambakv.core.spec import AttentionSpec as AttentionSpec
from mambakv.core.spec import KVCacheConfig as KVCacheConfig
from mambakv.core.spec import MambaSpec as MambaSpec
from mambakv.device.layout import *  # noqa: F403
from mambakv.device.state_pool import MambaStatePool as MambaStatePool
from mambakv.device.views import carve_state_views as carve_state_views
from mambakv.device.views import default_device as default_device
from mambakv.device.views import torch_dtype as torch_dtype
