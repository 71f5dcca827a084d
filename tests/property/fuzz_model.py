"""Plain-Python model for the stateful fuzzer: drawn configs, shadow requests, simulated device.

Nothing here reads the library's internals: only its public API and read-only views
(``describe``, ``pending_plan``); the expectations are derived from DESIGN.md, not from the
code under test.

* ``fuzz_configs()``: a hypothesis strategy for a coordinator config: 1-3 groups among full
  attention, sliding window and align-mode Mamba (one ``nspec`` in {0, 1, 3} for all Mamba
  groups), block sizes in {2, 4, 8} (so the LCM alignment differs from every block size), a
  hash block size dividing all of them, a pool where one full-length request always fits and a
  second or third mostly does not (evictions, failed allocations and preemptions are common),
  an async lag in {0, 1, 2}, spec decode on or off, EAGLE back-off on or off.
  ``fuzz_configs(decoupled=True)``: the decoupled layout (issue 14): one block size for every
  group (the page grid), attention pages and Mamba state slots carved from a few superblocks
  of ``k`` in {1, 2, 3} pages, sized as above (one request always fits).
* ``ShadowReq``: what the engine knows of one request (tokens, counts, steps in flight) and
  the block table each group should hold, computed from the rules of DESIGN.md 5 / 5.1.
* ``Device``: one tag per Mamba block, ``(token prefix, position)`` of the state it holds.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from hypothesis import strategies as st

from mambakv import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheCoordinator,
    KVCacheGroupSpec,
    MambaSpec,
    Request,
    SlidingWindowSpec,
)
from mambakv.core.arena import SuperblockGeometry

ALPHABET = (1, 2, 3)  # three token ids: prompts collide on prefixes all the time
MAX_MODEL_LEN = 32
MAX_PROMPT = 24
REQUEST_IDS = tuple(f"r{i}" for i in range(5))  # few ids: they are reused after free
EMPTY = ((), 0)  # tag of a zeroed state: no token seen
GARBAGE = ("garbage",)  # tag of a block whose content is not a known state


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


@dataclass
class FuzzConfig:
    kinds: tuple[str, ...]  # "full" / "swa" / "mamba" per group
    block_sizes: tuple[int, ...]
    windows: tuple[int, ...]  # sliding window per group (0 if not a sliding-window group)
    nspec: int
    hash_block_size: int
    num_blocks: int
    max_lag: int  # steps a request may have executed but not yet retired before its next one
    drafts: bool
    use_eagle: bool
    bases: tuple[tuple[int, ...], ...]  # token sequences prompts are cut from
    #: decoupled layout: (superblocks, pages per superblock); None: unified (one pool)
    superblocks: tuple[int, int] | None = None
    #: decoupled layout: the eviction policy of its units
    eviction: str | None = None

    @property
    def decoupled(self) -> bool:
        return self.superblocks is not None

    def pool_index(self, g: int) -> int:
        """Index in ``coord.pools`` of the pool group g takes blocks from."""
        return 1 if self.superblocks is not None and self.kinds[g] == "mamba" else 0

    @property
    def mamba_gids(self) -> list[int]:
        return [g for g, k in enumerate(self.kinds) if k == "mamba"]

    @property
    def content_checked(self) -> bool:
        """DESIGN.md 5.1: exact states are guaranteed under sync + drafts and async without drafts."""
        return self.max_lag == 0 or not self.drafts

    @property
    def max_drafts(self) -> int:
        return 0 if not self.drafts else (self.nspec if self.mamba_gids else 3)

    def build(self) -> KVCacheCoordinator:
        groups = []
        for g, (kind, bs, w) in enumerate(zip(self.kinds, self.block_sizes, self.windows)):
            if kind == "full":
                spec = FullAttentionSpec(bs, 1, 1, "float16")
            elif kind == "swa":
                spec = SlidingWindowSpec(bs, 1, 1, "float16", sliding_window=w)
            else:
                spec = MambaSpec(bs, ((2, 2),), ("float32",), mode="align", num_speculative_blocks=self.nspec)
            groups.append(KVCacheGroupSpec([f"layer{g}"], spec))
        geo = None
        if self.superblocks is not None:
            n, k = self.superblocks
            geo = SuperblockGeometry(n, k, 4, 4 * k - (k > 1))  # a slot leaves 1 B idle when k > 1
        return KVCacheCoordinator(KVCacheConfig(self.num_blocks, groups, geo), max_model_len=MAX_MODEL_LEN,
                                  use_eagle=self.use_eagle, hash_block_size=self.hash_block_size,
                                  eviction=self.eviction)


@st.composite
def fuzz_configs(draw, mamba: bool | None = None, decoupled: bool = False) -> FuzzConfig:
    """A small hybrid config. `mamba=True` forces at least one Mamba group; `decoupled`: the
    decoupled layout (one block size, pages and slots from superblocks)."""
    kinds = draw(st.lists(st.sampled_from(["full", "swa", "mamba"]), min_size=1, max_size=3))
    if mamba and "mamba" not in kinds:
        kinds[0] = "mamba"
    if decoupled:
        size = draw(st.sampled_from([2, 4, 8]))
        sizes = tuple(size for _ in kinds)
    else:
        sizes = tuple(draw(st.sampled_from([2, 4, 8])) for _ in kinds)
    windows = tuple(draw(st.integers(1, 12)) if k == "swa" else 0 for k in kinds)
    nspec = draw(st.sampled_from([0, 1, 3]))
    hbs = draw(st.sampled_from([d for d in (1, 2, 4, 8) if all(s % d == 0 for s in sizes)]))
    # One request of MAX_MODEL_LEN tokens always fits (its whole prompt as one chunk: every
    # attention block, 2 + nspec states); a second or third one mostly does not.
    one = sum(2 + nspec if k == "mamba" else cdiv(MAX_MODEL_LEN, bs) for k, bs in zip(kinds, sizes))
    superblocks = None
    if decoupled:
        k = draw(st.integers(1, 3))
        pages = sum(cdiv(MAX_MODEL_LEN, bs) for kd, bs in zip(kinds, sizes) if kd != "mamba")
        slots = sum(2 + nspec for kd in kinds if kd == "mamba")
        one = cdiv(max(0, pages - (k - 1)), k) + slots  # superblocks beyond superblock 0
        superblocks = (1 + one + draw(st.integers(0, one)), k)
        num_blocks = superblocks[0] * k
    else:
        num_blocks = 1 + one + draw(st.integers(0, one))
    drafts = draw(st.booleans()) and (nspec > 0 or "mamba" not in kinds)
    bases = tuple(tuple(draw(st.lists(st.sampled_from(ALPHABET), min_size=MAX_PROMPT, max_size=MAX_PROMPT)))
                  for _ in range(2))
    eviction = draw(st.sampled_from(["reuse", "lru"])) if decoupled else None
    return FuzzConfig(tuple(kinds), sizes, windows, nspec, hbs, num_blocks, draw(st.sampled_from([0, 1, 2])),
                      drafts, draw(st.booleans()), bases, superblocks, eviction)


@dataclass
class Step:
    """One scheduled step of one request: ``computed`` tokens before it, ``real`` real tokens
    and ``drafts`` draft tokens scheduled, ``accepted`` drafts the verify will keep."""

    computed: int
    real: int
    drafts: tuple[int, ...] = ()
    accepted: int = 0
    bonus: int = 1

    @property
    def settle_point(self) -> int:
        """Processed tokens once this step's outputs are back (accepted drafts included)."""
        return self.computed + self.real + self.accepted


@dataclass
class ShadowReq:
    """The engine's view of one request plus the block tables DESIGN.md says it holds."""

    rid: str
    request: Request
    num_groups: int
    running: bool = False  # admitted (holds blocks in the coordinator)
    pending_hit: tuple | None = None  # (KVCacheBlocks, hit tokens) from the last lookup
    tables: list[list[int]] = field(default_factory=list)
    running_slot: dict[int, int] = field(default_factory=dict)  # Mamba group -> running slot
    unsettled: deque = field(default_factory=deque)  # executed steps not yet retired
    scheduled: Step | None = None  # allocated this batch, not executed yet
    processed: int = 0
    watermark: dict[int, int] = field(default_factory=dict)
    #: group -> slots below which the table must be null (DESIGN.md 5: skipped tokens // bs; for
    #: Mamba also below the slot holding the state at the processed count, see ``verified``)
    retired: dict[int, int] = field(default_factory=dict)
    #: group -> (settle point, running slot) of executed steps: where the state at that count lives
    verified: dict[int, list] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tables = [[] for _ in range(self.num_groups)]

    @property
    def tokens(self) -> list[int]:
        return self.request.all_token_ids.tolist()

    def steps_in_flight(self) -> int:
        return len(self.unsettled) + (self.scheduled is not None)


def expected_hit_length(cfg: FuzzConfig, cached, num_tokens: int) -> int:
    """Brute force of DESIGN.md 6.1: the longest aligned length valid in every group (then the
    EAGLE back-off, once). ``cached(g, i)``: group g has a live published block for the
    request's first ``(i + 1) * block_size`` tokens. A fixed point of "each group may only
    shorten" is exactly the longest length valid for all groups."""
    align = math.lcm(*cfg.block_sizes)

    def valid(length: int) -> bool:
        for g, (kind, bs, w) in enumerate(zip(cfg.kinds, cfg.block_sizes, cfg.windows)):
            n = length // bs
            if kind == "full":
                need = range(n)
            elif kind == "swa":
                need = range(max(0, n - cdiv(w - 1, bs)), n)
            else:
                need = range(n - 1, n)
            if not all(cached(g, i) for i in need):
                return False
        return True

    def best(cap: int) -> int:
        for length in range(cap // align * align, 0, -align):
            if valid(length):
                return length
        return 0

    length = best(num_tokens - 1)
    if cfg.use_eagle and length > 0:
        length = best(length - align)
    return length


def expected_mamba_table(table: list[int], old_running: int, num_tokens: int, bs: int, nspec: int,
                         new_ids: list[int]) -> tuple[list[int], int, bool]:
    """DESIGN.md 5.1 allocation for one Mamba group, on block ids. Returns (table, running slot,
    grew). `old_running` is -1 for a new request (its table is the hit, ``[0, ..., H]``)."""
    running = cdiv(num_tokens, bs) - 1
    if old_running >= 0 and running <= old_running:
        return table, old_running, False
    table = list(table)
    table += [0] * max(0, running - len(table))
    if old_running >= 0:
        for slot in range(old_running + 1, min(running, old_running + 1 + nspec)):
            table.append(table[slot])
            table[slot] = 0
    return table + list(new_ids), running, True


class Device:
    """Simulated state tensors: ``tags[gid][block_id]`` = ``(token prefix, position)``."""

    def __init__(self, mamba_gids: list[int]) -> None:
        self.tags: dict[int, dict[int, tuple]] = {g: {} for g in mamba_gids}

    def tag(self, gid: int, block_id: int) -> tuple:
        return self.tags[gid].get(block_id, GARBAGE)

    def copy(self, gid: int, pairs: list[tuple[int, int]]) -> None:
        """Batched gather/scatter: every read happens before any write. Asserts the plan is
        safe to batch: no destination twice, no pair reads what another pair writes."""
        dsts = [d for _, d in pairs]
        assert len(set(dsts)) == len(dsts), f"COPY PLAN writes a block twice: {pairs}"
        assert not set(dsts) & {s for s, _ in pairs}, f"COPY PLAN reads a block it writes: {pairs}"
        assert 0 not in dsts and all(s != 0 for s, _ in pairs), f"COPY PLAN touches the null block: {pairs}"
        vals = [self.tag(gid, s) for s, _ in pairs]
        for (_, d), v in zip(pairs, vals):
            self.tags[gid][d] = v
