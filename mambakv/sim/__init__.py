"""Reference scheduler, workloads and metrics: drive the library exactly as an engine would.

``run_replay`` (the 480k prefill), ``run_trace`` (a Mooncake JSONL trace), ``run_conversations``
(multi-turn chats); :class:`Scheduler` for custom loops. See docs/replay.md.
"""

from mambakv.sim.fleet import FleetResult, run_fleet
from mambakv.sim.metrics import GroupMetrics, SimMetrics, group_usage
from mambakv.sim.runner import (
                                DEFAULT_MODEL,
                                SimResult,
                                build_coordinator,
                                run_conversations,
                                run_replay,
                                run_trace,
                                run_workload,
)
from mambakv.sim.scheduler import BudgetTooSmallError, Scheduler, SimRequest
from mambakv.sim.workloads import (
                                DEFAULT_VOCAB,
                                RequestSpec,
                                conversations,
                                load_trace,
                                long_prefill,
                                trace_block_tokens,
)

__all__ = [
    "FleetResult", "run_fleet",
    "DEFAULT_MODEL", "DEFAULT_VOCAB", "BudgetTooSmallError", "GroupMetrics", "RequestSpec", "Scheduler",
    "SimMetrics", "SimRequest", "SimResult", "build_coordinator", "conversations", "group_usage", "load_trace",
    "long_prefill", "run_conversations", "run_replay", "run_trace", "run_workload", "trace_block_tokens",
]
