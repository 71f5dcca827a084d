"""Engine-side request state of the reference scheduler (:mod:`mambakv.sim.scheduler`): a
:class:`SimRequest` is the library's :class:`~mambakv.core.request.Request` plus the progress an
engine tracks; ``ScheduledEntry`` is one request's part of a scheduled step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mambakv.core.errors import MambaKVError
from mambakv.core.request import Request
from mambakv.sim.workloads import RequestSpec

if TYPE_CHECKING:
    from mambakv.coordinator import KVCacheCoordinator

__all__ = ["BudgetTooSmallError", "ScheduledEntry", "SimRequest", "pool_capacity"]


class BudgetTooSmallError(MambaKVError, RuntimeError):
    """One request alone does not fit in the KV-cache pool."""


class SimRequest:
    """A request in the scheduler: the library's Request plus engine-side progress."""

    __slots__ = ("spec", "request", "processed", "generation", "awaiting_output", "admitted",
                 "finished", "num_outputs", "is_running", "junction", "hit", "tiered")

    def __init__(self, spec: RequestSpec) -> None:
        self.spec = spec
        self.request = Request(spec.request_id, spec.prompt(), max_tokens=spec.output_len, retain=spec.retain)
        self.processed = 0          # settled tokens (results processed)
        self.generation = 0         # +1 at each preemption: older in-flight results are dropped
        self.awaiting_output = False
        self.admitted = False       # admitted at least once (hit counted then)
        self.finished = False
        self.num_outputs = 0
        self.is_running = False
        self.junction = 0           # shared-prefix length to end a prefill chunk at (0: none)
        self.hit = 0                # prefix-hit tokens at the first admission
        self.tiered = False         # its host-tier lookup was made (once, before its first admission)


#: One request's part of a scheduled step: ``(request, its generation when scheduled, tokens
#: scheduled, of which drafts, whether the step samples a token)``.
ScheduledEntry = tuple[SimRequest, int, int, int, bool]


def pool_capacity(coord: KVCacheCoordinator) -> str:
    """The pool's size for messages: ``"641 blocks"`` unified, ``"4,550 superblocks (40,958 page
    ids)"`` decoupled."""
    if coord.arena is None:
        return f"{coord.block_pool.num_blocks - 1} blocks"
    g = coord.arena.geometry
    return f"{g.num_superblocks - 1:,} superblocks ({g.num_pages - 1:,} page ids)"
