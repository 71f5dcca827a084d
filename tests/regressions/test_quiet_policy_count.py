"""A running step that leaves the attention policy quiet must still count every column of a
shared Mamba policy (found by the fuzzer after the issue-15 changes shifted its examples).

Unified pool; groups: full attention (block 4), two identical Mamba groups (block 2) that share
one policy (two block columns), no speculative blocks. A 12-token prompt, then decode:

    step to   attention (block 4)        Mamba (block 2, per column)
    12        3 blocks (covers 12)       NEW: 1 block each          -> 5
    13        a 4th block (covers 16)    GROW to slot 6: 1 each     -> 3
    14        quiet (13 < 14 <= 16)      covered (slot 6 ends at 14) -> 0
    15        quiet                      GROW to slot 7: 1 each      -> 2

At 15 only the Mamba policy runs; it needs 2 blocks, 1 per column. The count took the first
policy's empty hit list (one column) and so counted 1: with 1 free block, ``allocate`` passed
the count and the pop raised OutOfBlocksError halfway through the commit. Right: None, nothing
changed; with 2 free blocks it takes exactly 2.
"""

from __future__ import annotations

from mambakv import KVCacheCoordinator, Request
from mambakv.core.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

ATTN = FullAttentionSpec(4, num_kv_heads=1, head_size=8, dtype="bfloat16")
MAMBA = MambaSpec(2, ((2, 2),), ("float32",), mode="align")


def _coordinator_at_14_tokens() -> tuple[KVCacheCoordinator, Request]:
    cfg = KVCacheConfig(40, [KVCacheGroupSpec(["a"], ATTN), KVCacheGroupSpec(["m0"], MAMBA),
                             KVCacheGroupSpec(["m1"], MAMBA)])
    kv = KVCacheCoordinator(cfg, max_model_len=64)
    req = Request("r", list(range(1, 13)), max_tokens=8)
    free = kv.block_pool.get_num_free_blocks()
    assert kv.allocate(req, 12, num_draft_tokens=0) is not None
    assert free - kv.block_pool.get_num_free_blocks() == 5
    req.num_computed_tokens = 12
    kv.retire("r", 12)
    for tok, taken in ((100, 3), (101, 0)):  # steps to 13 and 14
        req.append_output_token_ids(tok)
        free = kv.block_pool.get_num_free_blocks()
        assert kv.allocate(req, 1, num_draft_tokens=0) is not None
        assert free - kv.block_pool.get_num_free_blocks() <= taken  # a retired state may come back
        req.num_computed_tokens += 1
        kv.retire("r", req.num_computed_tokens)
        kv.check_invariants()
    req.append_output_token_ids(102)
    return kv, req


def _pin_all_but(kv: KVCacheCoordinator, keep: int) -> None:
    """Take free blocks out (as another holder would) until `keep` are left."""
    n = kv.block_pool.get_num_free_blocks() - keep
    if n > 0:
        kv.block_pool.get_new_blocks(n)


def test_a_quiet_attention_step_counts_both_mamba_columns():
    kv, req = _coordinator_at_14_tokens()
    _pin_all_but(kv, 1)
    ids = kv.get_block_ids("r")
    assert kv.allocate(req, 1, num_draft_tokens=0) is None  # 2 needed, 1 free: refused, not raised
    assert kv.get_block_ids("r") == ids and kv.block_pool.get_num_free_blocks() == 1


def test_with_two_free_blocks_the_step_takes_both():
    kv, req = _coordinator_at_14_tokens()
    _pin_all_but(kv, 2)
    new = kv.allocate(req, 1, num_draft_tokens=0)
    assert new is not None
    assert [len(b) for b in new.blocks] == [0, 1, 1] and kv.block_pool.get_num_free_blocks() == 0
