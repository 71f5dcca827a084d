"""``mambakv.integrations.vllm.Scheduler``: vLLM 0.33's synchronous Scheduler on mambakv."""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler

from mambakv.integrations.vllm.setup import install_mambakv

__all__ = ["Scheduler"]


class Scheduler(VllmScheduler):
    """vLLM's ``Scheduler`` with mambakv as its ``kv_cache_manager`` (unified layout).

    Select it with ``vllm serve MODEL --no-async-scheduling --scheduler-cls
    mambakv.integrations.vllm.Scheduler`` (or ``SchedulerConfig(scheduler_cls=...)``). The
    constructor is vLLM's, unchanged (``vllm_config, kv_cache_config, structured_output_manager,
    block_size, hash_block_size, mm_registry, include_finished_set, log_stats``).

    Raises:
        UnsupportedEngineError: a feature the integration refuses (KV connectors,
            encoder-decoder models, DCP / PCP, partial-block hits, hybrid models with drafts, ...): one line
            naming it.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        install_mambakv(self)
