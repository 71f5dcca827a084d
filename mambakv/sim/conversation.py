"""Conversation replay of a Mooncake trace: a next turn begins with its parent's prompt and output.

The trace's ``hash_ids`` stop at a prompt's last 512-token block, so they cannot show that the
next turn of a conversation contains the previous answer (CACHE.md: a next turn's length minus
previous prompt + previous output has a median of +25 tokens). Two replay semantics:

* **strict** (:func:`~mambakv.sim.workloads.load_trace`): equal ids = equal tokens; outputs are
  random ids that no later prompt contains.
* **conversation** (:class:`ConversationReplay`): as strict, plus a *conversation child* begins
  with its parent's prompt tokens and the tokens the parent generated in this run, verbatim.

Relations (:func:`link_requests`), among the earlier requests of the replayed window only::

    D(i)        = the most leading hash ids request i shares with any earlier request (blocks)
    relative(i) = the latest earlier request that shares D(i) ids with i (None when D(i) = 0)
    F(r)        = r.input_length // 512              (r's full blocks)

    kind(i) = REPEAT     i's hash_ids equal an earlier request's hash_ids
              NONE       else D(i) <= 1      (only the first block, which every request shares)
              NEXT_TURN  else D(i) >= F(r)   (i extends all of r's full blocks)
              BRANCH     else                (i leaves r inside r's full blocks)

    parent(i) = r = relative(i)   iff  kind(i) is NEXT_TURN and F(r) >= 2
                                  and  i.input_length >= r.input_length + r.output_length

Only the *deepest* match is a candidate, and the latest of the deepest (the most recent turn).
A request that extends an older prompt but shares more with a later one that it leaves inside
(it branched off that later turn) is a branch of the later one, not a child of the older one.
Measured on ``../shared/traces/conversation_trace.jsonl``, first 3000 requests: kinds NONE 2,034
(the first request included), NEXT_TURN 795, BRANCH 148, REPEAT 23, and 730 requests with a
parent, CACHE.md's counts. Taking the latest request whose full blocks are extended, deepest or
not, would give 755 parents; ``--skip 3000 --limit 3000`` gives 686.

Content of a child i of parent r (N = i.input_length; ``strict(i)`` is i's strict prompt)::

    r's prompt as replayed (its own parent's content when r is a child)   r.input_length tokens
    + r's generated ids in this run (``request.all_token_ids`` at finish)  r's output tokens
    + strict(i)[len(so far):]                                              the rest, truncated to N

    e.g. r: 1,100 tokens, ids [1, 2, 3], 50 output tokens; i: 1,300 tokens, ids [1, 2, 4]
         i = r's 1,100 prompt tokens | r's 50 output ids | block 4's tokens 126 .. 275

The prompt is built when the scheduler creates the request (on arrival in its waiting queue):
with ``--one-at-a-time`` the parent has always finished by then; in a concurrent run a child
that arrives before its parent finished uses strict content (counted in ``strict_fallbacks``).
A parent that never ran (rejected) leaves its children strict too. The run is deterministic:
the parent's outputs are the scheduler's seeded ids.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from mambakv.core.errors import MambaKVError, TraceFormatError
from mambakv.sim.sim_request import SimRequest
from mambakv.sim.workloads import TRACE_BLOCK_TOKENS, RequestSpec, iter_trace_rows

__all__ = ["REPLAY_MODES", "ConversationReplay", "chain_hooks", "oracle_retention", "prepare_replay", "Link", "Relation", "TraceRow", "link_requests",
           "read_trace_rows"]

#: ``--replay`` values: the default first.
REPLAY_MODES = ("strict", "conversation")


class Relation(enum.Enum):
    """How a request's hash ids relate to the earlier requests' (module docstring)."""

    NONE = "none"
    NEXT_TURN = "next_turn"
    BRANCH = "branch"
    REPEAT = "repeat"


@dataclass(frozen=True)
class TraceRow:
    """One trace line: ``input_length`` and ``output_length`` as in the file (tokens)."""

    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class Link:
    """Request i's place among the earlier requests (indices into the replayed window).

    Attributes:
        kind: the relation.
        depth: D(i), leading hash ids shared with an earlier request (blocks).
        relative: the latest earlier request sharing `depth` ids; None when depth is 0.
        parent: the conversation parent (the relative, under the length rule); None if none.
    """

    kind: Relation
    depth: int
    relative: int | None
    parent: int | None


def read_trace_rows(path: str | Path, *, skip: int = 0, limit: int | None = None) -> list[TraceRow]:
    """The rows :func:`~mambakv.sim.workloads.load_trace` reads with the same `skip` and `limit`
    (blank lines skipped), one per request, in file order.

    Raises:
        TraceFormatError: as ``load_trace``.
    """
    return [TraceRow(n_in, n_out, tuple(ids)) for _, n_in, n_out, ids in iter_trace_rows(path, skip=skip, limit=limit)]


class _Node:
    """A trie node: one hash-id prefix; `last` is the latest request through it, `ends` is
    True when some request's hash ids end here."""

    __slots__ = ("children", "last", "ends")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.last = -1
        self.ends = False


def link_requests(rows: Sequence[TraceRow]) -> list[Link]:
    """Each request's relation, relative and conversation parent (module docstring), in
    O(total hash ids) with a trie of hash-id prefixes."""
    root = _Node()
    links: list[Link] = []
    for i, row in enumerate(rows):
        node, depth = root, 0
        for h in row.hash_ids:
            nxt = node.children.get(h)
            if nxt is None:
                break
            node, depth = nxt, depth + 1
        relative = node.last if depth else None
        parent = None
        if depth == len(row.hash_ids) and node.ends:
            kind = Relation.REPEAT
        elif depth <= 1 or relative is None:
            kind = Relation.NONE
        else:
            r = rows[relative]
            full = r.input_length // TRACE_BLOCK_TOKENS
            if depth >= full:
                kind = Relation.NEXT_TURN
                if full >= 2 and row.input_length >= r.input_length + r.output_length:
                    parent = relative
            else:
                kind = Relation.BRANCH
        links.append(Link(kind, depth, relative, parent))
        node = root
        for h in row.hash_ids:
            node = node.children.setdefault(h, _Node())
            node.last = i
        node.ends = True
    return links


class ConversationReplay:
    """The specs of a conversation replay, with the hook that records parents' outputs.

    Pass :attr:`specs` to the scheduler and :meth:`on_finish` as its ``on_finish``: a finished
    parent's ``all_token_ids`` (prompt + generated ids) is kept until its last child's prompt is
    built, then dropped. A child's prompt is decided once, at its first build (one replay per
    run: building it again after the parent's ids were dropped raises MambaKVError).

    Attributes:
        specs: one per request, same ids / lengths / arrival as the given ones; a child's
            ``make_prompt`` is the conversation rule.
        links: :func:`link_requests` of the rows.
        conversation_prompts: children built with their parent's content.
        strict_fallbacks: children built strict because the parent had not finished.

    Raises:
        TraceFormatError: `specs` and `rows` differ in count or in a prompt length.
    """

    def __init__(self, specs: Sequence[RequestSpec], rows: Sequence[TraceRow]) -> None:
        if len(specs) != len(rows):
            raise TraceFormatError(f"{len(specs)} requests but {len(rows)} trace rows")
        for s, r in zip(specs, rows):
            if s.num_prompt_tokens != r.input_length:
                raise TraceFormatError(f"{s.request_id}: {s.num_prompt_tokens} prompt tokens but the trace row "
                                       f"has input_length {r.input_length}")
        self.links = link_requests(rows)
        self._index = {s.request_id: i for i, s in enumerate(specs)}
        self._pending = [0] * len(specs)   # children of each request whose prompt is not built yet
        for link in self.links:
            if link.parent is not None:
                self._pending[link.parent] += 1
        self._outputs: dict[int, np.ndarray] = {}   # finished parent -> prompt + generated ids
        self._used: dict[int, bool] = {}   # child built -> with its parent's content
        self.conversation_prompts = 0
        self.strict_fallbacks = 0
        self.specs = [self._wrap(i, s) for i, s in enumerate(specs)]

    @property
    def num_children(self) -> int:
        """Requests with a conversation parent (730 in the first 3000 of the Mooncake trace)."""
        return sum(link.parent is not None for link in self.links)

    def _wrap(self, i: int, spec: RequestSpec) -> RequestSpec:
        if self.links[i].parent is None:
            return spec
        strict = spec.make_prompt

        def make() -> np.ndarray:
            return self._child_prompt(i, strict)

        return RequestSpec(spec.request_id, spec.arrival_ms, spec.num_prompt_tokens, spec.output_len, make,
                           spec.output_token_ids)

    def _child_prompt(self, i: int, strict: Callable[[], np.ndarray]) -> np.ndarray:
        parent = self.links[i].parent
        assert parent is not None
        prefix = self._outputs.get(parent)
        if i not in self._used:
            self._used[i] = prefix is not None
            if prefix is None:
                self.strict_fallbacks += 1
            else:
                self.conversation_prompts += 1
            self._pending[parent] -= 1
            if self._pending[parent] == 0:
                self._outputs.pop(parent, None)
        elif not self._used[i]:
            prefix = None
        elif prefix is None:
            raise MambaKVError(f"{self.specs[i].request_id}: prompt built again after its parent's ids were dropped; "
                               f"use one ConversationReplay per run")
        tokens = strict()
        if prefix is None:
            return tokens
        n = tokens.size
        return np.concatenate([prefix[:n], tokens[prefix.size:]]).astype(np.int32, copy=False)

    def on_finish(self, sreq: SimRequest) -> None:
        """Record a finished parent's prompt + generated ids (its children not built yet need them).

        Raises:
            MambaKVError: the request is not one of :attr:`specs`.
        """
        i = self._index.get(sreq.request.request_id)
        if i is None:
            raise MambaKVError(f"request {sreq.request.request_id!r} is not part of this replay")
        if self._pending[i]:
            self._outputs[i] = np.array(sreq.request.all_token_ids, dtype=np.int32)


def chain_hooks(hooks: Sequence[Callable[[SimRequest], None]]) -> Callable[[SimRequest], None]:
    """One ``on_finish`` that calls `hooks` in order."""
    def on_finish(sreq: SimRequest) -> None:
        for hook in hooks:
            hook(sreq)
    return on_finish


def oracle_retention(specs: Sequence[RequestSpec], links: Sequence[Link]) -> list[RequestSpec]:
    """`specs` with an oracle ``retain`` hint each: ``"high"`` when a later request of the window
    shares more than the first block with it (it is its relative, kind not NONE: a next turn, a
    branch or a repeat), else ``"low"``. Knowledge of the future, for an upper bound."""
    reused = {link.relative for link in links if link.kind is not Relation.NONE and link.relative is not None}
    return [replace(s, retain="high" if i in reused else "low") for i, s in enumerate(specs)]


def prepare_replay(specs: Sequence[RequestSpec], path: str | Path, *, skip: int, limit: int | None,
                   replay: str) -> tuple[Sequence[RequestSpec], ConversationReplay, list[Callable[[SimRequest], None]]]:
    """The specs to run under `replay`, their :class:`ConversationReplay` (which checks that
    `specs` are the trace's rows) and the finish hooks the replay needs (the parent's outputs
    are recorded before any other hook sees the request)."""
    conv = ConversationReplay(specs, read_trace_rows(path, skip=skip, limit=limit))
    if replay == "conversation":
        return conv.specs, conv, [conv.on_finish]
    return specs, conv, []
