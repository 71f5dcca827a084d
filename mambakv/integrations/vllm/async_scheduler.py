"""``mambakv.integrations.vllm.AsyncScheduler``: vLLM 0.33's AsyncScheduler on mambakv."""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VllmAsyncScheduler

from mambakv.integrations.vllm.setup import install_mambakv

__all__ = ["AsyncScheduler"]


class AsyncScheduler(VllmAsyncScheduler):
    """vLLM's ``AsyncScheduler`` (async scheduling, vLLM 0.33's default) with mambakv as its
    ``kv_cache_manager`` (unified layout).

    Select it with ``vllm serve MODEL --scheduler-cls mambakv.integrations.vllm.AsyncScheduler``
    (or ``SchedulerConfig(scheduler_cls=...)``). The constructor is vLLM's, unchanged.

    Raises:
        UnsupportedEngineError: a feature the integration refuses: one line naming it.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        install_mambakv(self)
