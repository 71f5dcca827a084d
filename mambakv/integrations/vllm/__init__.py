"""mambakv inside vLLM 0.33: ``Scheduler`` and ``AsyncScheduler`` for ``--scheduler-cls``.

::

    vllm serve MODEL --scheduler-cls mambakv.integrations.vllm.AsyncScheduler          # async (default)
    vllm serve MODEL --no-async-scheduling --scheduler-cls mambakv.integrations.vllm.Scheduler

Both are vLLM's own scheduler classes whose ``kv_cache_manager`` is a
:class:`~mambakv.integrations.vllm.manager.VllmKVCacheManager` over a mambakv coordinator
(docs/engine-integration.md, "mambakv inside vLLM"). Importing this package on another vLLM
than 0.33.x raises UnsupportedEngineError (``_compat``), before any vLLM scheduler module loads.
"""

from __future__ import annotations

from mambakv.integrations.vllm._compat import SUPPORTED_VLLM, VLLM_VERSION
from mambakv.integrations.vllm.async_scheduler import AsyncScheduler
from mambakv.integrations.vllm.manager import VllmKVCacheManager
from mambakv.integrations.vllm.scheduler import Scheduler

__all__ = ["SUPPORTED_VLLM", "VLLM_VERSION", "AsyncScheduler", "Scheduler", "VllmKVCacheManager"]
