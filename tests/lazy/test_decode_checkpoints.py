"""MambaSpec.decode_checkpoints (issue 16): every / latest / none, values worked out by hand.

The manager-level walk (block 4, 1 draft, a 3-token prompt, synchronous; ``R`` running, ``S``
scratch, ``C`` a checkpoint block taken at verify, ``0`` null)::

    step  computed -> tokens  table after plan  verify  copies         effect
    A     3 -> 5              0 R S             0       R -> C         end 4: crossed on R; C published (key 0)
    B     4 -> 6              0 R S             1       S -> R         end 6: no boundary crossed
    C     6 -> 8              0 R S             0       -              end 7: not crossed, no block taken
    D     7 -> 9              0 0 R S           1       S -> C2        end 9: 8 is R's state and S -> R would
                                                                       overwrite it: C2 becomes the running
                                                                       block, R the checkpoint (key 1);
                                                                       C (key 0) evict-first

No step pins a block beyond running + scratch; the checkpoint lives from the verify to the
retire after it.
"""

from __future__ import annotations

import pytest

from mambakv import BlockPool, MambaManager, MambaSpec, Request
from mambakv.core.errors import InvalidSpecError
from mambakv.groups.base import group_block_hashes
from tests.coord_helpers import coordinator, fa_spec, tokens
from tests.helpers import STATE_DTYPES, STATE_SHAPES, mamba_spec


def manager(mode: str, num_blocks: int = 16) -> MambaManager:
    return MambaManager(mamba_spec(4, 1, decode_checkpoints=mode), BlockPool(num_blocks))


def ids(m: MambaManager, rid: str) -> list[int]:
    return [b.block_id for b in m.req_to_blocks[rid]]


def test_spec_field_validates_and_is_part_of_equality():
    assert mamba_spec(4).decode_checkpoints.value == "every"
    assert mamba_spec(4, decode_checkpoints="latest") != mamba_spec(4)
    with pytest.raises(InvalidSpecError, match="decode_checkpoints"):
        MambaSpec(4, STATE_SHAPES, STATE_DTYPES, mode="align", decode_checkpoints="some")


def decode(m: MambaManager, req: Request, computed: int, accepted: int) -> tuple[list, list]:
    """One synchronous decode step of 1 + 1 draft from `computed`; returns (writes, copies)."""
    m.allocate_new_blocks("r", computed + 2, num_draft_tokens=1, decode=True, num_computed_tokens=computed)
    writes = m.take_checkpoint_writes()
    copies = m.accept_drafts("r", accepted)
    end = computed + 1 + accepted
    req.append_output_token_ids([7] * (end - req.num_tokens + 1))
    m.cache_blocks(req, end)
    m.remove_skipped_blocks("r", end)
    m.check_invariants()
    return writes, copies


def test_latest_walk():
    m = manager("latest")
    pool = m.block_pool
    req = Request("r", tokens(3))
    req.num_computed_tokens = req.num_prompt_tokens  # a manager used alone: the engine's count
    m.allocate_new_blocks("r", 3)
    R, S = ids(m, "r")
    assert m.take_checkpoint_writes() == [("r", R, 3)]  # a prefill step: the running block, at 3
    # A: 3 -> 5; 0 accepted settles at 4, R's state: copied out into C, published at the retire
    writes, copies = decode(m, req, 3, 0)
    assert writes == [("r", R, 4), ("r", S, 5)] and len(copies) == 1 and copies[0][0] == R
    C = copies[0][1]
    keys = group_block_hashes(req, 4)
    assert pool.blocks[C].block_hash == keys[0] and pool.blocks[C].ref_cnt == 0  # published, cached
    assert ids(m, "r") == [0, R, S]
    # B: 4 -> 6 accepts 1: ends at 6, no boundary crossed
    assert decode(m, req, 4, 1) == ([("r", R, 5), ("r", S, 6)], [(S, R)])
    # C: 6 -> 8 accepts 0: ends at 7, 8 not crossed: no block taken
    assert decode(m, req, 6, 0) == ([("r", R, 7), ("r", S, 8)], [])
    assert ids(m, "r") == [0, R, S]
    # D: 7 -> 9 (R moves to slot 2, no new block) accepts 1: R holds 8 but S -> R would
    # overwrite it; no step in flight: C2 takes R's place (S -> C2), R is the checkpoint
    writes, copies = decode(m, req, 7, 1)
    assert writes == [("r", R, 8), ("r", S, 9)] and len(copies) == 1 and copies[0][0] == S
    C2 = copies[0][1]
    keys = group_block_hashes(req, 4)
    assert ids(m, "r") == [0, 0, C2, S] and m.table("r").running_slot == 2
    assert pool.blocks[R].block_hash == keys[1] and pool.blocks[R].ref_cnt == 0
    # the previous decode checkpoint is evict-first: still cached, first among the cached blocks
    queue = [b for b in pool.free_block_queue.get_all_free_blocks()]
    first_cached = next(b for b in queue if b.block_hash is not None)
    assert first_cached.block_id == C and pool.blocks[C].block_hash == keys[0]
    m.free("r")
    assert pool.get_num_free_blocks() == 15


@pytest.mark.parametrize("mode", ["none", "latest"])
def test_running_block_advances_in_place(mode):
    m = manager(mode)
    req = Request("r", tokens(3))
    req.num_computed_tokens = req.num_prompt_tokens  # a manager used alone: the engine's count
    m.allocate_new_blocks("r", 3)
    R, S = ids(m, "r")
    m.take_checkpoint_writes()
    for c in range(3, 12):
        assert len(decode(m, req, c, 0)[0]) == 2  # a forward writes the running and scratch blocks only
        table = ids(m, "r")
        assert table[m.table("r").running_slot] == R and R in table and S in table
    assert m.block_pool.get_num_free_blocks() == 15 - 2 - (mode == "latest" and m.table("r").has_spare)
    published = [b for b in m.block_pool.blocks if b.block_hash is not None]
    assert len(published) == (3 if mode == "latest" else 0)  # latest: 4, 8, 12 (older ones evict-first)


def async_pair(m: MambaManager, prompt: int) -> Request:
    """Prefill `prompt` tokens, then two decode steps of 1 + 1 draft in flight: from `prompt`
    and from the optimistic `prompt + 2`."""
    req = Request("r", tokens(prompt))
    req.num_computed_tokens = req.num_prompt_tokens  # a manager used alone: the engine's count
    m.allocate_new_blocks("r", prompt)
    m.allocate_new_blocks("r", prompt + 2, num_draft_tokens=1, decode=True, num_computed_tokens=prompt)
    m.allocate_new_blocks("r", prompt + 4, num_draft_tokens=1, decode=True, num_computed_tokens=prompt + 2)
    running_and_scratch = ids(m, "r")[-2:]
    assert all(b in running_and_scratch for rid, b, _ in m.take_checkpoint_writes() if rid == "r")
    return req


def test_in_flight_step_does_not_touch_the_checkpoint_and_finish_frees_it_unhashed():
    """Async: C (6 -> 8) and D (planned at optimistic 8 -> 10) in flight, both writing R and S
    only. C accepts 1: settled at 8, scratch S holds 8: copies S -> R and S -> P, P a new
    block no forward writes. The retire publishes P although D is in flight; a finish before
    that retire frees P unhashed."""
    for finish in (True, False):
        m = manager("latest")
        req = async_pair(m, 6)
        R, S = ids(m, "r")[-2:]
        copies = m.accept_drafts("r", 1)
        assert copies[0] == (S, R) and copies[1][0] == S
        P = copies[1][1]
        assert ids(m, "r")[-1] == P and m.block_pool.blocks[P].block_hash is None
        req.append_output_token_ids([7, 7, 7])
        if finish:
            m.free("r")
            assert m.block_pool.blocks[P].block_hash is None and m.block_pool.blocks[P].ref_cnt == 0
        else:
            m.cache_blocks(req, 8)
            assert m.block_pool.blocks[P].block_hash == group_block_hashes(req, 4)[1]
            assert ids(m, "r")[-2:] == [R, S]
        m.check_invariants()


def test_real_token_crossing_under_accepted_drafts_with_a_step_in_flight_is_not_tracked():
    """Async: the step from 7 (8 real, 9 draft) and the next one in flight; 1 accepted: 8 is
    R's state, the copy S -> R overwrites it, and the step in flight writes R: not tracked."""
    m = manager("latest")
    async_pair(m, 7)
    free = m.block_pool.get_num_free_blocks()
    R, S = ids(m, "r")[-2:]
    assert m.accept_drafts("r", 1) == [(S, R)]
    assert m.block_pool.get_num_free_blocks() == free and not m.table("r").has_spare
    m.check_invariants()


def test_no_checkpoint_block_after_a_free_while_steps_are_in_flight():
    """A request freed while the crossing step is in flight may still have a step in flight
    itself, which writes the blocks it freed (unhashed free blocks are reused first): no
    checkpoint block is taken at the verify of a step planned before that free (the fuzzer's
    state oracle found a published block overwritten so). A step planned after it is served."""
    m = manager("latest")
    m.allocate_new_blocks("q", 3)
    req = async_pair(m, 6)
    m.free("q")
    R, S = ids(m, "r")[-2:]
    assert m.accept_drafts("r", 1) == [(S, R)]  # C crossed 8, planned before the free: untracked
    req.append_output_token_ids([7, 7, 7])
    m.cache_blocks(req, 8)
    m.remove_skipped_blocks("r", 8)
    assert m.accept_drafts("r", 0) == []  # D: from 8, ends at 9
    req.append_output_token_ids([7])
    m.cache_blocks(req, 9)
    m.remove_skipped_blocks("r", 9)
    decode(m, req, 9, 1)  # E, planned after the free: 9 -> 11
    writes, copies = decode(m, req, 11, 0)  # F: ends at 12, R's state: copied out, published
    assert copies == [(R, copies[0][1])] and m.block_pool.blocks[copies[0][1]].block_hash is not None
    m.check_invariants()


def test_checkpoint_never_evicts_unless_asked():
    """A pool whose free blocks are all cached: no checkpoint block, the boundary is not
    tracked; spare_may_evict takes one by evicting the LRU head."""
    for may_evict in (False, True):
        m = manager("latest", num_blocks=5)
        pool = m.block_pool
        req = Request("r", tokens(3))
        req.num_computed_tokens = req.num_prompt_tokens  # a manager used alone: the engine's count
        m.allocate_new_blocks("r", 3)
        m.take_checkpoint_writes()
        cached = pool.get_new_blocks(2)
        pool.cache_full_blocks(cached, [b"x" * 16, b"y" * 16], 0)
        pool.free_blocks(cached)  # 2 free blocks, both cached
        m.spare_may_evict = may_evict
        writes, copies = decode(m, req, 3, 0)
        assert len(writes) == 2 and len(copies) == (1 if may_evict else 0)
        # evicting: one cached block lost its hash; it became the checkpoint, published at 4 (key 0)
        assert sum(b.block_hash in (b"x" * 16, b"y" * 16) for b in cached) == (1 if may_evict else 2)
        assert (pool.get_cached_block(group_block_hashes(req, 4)[0], [0]) is not None) == may_evict


def published_positions(coord, req, gid: int, bs: int) -> list[int]:
    return [(i + 1) * bs for i, k in enumerate(group_block_hashes(req, bs))
            if coord.block_pool.get_cached_block(k, [gid]) is not None]


@pytest.mark.parametrize("mode,published", [("every", [8, 24, 32]), ("latest", [8, 24, 32]), ("none", [8, 24])])
def test_one_token_prefill_chunk_is_not_decode(mode, published):
    """Issue 16's repro: full attention block 8 + Mamba block 8 with 1 scratch block; a
    29-token prompt as 7, 1, 7, 9, 5 tokens (the 1-token chunk is prefill: the prompt is not
    computed), then six 1-token decode steps. Published: the chunk ends on a boundary (8, 24)
    and the settled decode crossing at 32 (not under none). A new request with the first 16
    tokens + 3 others hits 8, never a 16 nobody wrote."""
    coord = coordinator(64, fa_spec(8), mamba_spec(8, 1, decode_checkpoints=mode), max_num_seqs=2)
    req = Request("a", tokens(29))
    for n in (7, 1, 7, 9, 5, 1, 1, 1, 1, 1, 1):
        assert coord.allocate(req, n) is not None
        req.num_computed_tokens += n
        if req.num_computed_tokens >= 29:
            req.append_output_token_ids(5)
        coord.retire("a", req.num_computed_tokens)
        coord.take_copy_plan(), coord.take_zero_plan(), coord.take_checkpoint_writes()
        coord.check_invariants()
    assert published_positions(coord, req, 1, 8) == published
    coord.free("a")
    new = Request("b", tokens(16) + [1, 2, 3])
    _, hit = coord.get_computed_blocks(new)
    assert hit == 8


def test_no_free_block_recycles_the_requests_own_superseded_checkpoint():
    """Block 4, 1 draft, 5 blocks: C (key 0) published at 4; then every free block is cached
    (C and two foreign states). At 8 no block is free without eviction: the request's own
    checkpoint C, which the state at 8 supersedes on its chain, is recycled; the foreign
    states stay cached."""
    m = manager("latest", num_blocks=6)
    pool = m.block_pool
    req = Request("r", tokens(3))
    req.num_computed_tokens = req.num_prompt_tokens  # a manager used alone: the engine's count
    m.allocate_new_blocks("r", 3)
    R, S = ids(m, "r")
    m.take_checkpoint_writes()
    _, copies = decode(m, req, 3, 0)
    C = copies[0][1]
    foreign = pool.get_new_blocks(2)
    pool.cache_full_blocks(foreign, [b"x" * 16, b"y" * 16], 0)
    pool.free_blocks(foreign)
    assert pool.get_new_unhashed_block() is None  # all 3 free blocks are cached
    decode(m, req, 4, 1)  # 4 -> 6
    decode(m, req, 6, 0)  # 6 -> 7
    _, copies = decode(m, req, 7, 0)  # 7 -> 8: R holds 8
    keys = group_block_hashes(req, 4)
    assert copies == [(R, C)] and pool.blocks[C].block_hash == keys[1]
    assert pool.get_cached_block(keys[0], [0]) is None
    assert all(b.block_hash in (b"x" * 16, b"y" * 16) for b in foreign)
    m.free("r")
    m.check_invariants()
