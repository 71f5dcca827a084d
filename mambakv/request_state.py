"""The coordinator's one object per live request, and the checks of a request's computed tokens.

``RequestState`` holds the engine's Request, one table per group (the very objects the group
managers keep, so the hot path looks nothing up twice) and three thresholds that make a quiet
step O(1)::

    num_scheduled   the most tokens any allocate covered     retire may not pass it
    num_covered     tokens every table covers (lookahead too) allocate below it takes no block
    quiet_tokens    a step without drafts up to here changes  allocate: no per-group call
                    nothing but counts (0 until counted)
    retire_quiet    below this processed count no group       retire: no per-group call
                    publishes, retires or raises (0 until counted)
    events          per policy, its own next event (the       retire: a policy below its
                    minimum is retire_quiet)                  own is skipped
"""

from __future__ import annotations

from mambakv.core.errors import InvalidBlockError, InvalidRequestError, InvalidTokenCountError, as_count
from mambakv.core.request import Request
from mambakv.core.unit_types import Unit
from mambakv.groups.base import BlockTable, SingleTypeKVCacheManager
from mambakv.plans import KVCacheBlocks, RequestView, TableView

__all__ = ["RequestState", "check_computed", "checked_draft_count", "describe"]


class RequestState:
    """A request that holds blocks (see the module docstring)."""

    __slots__ = ("request", "tables", "num_scheduled", "num_covered", "quiet_tokens", "retire_quiet", "events", "thresholds",
                 "quiet_max", "arrival", "parent")

    def __init__(self, request: Request, tables: tuple[BlockTable, ...], num_scheduled: int) -> None:
        self.request = request
        self.tables = tables
        self.num_scheduled = num_scheduled
        self.num_covered = 0
        self.quiet_tokens = 0
        self.retire_quiet = 0
        self.events = [0] * len(tables)
        #: per policy, its own ``(covered, quiet)`` (the two thresholds above are their minima)
        self.thresholds: list[tuple[int, int]] = [(0, 0)] * len(tables)
        #: the largest ``min(covered, quiet)`` of any policy: a step beyond it leaves none quiet
        self.quiet_max = 0
        #: seconds (the engine's clock) at admission, and the unit of the prompt it continues
        #: (decoupled layout's eviction units; None elsewhere)
        self.arrival = 0.0
        self.parent: Unit | None = None

    def recount(self, managers: tuple[SingleTypeKVCacheManager, ...], active: list[bool] | None = None) -> None:
        """Recompute the thresholds from the tables (after a slow step), and every policy's next
        event; with `active`, only those policies' thresholds (the others' tables did not
        change)."""
        per = self.thresholds
        counts = []
        for i, (m, t) in enumerate(zip(managers, self.tables)):
            c, q = m.thresholds(t) if active is None or active[i] else per[i]
            counts.append((c, q, m.next_event(t)))
        self.set_counts(counts)

    def set_counts(self, counts: list[tuple[int, int, int]]) -> None:
        """Set the thresholds and next events from each policy's ``(covered, quiet, next_event)``
        (``SingleTypeKVCacheManager.thresholds`` and ``next_event``, in policy order)."""
        per, events = self.thresholds, self.events
        covered = quiet = retire = 1 << 62
        most = 0
        for i, (c, q, e) in enumerate(counts):
            per[i] = (c, q)
            events[i] = e
            if c < covered:
                covered = c
            if q < quiet:
                quiet = q
            if q > most and c > most:
                most = c if c < q else q
            if e < retire:
                retire = e
        self.num_covered, self.quiet_tokens, self.quiet_max, self.retire_quiet = covered, quiet, most, retire

    def active_policies(self, num_tokens: int, num_lookahead_tokens: int) -> list[bool] | None:
        """For a running step without hits or drafts: per policy, whether it has anything to
        do (False: the step is within its own quiet and covered thresholds, so it would only
        count); None when every policy has."""
        end = num_tokens + num_lookahead_tokens
        if end > self.quiet_max:
            return None
        active = [num_tokens > q or end > c for c, q in self.thresholds]
        return None if all(active) else active


def checked_draft_count(num_draft_tokens: object, num_new_tokens: int) -> int:
    """``allocate``'s explicit `num_draft_tokens`: an int in ``0 .. num_new_tokens - 1`` (a step has
    a real token).

    Raises:
        InvalidTokenCountError: anything else.
    """
    n = as_count(num_draft_tokens, "num_draft_tokens")
    if not 0 <= n < num_new_tokens:
        raise InvalidTokenCountError(
            f"num_draft_tokens must be in 0..{num_new_tokens - 1} (a step has a real token), got {num_draft_tokens!r}")
    return n


def check_computed(request: Request, live: RequestState | None, num_new_computed_tokens: int,
                   new_computed_blocks: KVCacheBlocks | None) -> None:
    """Computed tokens must be backed by blocks: a request that holds none starts from 0
    (after a preemption the engine resets ``num_computed_tokens``) plus exactly its hit; a
    running one cannot have computed more than was ever scheduled, and takes no hits.
    Otherwise blocks that were never computed would be published to the prefix cache.

    Raises:
        InvalidTokenCountError: computed tokens without blocks or hits to back them.
        InvalidRequestError: another live request has the same id.
    """
    if not isinstance(request, Request):
        raise InvalidRequestError(f"allocate needs a Request, got {type(request).__name__}")
    if new_computed_blocks is not None and not isinstance(new_computed_blocks, KVCacheBlocks):
        raise InvalidBlockError(f"new_computed_blocks must be the KVCacheBlocks of get_computed_blocks, got "
                                f"{type(new_computed_blocks).__name__}")
    if live is None:
        if request.num_computed_tokens != 0:
            raise InvalidTokenCountError(
                f"request {request.request_id!r} holds no blocks but has num_computed_tokens="
                f"{request.num_computed_tokens}; reset it to 0 after a preemption")
        if num_new_computed_tokens and new_computed_blocks is None:
            raise InvalidTokenCountError(
                f"num_new_computed_tokens={num_new_computed_tokens} needs the hit blocks of get_computed_blocks")
        return
    if live.request is not request:
        raise InvalidRequestError(f"another live request already has the id {request.request_id!r}")
    if num_new_computed_tokens:
        raise InvalidTokenCountError(f"request {request.request_id!r} is running: hits are for new requests")
    if request.num_computed_tokens > live.num_scheduled:
        raise InvalidTokenCountError(
            f"request {request.request_id!r} has num_computed_tokens={request.num_computed_tokens} but only "
            f"{live.num_scheduled} were ever scheduled")


def describe(live: RequestState, managers: tuple[SingleTypeKVCacheManager, ...]) -> RequestView:
    """The read-only snapshot of `live` (see ``KVCacheCoordinator.describe``)."""
    rid = live.request.request_id
    tables: list[TableView] = []
    for gid, m in enumerate(managers):
        view = m.describe(rid)
        tables.append(view if view is not None else TableView(gid, (), 0, 0))
    return RequestView(rid, live.request.num_tokens, live.num_scheduled, tuple(tables))
