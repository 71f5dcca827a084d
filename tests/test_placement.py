"""Checkpoint placement (mambakv.placement, issue 14 deliverable 3), through the public API:
``KVCacheCoordinator(checkpoint_placement=...)``, ``next_chunk_end``, ``get_computed_blocks``
and the reference scheduler.

Published states are read back with probes: a probe ``prompt[:p] + [x]`` (p + 1 tokens, never
allocated) hits at most ``p`` (the cap ``num_tokens - 1``), and hits exactly ``p`` iff a state
keyed on ``prompt[:p]`` is published (the prompt's own attention pages cover it).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mambakv import InvalidSpecError, InvalidTokenCountError, KVCacheCoordinator, Request
from mambakv.coordinator import DEFAULT_PLACEMENT
from mambakv.placement import (
    VLLM_PLACEMENT,
    CheckpointPlacement,
    ChunkEnds,
    ChunkGrid,
    Junction,
    ReplayBoundary,
    placement_from_names,
)
from mambakv.sim.chunking import prefill_chunk
from tests.coord_helpers import coordinator, fa_spec
from tests.helpers import mamba_spec

PROBE_TOKEN = 777_777  # never in a prompt below


def hybrid(block: int = 16, mamba_block: int | None = None, num_blocks: int = 64, **kw) -> KVCacheCoordinator:
    """Full attention (block `block`) + one align-mode Mamba group (block `mamba_block`)."""
    return coordinator(num_blocks, fa_spec(block), mamba_spec(mamba_block or block), **kw)


def drive(coord: KVCacheCoordinator, req: Request, budget: int) -> tuple[int, list[int]]:
    """Prefill `req` alone, one chunk per step, each ending at ``next_chunk_end``; retire each
    chunk before the next (synchronous engine). Returns (hit, chunk ends)."""
    blocks, hit = coord.get_computed_blocks(req)
    ends: list[int] = []
    c = hit
    while c < req.num_tokens:
        end = coord.next_chunk_end(req, budget, num_computed_tokens=c)
        assert end > c
        if not ends:
            out = coord.allocate(req, end - c, num_new_computed_tokens=hit, new_computed_blocks=blocks)
        else:
            out = coord.allocate(req, end - c)
        assert out is not None
        req.num_computed_tokens = end
        coord.retire(req.request_id, end)
        ends.append(end)
        c = end
    coord.check_invariants()
    return hit, ends


def published(coord: KVCacheCoordinator, toks: list[int]) -> list[int]:
    """Positions p (multiples of the alignment, < len(toks)) where a state keyed on toks[:p] is
    published (see the module docstring)."""
    a = coord.alignment_tokens
    return [p for p in range(a, len(toks), a)
            if coord.get_computed_blocks(Request(f"probe{p}", toks[:p] + [PROBE_TOKEN]))[1] == p]


# ---------------------------------------------------------------- 1. the docstring's worked example
TARGET = list(range(1, 101))                       # N = 100
EARLIER = TARGET[:48] + list(range(5000, 5022))    # 70 tokens, shares exactly TARGET[:48]


@pytest.mark.parametrize("rules, ends, states", [
    # A = 16, N = 100, T = 99 // 16 * 16 = 96, budget 40, J = 48, hit 0.
    # chunk_ends + replay_boundary: limits 40 -> 32 (grid), 72 -> 64, 104|100 -> 96 (grid = T), then 100.
    (["chunk_ends", "replay_boundary"], [32, 64, 96, 100], [32, 64, 96]),
    # + junction: 0 -> 32; from 32 limit 72: grid 64, J 48 -> 48; from 48 limit 88 -> 80;
    # from 80 limit 100 -> 96 (T); 100.
    (["chunk_ends", "replay_boundary", "junction"], [32, 48, 80, 96, 100], [32, 48, 80, 96]),
    # replay_boundary + junction: 0 -> 40 (nothing proposed <= 40); 40 -> J 48; 48 -> 88;
    # 88 -> T 96; 100. States only on the grid: 48, 96 (40 and 88 are off it).
    (["replay_boundary", "junction"], [40, 48, 88, 96, 100], [48, 96]),
])
def test_docstring_worked_example(rules, ends, states):
    coord = hybrid(checkpoint_placement=rules)
    assert coord.chunk_alignment == 16 and coord.checkpoint_placement.names == tuple(rules)
    # EARLIER alone, budget 100: limit 70, T = 69 // 16 * 16 = 64 (chunk_ends: 70 // 16 * 16 = 64
    # too; no junction: nothing cached yet) -> chunks end 64, 70: one state, at 64, keyed on
    # EARLIER's tokens 48..63, which TARGET does not share.
    assert drive(coord, Request("E", EARLIER), 100) == (0, [64, 70])
    coord.free("E")
    assert published(coord, EARLIER) == [64]
    t = Request("T", TARGET)
    # attention caches EARLIER's blocks 0..2 (= TARGET[:48]); no Mamba state of TARGET's prefix
    assert coord.get_shared_prefix_length(t) == 48 and coord.get_computed_blocks(t)[1] == 0
    assert drive(coord, t, 40) == (0, ends)
    assert published(coord, TARGET) == states
    coord.free("T")
    coord.check_invariants()


# ---------------------------------------------------------------- 2. equivalence with chunking.prefill_chunk
_EQ_TARGET = list(range(1, 201))
_EQ_COORDS: dict[tuple[int, bool], KVCacheCoordinator] = {}


def _coord_with_junction(j: int, stop_before_last_token: bool) -> KVCacheCoordinator:
    """A coordinator (A = 16, VLLM_PLACEMENT) whose attention caches exactly _EQ_TARGET[:j]
    (an earlier request of ``j + 1`` tokens diverging at j, allocated in one chunk and freed)."""
    key = (j, stop_before_last_token)
    if key not in _EQ_COORDS:
        coord = hybrid(num_blocks=64, checkpoint_placement=placement_from_names(
            VLLM_PLACEMENT, stop_before_last_token=stop_before_last_token))
        if j:
            e = Request("E", _EQ_TARGET[:j] + [PROBE_TOKEN])
            assert coord.allocate(e, j + 1) is not None
            coord.free("E")
        _EQ_COORDS[key] = coord
    return _EQ_COORDS[key]


@st.composite
def chunk_cases(draw):
    n = draw(st.integers(1, 200))
    computed = draw(st.integers(0, n - 1))
    budget = draw(st.integers(1, 120))
    # a junction is a shared-prefix length: aligned, at most (N - 1) // 16 * 16 (0: none)
    j = 16 * draw(st.integers(0, (n - 1) // 16))
    return computed, n, budget, j


@pytest.mark.parametrize("stop_before_last_token", [True, False])
@settings(max_examples=300, deadline=None)
@given(case=chunk_cases())
def test_vllm_placement_equals_prefill_chunk(stop_before_last_token, case):
    computed, n, budget, j = case
    coord = _coord_with_junction(j, stop_before_last_token)
    req = Request("q", _EQ_TARGET[:n])  # never allocated: the junction is looked up on each call
    assert coord.get_shared_prefix_length(req) == j
    end = coord.next_chunk_end(req, budget, num_computed_tokens=computed)
    assert end - computed == prefill_chunk(computed, n, budget, align=16,
                                           stop_before_last_token=stop_before_last_token, junction=j)


class _FixedJunction:
    """PrefixQueries stub: a fixed shared-prefix length, no request holds blocks."""

    def __init__(self, j: int) -> None:
        self.j = j

    def get_shared_prefix_length(self, request: Request) -> int:
        return self.j

    def holds_blocks(self, request_id: str) -> bool:
        return False


@pytest.mark.parametrize("stop_before_last_token", [True, False])
def test_vllm_placement_equals_prefill_chunk_exhaustive_small(stop_before_last_token):
    """Every (computed, N <= 40, budget, J) with A = 8, through CheckpointPlacement.chunk_end."""
    placement = placement_from_names(VLLM_PLACEMENT, stop_before_last_token=stop_before_last_token)
    for n in range(1, 41):
        req = Request("q", list(range(1, n + 1)))
        for j in range(0, (n - 1) // 8 * 8 + 1, 8):
            q = _FixedJunction(j)
            for computed in range(n):
                for budget in (1, 3, 7, 8, 9, 15, 16, 17, 24, 40):
                    end = placement.chunk_end(q, req, computed, budget, 8)
                    assert end - computed == prefill_chunk(
                        computed, n, budget, align=8, stop_before_last_token=stop_before_last_token,
                        junction=j), (n, j, computed, budget)


def test_default_placement_is_vllm():
    assert DEFAULT_PLACEMENT["unified"] == VLLM_PLACEMENT == ("chunk_ends", "replay_boundary", "junction")
    assert hybrid().checkpoint_placement.names == VLLM_PLACEMENT


# ---------------------------------------------------------------- 3. the hand case: blocks 4 / 8
S = list(range(1, 25))  # 24 shared tokens


def _tail(start: int) -> list[int]:
    return list(range(start, start + 10))


@pytest.mark.parametrize("rules, b_ends, c_hit", [
    # with the junction: B's chunks end 16, 24 (J), 32 (T), 34; C hits B's state at 24
    (VLLM_PLACEMENT, [16, 24, 32, 34], 24),
    # without it: 16, 32, 34; C hits B's state at 16 only
    (("chunk_ends", "replay_boundary"), [16, 32, 34], 16),
])
def test_hand_case_block_4_and_8(rules, b_ends, c_hit):
    # attention block 4, Mamba block 8: alignment lcm(4, 8) = 8, hash blocks of 4 tokens.
    coord = hybrid(4, 8, num_blocks=128, checkpoint_placement=rules)
    assert coord.alignment_tokens == coord.chunk_alignment == 8 and coord.hash_block_size == 4
    a, b, c = (Request(r, S + _tail(s)) for r, s in (("A", 100), ("B", 200), ("C", 300)))  # N = 34 each
    # A alone, budget 64: limit 34, T = 33 // 8 * 8 = 32, grid 34 // 8 * 8 = 32 -> ends 32, 34:
    # one state, at 32 (keyed on A's tail); attention pages 0..7 (32 tokens) published.
    assert drive(coord, a, 64) == (0, [32, 34])
    coord.free("A")
    assert published(coord, S + _tail(100)) == [32]
    # B shares S with A: attention pages 0..5 (24 tokens), aligned to 8 -> junction 24; no
    # Mamba state of S -> hit 0.
    assert coord.get_shared_prefix_length(b) == 24 and coord.get_computed_blocks(b)[1] == 0
    # B, budget 20. With the junction: 0 -> limit 20 -> grid 16; 16 -> limit 34|36: grid 32,
    # T 32, J 24 -> 24; 24 -> limit 34|44: 32; 32 -> 34. Without: 16, 32, 34.
    assert drive(coord, b, 20) == (0, b_ends)
    coord.free("B")
    assert published(coord, S + _tail(200)) == b_ends[:-1]  # every end but 34 is on the grid
    # C shares S: the longest state of its prefix is B's at 24 (junction) or at 16 (without).
    assert coord.get_shared_prefix_length(c) == 24
    assert coord.get_computed_blocks(c)[1] == c_hit
    coord.check_invariants()


# ---------------------------------------------------------------- 4. chunk_grid, names, engine rules
def test_chunk_grid_states_every_k_tokens():
    # chunk_grid:32 alone, A = 16, N = 100, budget 20: 0 -> 20 (no multiple of 32 <= 20);
    # 20 -> 32; 32 -> 52; 52 -> 64; 64 -> 84; 84 -> 96; 96 -> 100. States: 32, 64, 96 only
    # (20, 52, 84 off the 16-grid; 100 too).
    coord = hybrid(checkpoint_placement=["chunk_grid:32"])
    assert drive(coord, Request("T", TARGET), 20) == (0, [20, 32, 52, 64, 84, 96, 100])
    assert published(coord, TARGET) == [32, 64, 96]
    # chunk_grid:48 with budget 100: 48, 96, 100 -> states at 48, 96
    coord = hybrid(checkpoint_placement=["chunk_grid:48"])
    assert drive(coord, Request("T", TARGET), 100) == (0, [48, 96, 100])
    assert published(coord, TARGET) == [48, 96]


@pytest.mark.parametrize("k", [8, 24, 40])
def test_chunk_grid_not_a_multiple_of_the_alignment_raises(k):
    with pytest.raises(InvalidSpecError):
        coord = hybrid(checkpoint_placement=[f"chunk_grid:{k}"])  # alignment 16
        coord.next_chunk_end(Request("T", TARGET), 40)


@pytest.mark.parametrize("names", [["foo"], ["junction", "Junction"], ["chunk_grid"], ["chunk_grid:"],
                                   ["chunk_grid:0"], ["chunk_grid:-16"], ["chunk_grid:x"], ["chunk_grid:1.5"]])
def test_unknown_or_bad_rule_names_raise(names):
    with pytest.raises(InvalidSpecError):
        placement_from_names(names)
    with pytest.raises(InvalidSpecError):
        hybrid(checkpoint_placement=names)


@pytest.mark.parametrize("every", [0, -16, 1.5, "16", None])
def test_chunk_grid_bad_count_raises(every):
    with pytest.raises(InvalidSpecError):
        ChunkGrid(every)


class Every64:
    """An engine's own rule: a state at 64 (any object with name / propose / forget)."""

    name = "every_64"

    def __init__(self) -> None:
        self.forgotten: list[str] = []

    def propose(self, coord, request, computed, limit, align):
        return 64 if computed < 64 <= limit else None

    def forget(self, request_id: str) -> None:
        self.forgotten.append(request_id)


def test_custom_engine_rule_composes():
    rule = Every64()
    placement = CheckpointPlacement([ReplayBoundary(), rule])
    assert placement.names == ("replay_boundary", "every_64") and placement.junction("T") == 0
    coord = hybrid(checkpoint_placement=placement)
    assert coord.checkpoint_placement is placement
    # N = 100, budget 100: 64 (the rule) < T = 96 -> 64; 64 -> 96 (T); 100. States: 64, 96.
    assert drive(coord, Request("T", TARGET), 100) == (0, [64, 96, 100])
    assert published(coord, TARGET) == [64, 96]
    coord.free("T")
    assert rule.forgotten == ["T"]  # free() tells every rule


def test_rule_objects_compose_like_names():
    # ChunkEnds + ReplayBoundary + Junction objects = VLLM_PLACEMENT (the worked example's ends)
    boundary = ReplayBoundary()
    coord = hybrid(checkpoint_placement=CheckpointPlacement([Junction(), ChunkEnds(boundary), boundary]))
    assert drive(coord, Request("E", EARLIER), 100) == (0, [64, 70])
    coord.free("E")
    assert drive(coord, Request("T", TARGET), 40) == (0, [32, 48, 80, 96, 100])


# ---------------------------------------------------------------- 5. junction bookkeeping
def test_free_forgets_the_junction():
    coord = hybrid()  # VLLM_PLACEMENT
    assert drive(coord, Request("E", EARLIER), 100) == (0, [64, 70])
    coord.free("E")
    x = Request("x", TARGET)
    # first chunk: limit 40, grid 32 -> 32; the junction (48) is looked up and kept
    assert coord.next_chunk_end(x, 40, num_computed_tokens=0) == 32
    assert coord.checkpoint_placement.junction("x") == 48
    assert coord.allocate(x, 32) is not None
    x.num_computed_tokens = 32
    assert coord.next_chunk_end(x, 40) == 48
    coord.free("x")
    assert coord.checkpoint_placement.junction("x") == 0  # forgotten
    # the id reused for an unrelated prompt: a fresh lookup finds no shared prefix -> no stop at 48
    y = Request("x", list(range(9000, 9100)))
    assert coord.get_shared_prefix_length(y) == 0
    # replay_boundary + chunk_ends only: 0 -> limit 60 -> 48 by the grid, so ask from 32:
    # limit 72 -> grid 64 (a stale junction 48 would end it at 48)
    assert coord.next_chunk_end(y, 40, num_computed_tokens=32) == 64
    assert coord.checkpoint_placement.junction("x") == 0


def test_junction_is_kept_while_the_request_holds_blocks():
    # replay_boundary + junction (no grid: a junction is the only stop below T = 96)
    coord = hybrid(checkpoint_placement=["replay_boundary", "junction"])
    x = Request("x", TARGET)
    assert coord.next_chunk_end(x, 20, num_computed_tokens=0) == 20  # nothing shared: J = 0
    assert coord.allocate(x, 20) is not None
    x.num_computed_tokens = 20
    coord.retire("x", 20)
    # another request (one 70-token chunk) now caches TARGET[:48]; x holds blocks, so its
    # junction (0) is kept
    assert coord.allocate(Request("E", EARLIER), 70) is not None
    coord.free("E")
    assert coord.get_shared_prefix_length(Request("x2", TARGET)) == 48
    assert coord.next_chunk_end(x, 40) == 60  # not 48
    assert coord.checkpoint_placement.junction("x") == 0


def test_refused_allocate_then_retry_looks_the_junction_up_again():
    rules = ["replay_boundary", "junction"]
    probe = hybrid(checkpoint_placement=rules)
    need_e = probe.num_blocks_needed(Request("E", EARLIER), 70)
    need_x = probe.num_blocks_needed(Request("x", TARGET), 60)
    coord = hybrid(num_blocks=1 + need_e + need_x - 1, checkpoint_placement=rules)  # E or x, not both
    x = Request("x", TARGET)
    # admission: nothing cached -> J = 0; limit 60, T = 96 -> 60
    assert coord.next_chunk_end(x, 60) == 60 and coord.checkpoint_placement.junction("x") == 0
    e = Request("E", EARLIER)
    assert coord.allocate(e, 70) is not None  # E caches TARGET[:48] (and more of its own)
    assert coord.allocate(x, 60) is None and not coord.holds_blocks("x")  # refused: nothing changed
    coord.free("E")
    # the retry is an admission again: J = get_shared_prefix_length = 48 now
    assert coord.get_computed_blocks(x)[1] == 0
    assert coord.next_chunk_end(x, 60) == 48
    assert coord.checkpoint_placement.junction("x") == 48
    assert coord.allocate(x, 48) is not None
    coord.check_invariants()


@pytest.mark.parametrize("make", [
    lambda: coordinator(64, fa_spec(16)),                                   # attention only
    lambda: coordinator(64, fa_spec(16), mamba_spec(16, mode="none")),      # Mamba without caching
    lambda: hybrid(enable_caching=False),                                   # no prefix caching
    lambda: coordinator(64, mamba_spec(16), enable_caching=False),
])
def test_no_align_mamba_group_chunk_is_the_budget(make):
    coord = make()
    assert coord.chunk_alignment == 0
    req = Request("r", TARGET)
    for computed in (0, 1, 15, 16, 47, 95, 99):
        for budget in (0, 1, 16, 40, 100, 1000):
            assert coord.next_chunk_end(req, budget, num_computed_tokens=computed) == min(computed + budget, 100)


@pytest.mark.parametrize("budget", [-1, 1.5, "8", None, True])
def test_bad_budget_raises(budget):
    coord = hybrid()
    with pytest.raises(InvalidTokenCountError):
        coord.next_chunk_end(Request("r", TARGET), budget)
    if budget is not None:  # num_computed_tokens=None is the default (request.num_computed_tokens)
        with pytest.raises(InvalidTokenCountError):
            coord.next_chunk_end(Request("r", TARGET), 16, num_computed_tokens=budget)


# ---------------------------------------------------------------- 6. the scheduler on a trace
def _write_trace(path, rows):
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# Hash ids are 512-token blocks: A, B, C share ids 1, 2 = their first 1024 tokens; 2048 each.
TRACE = [{"timestamp": 0, "input_length": 2048, "output_length": 1, "hash_ids": [1, 2, 3, 4]},
         {"timestamp": 10, "input_length": 2048, "output_length": 1, "hash_ids": [1, 2, 5, 6]},
         {"timestamp": 20, "input_length": 2048, "output_length": 1, "hash_ids": [1, 2, 7, 8]}]


@pytest.mark.parametrize("layout, rules, cached", [
    # unified (qwen3-next): A = 544. A: T = 2047 // 544 * 544 = 1632 -> ends 1632, 2048, a state
    # at 1632 (A's). B: attention shares 1024 // 544 * 544 = 544 tokens, no state -> hit 0,
    # junction 544: ends 544, 1632, 2048, states at 544 and 1632. C: B's state at 544 -> 544.
    ("unified", ["replay_boundary", "junction"], 544),
    ("unified", ["replay_boundary"], 0),  # without the junction B publishes only at 1632 -> C 0
    # decoupled: 64-token pages, A = 64. A: T = 2047 // 64 * 64 = 1984 -> a state at 1984. B:
    # shares 1024 = 16 pages, hit 0, junction 1024: ends 1024, 1984, 2048. C hits 1024.
    ("decoupled", ["replay_boundary", "junction"], 1024),
    ("decoupled", ["replay_boundary"], 0),
])
def test_trace_junction_hit(tmp_path, layout, rules, cached):
    from mambakv.sim.runner import run_trace

    path = _write_trace(tmp_path / "t.jsonl", TRACE)
    res = run_trace(path, one_at_a_time=True, layout=layout, placement=rules)
    assert res.coord.checkpoint_placement.names == tuple(rules)
    assert res.metrics.finished == 3
    assert res.metrics.cached_tokens == cached
    # steps (budget 8192): A 2; B 3 with the junction, 2 without; C: 2 from its hit (544 -> 1632
    # -> 2048 / 1024 -> 1984 -> 2048) or 2 from 0 (T, then the end)
    assert res.metrics.steps == (7 if "junction" in rules else 6)


def test_scheduler_old_stop_rule_keeps_an_engine_rule():
    # Scheduler(stop_before_last_token=False) switches the replay boundaries in place: the
    # engine's own rule object stays, and so does the placement object (with its junctions).
    from mambakv.sim import Scheduler

    rule, boundary = Every64(), ReplayBoundary()
    placement = CheckpointPlacement([boundary, rule])
    coord = hybrid(checkpoint_placement=placement)
    Scheduler(coord, stop_before_last_token=False)
    assert coord.checkpoint_placement is placement and rule in placement.rules
    assert boundary.stop_before_last_token is False and boundary.stop(96, 16) == 96  # N - N % A, not 80


def test_next_chunk_end_refuses_more_computed_than_tokens():
    coord = hybrid()
    req = Request("r", list(range(100)))
    with pytest.raises(InvalidTokenCountError):
        coord.next_chunk_end(req, 10, num_computed_tokens=150)


def test_chunk_grid_checked_when_the_coordinator_is_built():
    with pytest.raises(InvalidSpecError, match="not a multiple"):
        hybrid(checkpoint_placement=["chunk_grid:24"])
