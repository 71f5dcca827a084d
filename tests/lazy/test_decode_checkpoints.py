"""MambaSpec.decode_checkpoints (issue 16): every / latest / none, values worked out by hand.

The manager-level walk (block 4, 1 draft, a 3-token prompt, synchronous; ``R`` running, ``S``
scratch, ``P`` spare, ``0`` null)::

    step  computed -> tokens  table after plan   writes (block: position)    verify  effect
    A     3 -> 5              0 R S P            R:4 S:5 P:4 (B=4 <= 5)     0       end 4: crossed -> P published (key 0)
    B     4 -> 6              0 R S              R:5 S:6     (B=8 > 6)      1       S -> R, end 6
    C     6 -> 8              0 R S P2           R:7 S:8 P2:8               0       end 7: not crossed, P2 kept
    D     7 -> 9              0 0 R S P2         R:8 S:9 P2:8               1       end 9: crossed -> P2 published (key 1),
                                                                                    P (key 0) evict-first
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


def decode(m: MambaManager, req: Request, computed: int, accepted: int) -> list:
    """One synchronous decode step of 1 + 1 draft from `computed`; returns its writes."""
    m.allocate_new_blocks("r", computed + 2, num_draft_tokens=1, decode=True, num_computed_tokens=computed)
    writes = m.take_checkpoint_writes()
    m.accept_drafts("r", accepted)
    end = computed + 1 + accepted
    req.append_output_token_ids([7] * (end - req.num_tokens + 1))
    m.cache_blocks(req, end)
    m.remove_skipped_blocks("r", end)
    m.check_invariants()
    return writes


def test_latest_walk():
    m = manager("latest")
    pool = m.block_pool
    req = Request("r", tokens(3))
    m.allocate_new_blocks("r", 3)
    R, S = ids(m, "r")
    assert m.take_checkpoint_writes() == [("r", R, 3)]  # a prefill step: the running block, at 3
    # A: 3 -> 5, the spare P gets the state at 4; 0 accepted settles at 4: crossed
    writes = decode(m, req, 3, 0)
    P = writes[-1][1]
    assert writes == [("r", R, 4), ("r", S, 5), ("r", P, 4)]
    keys = group_block_hashes(req, 4)
    assert pool.blocks[P].block_hash == keys[0] and pool.blocks[P].ref_cnt == 0  # published, cached
    assert ids(m, "r") == [0, R, S]
    # B: 4 -> 6: the next boundary 8 is out of reach: no spare
    assert decode(m, req, 4, 1) == [("r", R, 5), ("r", S, 6)]
    assert ids(m, "r") == [0, R, S]
    # C: 6 -> 8 reaches 8: a spare P2; 0 accepted ends at 7: kept
    writes = decode(m, req, 6, 0)
    P2 = writes[-1][1]
    assert writes == [("r", R, 7), ("r", S, 8), ("r", P2, 8)] and P2 != P
    assert ids(m, "r") == [0, R, S, P2] and pool.blocks[P2].block_hash is None
    # D: 7 -> 9: the running block moves to slot 2 (no new block), target P2 again; crossed
    writes = decode(m, req, 7, 1)
    assert writes == [("r", R, 8), ("r", S, 9), ("r", P2, 8)]
    keys = group_block_hashes(req, 4)
    assert ids(m, "r") == [0, 0, R, S]
    assert pool.blocks[P2].block_hash == keys[1] and pool.blocks[P2].ref_cnt == 0
    # the previous decode checkpoint is evict-first: still cached, first among the cached blocks
    queue = [b for b in pool.free_block_queue.get_all_free_blocks()]
    first_cached = next(b for b in queue if b.block_hash is not None)
    assert first_cached.block_id == P and pool.blocks[P].block_hash == keys[0]
    m.free("r")
    assert pool.get_num_free_blocks() == 15


@pytest.mark.parametrize("mode", ["none", "latest"])
def test_running_block_advances_in_place(mode):
    m = manager(mode)
    req = Request("r", tokens(3))
    m.allocate_new_blocks("r", 3)
    R, S = ids(m, "r")
    m.take_checkpoint_writes()
    for c in range(3, 12):
        decode(m, req, c, 0)
        table = ids(m, "r")
        assert table[m.table("r").running_slot] == R and R in table and S in table
    assert m.block_pool.get_num_free_blocks() == 15 - 2 - (mode == "latest" and m.table("r").has_spare)
    published = [b for b in m.block_pool.blocks if b.block_hash is not None]
    assert len(published) == (3 if mode == "latest" else 0)  # latest: 4, 8, 12 (older ones evict-first)


def test_in_flight_step_guards_the_spare_and_finish_frees_it_unhashed():
    """Async: C (6 -> 8, target P at 8) and D (planned at optimistic 8 -> 10; its start is
    unknown, lower bound 7, so it targets P at 8 too) are in flight. C accepts 1: settled at 8,
    crossed, but D lists P as its target: not published. Finish now: P freed unhashed."""
    for finish in (True, False):
        m = manager("latest")
        req = Request("r", tokens(6))
        m.allocate_new_blocks("r", 6)
        m.take_checkpoint_writes()
        m.allocate_new_blocks("r", 8, num_draft_tokens=1, decode=True, num_computed_tokens=6)
        m.allocate_new_blocks("r", 10, num_draft_tokens=1, decode=True, num_computed_tokens=8)
        writes = m.take_checkpoint_writes()
        P = writes[2][1]
        assert writes[2] == ("r", P, 8) and writes[5] == ("r", P, 8)
        m.accept_drafts("r", 1)
        req.append_output_token_ids([7, 7, 7])
        m.cache_blocks(req, 8)
        assert m.block_pool.blocks[P].block_hash is None and m.table("r").spare_pos == 8
        if finish:
            m.free("r")
            assert m.block_pool.blocks[P].block_hash is None and m.block_pool.blocks[P].ref_cnt == 0
        else:  # D settles (it started at 8: it could not write 8): now P is published
            m.accept_drafts("r", 0)
            m.cache_blocks(req, 9)
            assert m.block_pool.blocks[P].block_hash == group_block_hashes(req, 4)[1]
        m.check_invariants()


def test_spare_never_evicts_unless_asked():
    """A pool whose free blocks are all cached: no spare, the boundary is not tracked;
    spare_may_evict takes one by evicting the LRU head."""
    for may_evict in (False, True):
        m = manager("latest", num_blocks=5)
        pool = m.block_pool
        req = Request("r", tokens(3))
        m.allocate_new_blocks("r", 3)
        m.take_checkpoint_writes()
        spare_pool = pool.get_new_blocks(2)
        pool.cache_full_blocks(spare_pool, [b"x" * 16, b"y" * 16], 0)
        pool.free_blocks(spare_pool)  # 2 free blocks, both cached
        m.spare_may_evict = may_evict
        writes = decode(m, req, 3, 0)
        assert len(writes) == (3 if may_evict else 2)
        # evicting: one cached block lost its hash; it became the spare, published at 4 (key 0)
        assert sum(b.block_hash in (b"x" * 16, b"y" * 16) for b in spare_pool) == (1 if may_evict else 2)


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


def test_a_spare_serves_one_boundary_at_a_time():
    """Block 4, 3 drafts, async: step 1 (3 -> 7) targets the spare at 4; step 2, planned
    before step 1's result (optimistic 7 -> 11, start >= 4), could reach only 8: while step 1
    may still write 4 into the spare, step 2 gets no target (the fuzzer found a spare holding
    8's state published under 4's key without this rule)."""
    m = MambaManager(mamba_spec(4, 3, decode_checkpoints="latest"), BlockPool(16))
    m.allocate_new_blocks("r", 3)
    m.take_checkpoint_writes()
    m.allocate_new_blocks("r", 7, num_draft_tokens=3, decode=True, num_computed_tokens=3)
    first = m.take_checkpoint_writes()
    spare = first[-1]
    assert len(first) == 5 and spare[2] == 4  # running, 3 scratch, the spare at 4
    m.allocate_new_blocks("r", 11, num_draft_tokens=3, decode=True, num_computed_tokens=7)
    second = m.take_checkpoint_writes()
    assert len(second) == 4 and all(b != spare[1] for _, b, _ in second)
    m.check_invariants()
