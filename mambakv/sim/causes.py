"""Hit tokens by cause: why a request's prefix hit was there.

Each request's hit (``SimRequest.hit``: the tokens ``get_computed_blocks`` returned at its
first admission, the ``cached_tokens`` of the run) goes, whole, to one cause, from the
request's relation to the earlier requests of the replayed window
(:func:`~mambakv.sim.conversation.link_requests`, from the trace's hash ids, the same under
both replay semantics)::

    hit = 0                  -> nothing
    hit <= 512               -> shared_prefix  (within the first 512-token block, which every
                                                request of the trace shares)
    hit >  512, kind REPEAT    -> repeat       (its hash ids equal an earlier prompt's)
                     NEXT_TURN -> next_turn    (it extends all full blocks of its relative: the
                                                hit covers the relative's prompt and, under
                                                conversation replay, its output)
                     BRANCH    -> branch       (it leaves its relative inside the relative's
                                                full blocks: a shared prefix of an earlier prompt)
                     NONE      -> shared_prefix (it shares at most its first block with anyone)

    e.g. with Qwen3-Next's 544-token hit grid a hit is 0 or >= 544 tokens, so shared_prefix is
    0 there: a next turn hitting 1,088 tokens counts 1,088 next_turn; a branch hitting 544
    counts 544 branch. On a 64-token grid a first turn hitting 512 counts 512 shared_prefix.

A next turn keeps its kind whether or not it has a conversation parent (the length rule) and
whether its prompt was built with its parent's content: the cause is the trace's relation.
The four counts add up to the run's ``cached_tokens``.

``state_missing_tokens`` (:class:`~mambakv.sim.metrics.SimMetrics`) is the other side: at each
first admission, ``coord.get_shared_prefix_length(request)`` (the attention-only hit) minus the
hit, summed: prompt tokens whose KV was cached but could not be used because no Mamba state
was cached where the attention hit ends.
"""

from __future__ import annotations

from collections.abc import Sequence

from mambakv.core.errors import MambaKVError
from mambakv.sim.conversation import Link, Relation
from mambakv.sim.sim_request import SimRequest
from mambakv.sim.workloads import TRACE_BLOCK_TOKENS, RequestSpec

__all__ = ["CAUSES", "HitCauses", "hit_cause"]

#: Keys of ``hit_tokens_by_cause``, in report order.
CAUSES = ("shared_prefix", "next_turn", "branch", "repeat")

_CAUSE_OF = {Relation.NONE: "shared_prefix", Relation.NEXT_TURN: "next_turn", Relation.BRANCH: "branch",
             Relation.REPEAT: "repeat"}


def hit_cause(hit: int, kind: Relation, shared_tokens: int = TRACE_BLOCK_TOKENS) -> str:
    """The cause (one of CAUSES) of a `hit` of more than 0 tokens of a request of relation
    `kind`; a hit within the first `shared_tokens` tokens is ``shared_prefix`` (module docstring)."""
    if hit <= shared_tokens:
        return "shared_prefix"
    return _CAUSE_OF[kind]


class HitCauses:
    """Accumulates ``hit_tokens_by_cause`` over a run; pass :meth:`on_finish` to the scheduler.

    Every admitted request finishes, and ``SimRequest.hit`` is its first admission's hit, so
    counting at finish counts each request's hit once.

    Args:
        specs: the run's requests, in the order of `links`.
        links: :func:`~mambakv.sim.conversation.link_requests` of their trace rows.

    Raises:
        MambaKVError: `specs` and `links` differ in length; :meth:`on_finish` of a request not
            in `specs`.
    """

    def __init__(self, specs: Sequence[RequestSpec], links: Sequence[Link]) -> None:
        if len(specs) != len(links):
            raise MambaKVError(f"{len(specs)} requests but {len(links)} links")
        self._kind = {s.request_id: link.kind for s, link in zip(specs, links)}
        self.tokens = dict.fromkeys(CAUSES, 0)

    def on_finish(self, sreq: SimRequest) -> None:
        kind = self._kind.get(sreq.request.request_id)
        if kind is None:
            raise MambaKVError(f"request {sreq.request.request_id!r} is not part of this run")
        if sreq.hit > 0:
            self.tokens[hit_cause(sreq.hit, kind)] += sreq.hit
