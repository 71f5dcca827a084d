"""The engine-facing calls of issue 30 that need no per-request bookkeeping in the engine:
``get_blocks``, a capped ``get_computed_blocks``, ``make_prefix_cache_stats``,
``retire(..., num_accepted_drafts=)`` with ``take_verify_copies``, ``update_from_output``, and the
admission gates of ``can_allocate`` (the whole prompt, a watermark) in both layouts."""

from __future__ import annotations

import numpy as np
import pytest

from mambakv import (
    FullAttentionSpec,
    InvalidRequestError,
    InvalidSpecError,
    InvalidTokenCountError,
    KVCacheConfig,
    KVCacheCoordinator,
    KVCacheGroupSpec,
    MambaSpec,
    Request,
)
from mambakv.core.arena import SuperblockGeometry
from mambakv.sim import RequestSpec, run_workload
from tests.helpers import STATE_DTYPES, STATE_SHAPES

BS = 16
ATTN = FullAttentionSpec(BS, num_kv_heads=1, head_size=8, dtype="bfloat16")


def build(num_blocks: int = 40, nspec: int = 2, layout: str = "unified") -> KVCacheCoordinator:
    mamba = MambaSpec(BS, STATE_SHAPES, STATE_DTYPES, mode="align", num_speculative_blocks=nspec)
    groups = [KVCacheGroupSpec(["a"], ATTN), KVCacheGroupSpec(["m"], mamba)]
    if layout == "unified":
        return KVCacheCoordinator(KVCacheConfig(num_blocks, groups), max_model_len=512)
    geo = SuperblockGeometry(num_blocks, 1, ATTN.page_size_bytes, mamba.raw_page_size_bytes)
    return KVCacheCoordinator(KVCacheConfig(geo.num_pages, groups, geo), max_model_len=512)


def run_prompt(coord: KVCacheCoordinator, rid: str, prompt: list[int]) -> Request:
    req = Request(rid, prompt)
    blocks, hit = coord.get_computed_blocks(req)
    assert coord.allocate(req, len(prompt) - hit, num_new_computed_tokens=hit, new_computed_blocks=blocks,
                          num_draft_tokens=0) is not None
    req.num_computed_tokens = len(prompt)
    coord.retire(rid, len(prompt))
    return req


def test_get_blocks_returns_copies_of_the_tables() -> None:
    coord = build()
    run_prompt(coord, "a", list(range(40)))
    blocks = coord.get_blocks("a")
    assert blocks.get_block_ids() == coord.get_block_ids("a")
    blocks.blocks[0].append(coord.block_pool.null_block)  # a copy: the table is unchanged
    assert coord.get_block_ids("a")[0] == [1, 2, 3]
    assert coord.get_blocks("none").get_block_ids() == ([], [])
    with pytest.raises(InvalidRequestError):
        coord.get_blocks(7)  # type: ignore[arg-type]


def test_a_capped_hit() -> None:
    """A 64-token prompt in chunks of 16, each retired, publishes states at 16, 32, 48 and 64. A
    repeat of 70 tokens hits 64 (the deepest state below 69); capped at 40 tokens it hits 32."""
    coord = build(60)
    req = Request("a", list(range(64)))
    for end in (16, 32, 48, 64):
        assert coord.allocate(req, end - req.num_computed_tokens, num_draft_tokens=0) is not None
        req.num_computed_tokens = end
        coord.retire("a", end)
    again = Request("b", list(range(64)) + [1, 2, 3, 4, 5, 6])
    assert coord.get_computed_blocks(again)[1] == 64
    assert coord.get_computed_blocks(again, max_length=40)[1] == 32
    assert coord.get_computed_blocks(again, max_length=0)[1] == 0
    with pytest.raises(InvalidTokenCountError):
        coord.get_computed_blocks(again, max_length=-1)


def test_make_prefix_cache_stats_takes_and_resets() -> None:
    coord = build(60)
    run_prompt(coord, "a", list(range(40)))
    stats = coord.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (1, 40, 0)
    assert coord.prefix_cache_stats.requests == 0
    run_prompt(coord, "b", list(range(40)))
    assert coord.make_prefix_cache_stats().requests == 1


@pytest.mark.parametrize("accepted", [0, 1, 2])
def test_retire_with_accepted_drafts_equals_accept_then_retire(accepted: int) -> None:
    """Two coordinators, one step of 1 + 2 drafts after a 32-token prompt: side A calls
    accept_drafts then retire, side B retire(..., num_accepted_drafts=). Same tables, same
    copies (B's through take_verify_copies), same published states afterwards."""
    sides = []
    for one_call in (False, True):
        coord = build(60)
        req = run_prompt(coord, "a", list(range(32)))
        req.append_output_token_ids([5])
        assert coord.allocate(req, 3, num_draft_tokens=2) is not None
        coord.take_step_plan()
        req.num_computed_tokens = 32 + 1 + accepted
        req.append_output_token_ids([6] * accepted)
        if one_call:
            coord.retire("a", 32 + 1 + accepted, num_accepted_drafts=accepted)
            copies = coord.take_verify_copies()
        else:
            copies = coord.accept_drafts("a", accepted)
            coord.retire("a", 32 + 1 + accepted)
        coord.check_invariants()
        sides.append((copies, coord.get_block_ids("a"), coord.describe("a")))
    assert sides[0] == sides[1]
    assert (sides[0][0] != {}) == (accepted > 0)


def test_update_from_output_settles_a_step() -> None:
    coord = build(60)
    a, b = Request("a", list(range(20))), Request("b", list(range(100, 140)))
    for r in (a, b):
        assert coord.allocate(r, r.num_prompt_tokens, num_draft_tokens=0) is not None
        r.num_computed_tokens = r.num_prompt_tokens
    a.append_output_token_ids([1])
    assert coord.allocate(a, 2, num_draft_tokens=1) is not None
    a.num_computed_tokens = 22
    coord.update_from_output({"a": (21, 0), "b": (40, None)})  # a's draft rejected
    assert coord.take_verify_copies() == {}
    view = coord.describe("a")
    assert view is not None and view.tables[1].verify_steps == ()
    coord.check_invariants()


@pytest.mark.parametrize("layout", ["unified", "decoupled"])
def test_admission_gates(layout: str) -> None:
    """40 blocks (unified) or 40 one-page superblocks (decoupled): 39 usable. A 300-token
    prompt's whole prompt needs 19 attention blocks + 1 + 2 Mamba blocks = 22 <= 39; its first
    chunk of 64 needs 4 + 3 = 7. After a 320-token request holds 20 + 3 = 23, 16 are free: the
    first chunk fits, the whole prompt (22) does not; a watermark of 0.25 keeps ceil(0.25 x 39) =
    10 free (unified; decoupled: a quarter of 40 pages of budget, 10), so 7 + 10 > 16 fails."""
    coord = build(40, 2, layout)
    big = Request("big", list(range(1000, 1320)))
    assert coord.allocate(big, 320, num_draft_tokens=0) is not None
    new = Request("n", list(range(300)))
    assert coord.can_allocate(new, 64)
    assert not coord.can_allocate(new, 64, whole_prompt=True)
    assert not coord.can_allocate(new, 64, watermark=0.25)
    assert coord.can_allocate(new, 64, watermark=0.2)  # ceil(0.2 x 39) = 8 (decoupled 8): 7 + 8 <= 16
    coord.free("big")
    assert coord.can_allocate(new, 64, whole_prompt=True, watermark=0.25)
    for bad in (1.0, -0.1, "0.1", True):
        with pytest.raises(InvalidSpecError):
            coord.can_allocate(new, 64, watermark=bad)  # type: ignore[arg-type]


def free_cached_order(coord: KVCacheCoordinator) -> list[int]:
    """The cached (hashed) free blocks in eviction order (the queue's head first)."""
    return [b.block_id for b in coord.block_pool.free_block_queue.get_all_free_blocks() if b.block_hash is not None]


@pytest.mark.parametrize("one_call", [True, False], ids=["free-with-processed", "retire-then-free"])
def test_free_with_processed_tokens_frees_in_one_order(one_call: bool) -> None:
    """A 48-token prompt then one decode token (attention and Mamba blocks of 16, no drafts).
    By hand: the prompt step takes attention 1, 2, 3 and Mamba 4 (running slot 2, its state at
    48 tagged); the decode step publishes state 4 (48 processed), takes attention 5 and Mamba 6
    (the running slot moves to 3, copy 4 -> 6): tables [1 2 3 5] and [0 0 4 6]. The decode's
    output comes back (49 processed) and the request finishes. ``free(a,
    num_processed_tokens=49)`` frees the tables whole, attention deepest first, then Mamba:
    cached blocks in eviction order 3 2 1 4, so the state at 48 goes after the attention
    blocks it needs (vLLM's order). Retiring 49 first frees slot 2's state 4 on its own,
    ahead of them: 4 3 2 1, the state is evicted first."""
    coord = build(nspec=0)
    req = run_prompt(coord, "a", list(range(48)))
    assert coord.get_block_ids("a") == ([1, 2, 3], [0, 0, 4])
    req.append_output_token_ids(7)
    assert coord.allocate(req, 1, num_draft_tokens=0) is not None
    req.num_computed_tokens = 49
    assert coord.get_block_ids("a") == ([1, 2, 3, 5], [0, 0, 4, 6])
    assert coord.block_pool.blocks[4].block_hash is not None  # the state at 48, published
    if one_call:
        coord.free("a", num_processed_tokens=49)
        assert free_cached_order(coord) == [3, 2, 1, 4]
    else:
        coord.retire("a", 49)
        coord.free("a")
        assert free_cached_order(coord) == [4, 3, 2, 1]
    coord.check_invariants()


def test_free_with_processed_tokens_checks_the_count_first() -> None:
    """More processed tokens than were scheduled is refused before anything is freed."""
    coord = build(nspec=0)
    run_prompt(coord, "a", list(range(48)))
    with pytest.raises(InvalidTokenCountError):
        coord.free("a", num_processed_tokens=49)
    assert coord.get_block_ids("a") == ([1, 2, 3], [0, 0, 4])
    coord.free("a", num_processed_tokens=48)  # the prompt step's outputs: published already
    assert free_cached_order(coord) == [3, 2, 1, 4] and not coord.holds_blocks("a")


def test_reference_scheduler_frees_a_finished_request_in_one_order() -> None:
    """The reference scheduler finishes a request with ``free(..., num_processed_tokens=)``.
    A 48-token prompt and 2 outputs (blocks of 16, no drafts). By hand: the scheduler's
    placement ends the first chunk at 32 (attention 1, 2; Mamba running block 3), then 16
    tokens (attention 4, Mamba 5: the state at 32 in 3 is published), then the decode token
    (attention 6, Mamba 7; retiring 48 publishes the state at 48 in 5 and frees 3, the state
    at 32, which stays cached). Tables at the finish: [1 2 4 6], [0 0 5 7]; 49 processed. The
    cached free blocks in eviction order: 3, then attention deepest first 4 2 1, then the
    state at 48, 5 (vLLM's order): [3, 4, 2, 1, 5]. Retiring 49 before the free put 5 ahead
    of the attention blocks: [3, 5, 4, 2, 1], the deepest state evicted first."""
    coord = build(nspec=0)
    prompt = np.arange(48, dtype=np.int32)
    spec = RequestSpec("a", 0.0, 48, 2, lambda: prompt, output_token_ids=np.array([7, 8], dtype=np.int32))
    result = run_workload(coord, [spec], one_at_a_time=True)
    assert result.to_dict()["finished"] == 1 and not coord.holds_blocks("a")
    assert free_cached_order(coord) == [3, 4, 2, 1, 5]
    coord.check_invariants()


@pytest.mark.parametrize("processed", [48, None])
def test_free_with_processed_tokens_publishes_what_they_settle(processed: int | None) -> None:
    """A 48-token prompt allocated (attention 1, 2, 3; Mamba running block 4, its state at 48
    tagged) and never retired. The attention blocks are published at the allocation (their KV
    is written before it is read); the state at 48 only once 48 tokens are processed. So
    ``free(a, num_processed_tokens=48)`` publishes it, then frees the tables whole: cached
    blocks in eviction order 3 2 1 4. Without the count the state was never settled: 3 2 1."""
    coord = build(nspec=0)
    req = Request("a", list(range(48)))
    assert coord.allocate(req, 48, num_draft_tokens=0) is not None
    assert coord.get_block_ids("a") == ([1, 2, 3], [0, 0, 4])
    coord.free("a", num_processed_tokens=processed)
    if processed is None:
        assert free_cached_order(coord) == [3, 2, 1] and coord.block_pool.blocks[4].block_hash is None
    else:
        assert free_cached_order(coord) == [3, 2, 1, 4]
        assert coord.block_pool.blocks[4].block_hash == req.block_hashes[2]
    coord.check_invariants()


def test_retire_checks_its_count_before_it_accepts_a_verify() -> None:
    """A 48-token prompt, one real token and 2 drafts scheduled (51 tokens, 49 known). Before
    the fix ``retire("a", 1000, num_accepted_drafts=1)`` accepted the verify, then refused the
    count: the error left the verify settled. Now nothing changes, and the same verify is
    accepted by the next good call (49 + 1 accepted = 50 processed needs the draft appended)."""
    coord = build(nspec=2)
    req = run_prompt(coord, "a", list(range(48)))
    req.append_output_token_ids(7)
    assert coord.allocate(req, 3, num_draft_tokens=2) is not None
    before = coord.describe("a")
    with pytest.raises(InvalidTokenCountError, match="at most 49 can be"):
        coord.retire("a", 1000, num_accepted_drafts=1)
    assert coord.describe("a") == before
    req.append_output_token_ids(8)
    coord.retire("a", 50, num_accepted_drafts=1)
    assert coord.describe("a") != before
    coord.check_invariants()
