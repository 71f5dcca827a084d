"""Checkpoint placement: where a prefill chunk ends, so that a Mamba state is published there.

A state is worth its memory only where a later hit ends (Marconi, MLSys 2025; CACHE.md). In align
mode a state is published at the end of a prefill chunk that lands on the hit alignment ``A``
(``KVCacheCoordinator.alignment_tokens``), so choosing chunk ends *is* choosing checkpoints.
``KVCacheCoordinator.next_chunk_end(request, budget)`` asks the coordinator's placement, one call
per prefill chunk. Each rule proposes the positions it wants in ``(computed, limit]`` with
``limit = min(computed + budget, N)``; the chunk ends at the smallest proposal, else at ``limit``:

==================  =====================================================================
rule                proposes
==================  =====================================================================
``replay_boundary``  ``T = (N - 1) // A * A`` (or ``N - N % A``): a repeat of the prompt,
                     capped at ``N - 1``, finds a state there
``junction``         ``J = get_shared_prefix_length`` at admission when it exceeds the hit:
                     the end of a prefix an earlier request shares, whose state was never
                     published (a branch point)
``chunk_ends``       below ``T``, the largest multiple of ``A`` <= ``limit`` (vLLM: every
                     chunk ends aligned, so every chunk end is a checkpoint)
``chunk_grid(k)``    the next multiple of ``k`` (a multiple of ``A``)
==================  =====================================================================

Worked example (``A = 16``, ``N = 100``, budget 40, no hit; junction ``J = 48``)::

    rules                                   chunk ends          states at
    chunk_ends + replay_boundary            32 64 96 100        32 64 96
    + junction                              32 48 80 96 100     32 48 80 96
    replay_boundary + junction              40 48 88 96 100     48 96      (40, 88: off the grid)

``CheckpointPlacement`` composes rules (``VLLM_PLACEMENT`` = the three vLLM 0.33 rules, the
unified layout's default); an engine passes its own rule object with a ``propose`` method.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from mambakv.core.engine_request import EngineRequest
from mambakv.core.errors import InvalidSpecError

__all__ = ["DEFAULT_PLACEMENT", "VLLM_PLACEMENT", "CheckpointPlacement", "ChunkEnds", "ChunkGrid", "Junction", "PlacementRule",
           "PrefixQueries", "ReplayBoundary", "placement_from_names", "resolve_placement"]


class PrefixQueries(Protocol):
    """What a rule may ask of the coordinator (read-only)."""

    def get_shared_prefix_length(self, request: EngineRequest) -> int: ...

    def holds_blocks(self, request_id: str) -> bool: ...


class PlacementRule(Protocol):
    """One placement rule (the engine hook)."""

    name: str

    def propose(self, coord: PrefixQueries, request: EngineRequest, computed: int, limit: int,
                align: int) -> int | None:
        """The smallest position in ``(computed, limit]`` where this rule wants a state (a
        multiple of `align`), or None. Read-only on the coordinator."""

    def forget(self, request_id: str) -> None:
        """Drop what the rule keeps for the request (called by ``free``)."""


class ReplayBoundary:
    """``T = (N - 1) // A * A`` (``N - N % A`` with ``stop_before_last_token=False``, older vLLM)."""

    name = "replay_boundary"

    def __init__(self, *, stop_before_last_token: bool = True) -> None:
        self.stop_before_last_token = stop_before_last_token

    def stop(self, num_tokens: int, align: int) -> int:
        n = num_tokens - 1 if self.stop_before_last_token else num_tokens
        return n // align * align

    def propose(self, coord: PrefixQueries, request: EngineRequest, computed: int, limit: int,
                align: int) -> int | None:
        t = self.stop(request.num_tokens, align)
        return t if computed < t <= limit else None

    def forget(self, request_id: str) -> None:
        pass


class Junction:
    """The shared-prefix length (``get_shared_prefix_length``) found when the request is
    admitted: asked again on every call until the request holds blocks, then kept per request
    id until ``free``."""

    name = "junction"

    def __init__(self) -> None:
        self._at: dict[str, int] = {}

    def position(self, request_id: str) -> int:
        """The request's junction (0: none, or not asked yet)."""
        return self._at.get(request_id, 0)

    def propose(self, coord: PrefixQueries, request: EngineRequest, computed: int, limit: int,
                align: int) -> int | None:
        rid = request.request_id
        j = self._at.get(rid)
        if j is None or not coord.holds_blocks(rid):  # admission (again, after a refused allocate)
            j = self._at[rid] = coord.get_shared_prefix_length(request)
        return j if computed < j <= limit else None

    def forget(self, request_id: str) -> None:
        self._at.pop(request_id, None)


class ChunkEnds:
    """Below the replay boundary, end every chunk on the grid (vLLM 0.33's chunking)."""

    name = "chunk_ends"

    def __init__(self, boundary: ReplayBoundary | None = None) -> None:
        self.boundary = boundary or ReplayBoundary()

    def propose(self, coord: PrefixQueries, request: EngineRequest, computed: int, limit: int,
                align: int) -> int | None:
        if computed >= self.boundary.stop(request.num_tokens, align):
            return None
        end = limit // align * align
        return end if end > computed else None

    def forget(self, request_id: str) -> None:
        pass


class ChunkGrid:
    """A state every `every` tokens (a positive multiple of the alignment)."""

    name = "chunk_grid"

    def __init__(self, every: int) -> None:
        if not isinstance(every, int) or every <= 0:
            raise InvalidSpecError(f"chunk_grid needs a positive token count, got {every!r}")
        self.every = every

    def propose(self, coord: PrefixQueries, request: EngineRequest, computed: int, limit: int,
                align: int) -> int | None:
        if self.every % align:
            raise InvalidSpecError(f"chunk_grid({self.every}) is not a multiple of the alignment {align}")
        nxt = (computed // self.every + 1) * self.every
        return nxt if nxt <= limit else None

    def forget(self, request_id: str) -> None:
        pass


class CheckpointPlacement:
    """Rules composed: a chunk ends at the smallest position any rule proposes.

    Args:
        rules: rule objects (``PlacementRule``), in any order.
    """

    def __init__(self, rules: Sequence[PlacementRule]) -> None:
        self.rules = tuple(rules)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.rules)

    def chunk_end(self, coord: PrefixQueries, request: EngineRequest, computed: int, budget: int,
                  align: int) -> int:
        """End position of the next chunk (``> computed`` when tokens remain and budget > 0)."""
        limit = min(computed + budget, request.num_tokens)
        if not align:
            return limit
        end = limit
        for rule in self.rules:
            p = rule.propose(coord, request, computed, limit, align)
            if p is not None and p < end:
                end = p
        return end

    def forget(self, request_id: str) -> None:
        for rule in self.rules:
            rule.forget(request_id)

    def set_stop_rule(self, *, stop_before_last_token: bool) -> None:
        """Switch every replay boundary (``ReplayBoundary``, ``ChunkEnds``' own) between vLLM
        0.33's ``(N - 1) // A * A`` (True) and older vLLM's ``N - N % A``; other rules, and what
        they keep per request, stay as they are."""
        for rule in self.rules:
            if isinstance(rule, ReplayBoundary):
                rule.stop_before_last_token = stop_before_last_token
            elif isinstance(rule, ChunkEnds):
                rule.boundary.stop_before_last_token = stop_before_last_token

    def check_alignment(self, align: int) -> None:
        """Raise InvalidSpecError if a ``ChunkGrid`` is not a multiple of `align` (0: none applies)."""
        for rule in self.rules:
            if isinstance(rule, ChunkGrid) and align and rule.every % align:
                raise InvalidSpecError(f"chunk_grid({rule.every}) is not a multiple of the alignment {align}")

    def junction(self, request_id: str) -> int:
        """The request's junction if a ``Junction`` rule is composed (0 otherwise)."""
        for rule in self.rules:
            if isinstance(rule, Junction):
                return rule.position(request_id)
        return 0

    def __repr__(self) -> str:
        return f"CheckpointPlacement({', '.join(self.names)})"


#: vLLM 0.33's rules (the unified layout's default)
VLLM_PLACEMENT = ("chunk_ends", "replay_boundary", "junction")

#: checkpoint placement per layout (``KVCacheCoordinator``'s default): unified = vLLM 0.33's rules;
#: decoupled = the same, chosen on the real trace (docs/replay.md: without the junction the hit
#: rate halves; with an 8192-token budget ``chunk_ends`` changes nothing, ``chunk_grid`` +0.0001)
DEFAULT_PLACEMENT = {"unified": VLLM_PLACEMENT, "decoupled": VLLM_PLACEMENT}


def placement_from_names(names: Sequence[str], *, stop_before_last_token: bool = True) -> CheckpointPlacement:
    """A placement from rule names: ``replay_boundary``, ``junction``, ``chunk_ends``,
    ``chunk_grid:K`` (K tokens).

    Raises:
        InvalidSpecError: an unknown name or a bad K.
    """
    boundary = ReplayBoundary(stop_before_last_token=stop_before_last_token)
    rules: list[PlacementRule] = []
    if len(set(names)) != len(names):
        raise InvalidSpecError(f"a placement rule is named twice: {list(names)}")
    for name in names:
        if name == "replay_boundary":
            rules.append(boundary)
        elif name == "junction":
            rules.append(Junction())
        elif name == "chunk_ends":
            rules.append(ChunkEnds(boundary))
        elif name.startswith("chunk_grid:") and name[len("chunk_grid:"):].isdigit():
            rules.append(ChunkGrid(int(name[len("chunk_grid:"):])))
        else:
            raise InvalidSpecError(f"unknown placement rule {name!r}; known: replay_boundary, junction, "
                                   f"chunk_ends, chunk_grid:K")
    return CheckpointPlacement(rules)


def resolve_placement(placement: CheckpointPlacement | Sequence[str] | str | None, layout: str) -> CheckpointPlacement:
    """A coordinator's ``checkpoint_placement=``: a :class:`CheckpointPlacement` as is, rule names
    (a str is split at commas, as ``--placement``), or None for ``DEFAULT_PLACEMENT[layout]``.

    Raises:
        InvalidSpecError: anything else, or a name ``placement_from_names`` refuses.
    """
    if placement is None:
        placement = DEFAULT_PLACEMENT[layout]
    if isinstance(placement, str):
        placement = placement.split(",")
    if isinstance(placement, CheckpointPlacement):
        return placement
    if not isinstance(placement, (list, tuple)):
        raise InvalidSpecError(f"checkpoint_placement must be a CheckpointPlacement or rule names, got {placement!r}")
    return placement_from_names(placement)
