"""Bad input to the coordinator's per-step calls: each raises a MambaKVError subclass before
anything changes (found by a new-user review; values worked out by hand in comments)."""

from __future__ import annotations

import numpy as np
import pytest

from mambakv import (
    InvalidBlockError,
    InvalidDraftCountError,
    InvalidRequestError,
    InvalidTokenCountError,
    KVCacheBlocks,
    Request,
)
from tests.coord_helpers import coordinator, fa_spec, prefill, snapshot, step, tokens
from tests.helpers import mamba_spec


def test_computed_tokens_without_hit_blocks_cannot_poison_the_cache():
    # Block 16, 64 blocks. A fresh request claims 128 computed tokens with no hit blocks:
    # allocating would publish 8 never-computed blocks under its hashes.
    coord = coordinator(64, fa_spec(16))
    a = Request("a", tokens(200))
    before = snapshot(coord)
    with pytest.raises(InvalidTokenCountError):
        coord.allocate(a, 8, num_new_computed_tokens=128)
    assert snapshot(coord) == before and coord.request_ids == []
    # The preemption slip: a freed request re-allocated without resetting its computed count.
    step(coord, a, 64)  # a computed 64, 4 blocks
    coord.free("a")
    assert a.num_computed_tokens == 64
    before = snapshot(coord)
    with pytest.raises(InvalidTokenCountError):
        coord.allocate(a, 8)
    assert snapshot(coord) == before
    b = Request("b", tokens(200))
    assert coord.get_computed_blocks(b)[1] == 64  # only what a really computed (4 full blocks)


def test_running_request_cannot_claim_more_computed_than_scheduled():
    coord = coordinator(64, fa_spec(16))
    a = Request("a", tokens(200))
    step(coord, a, 32)  # scheduled 32
    a.num_computed_tokens = 96  # the engine skipped ahead: tokens 32..96 never ran
    before = snapshot(coord, ["a"])
    with pytest.raises(InvalidTokenCountError):
        coord.allocate(a, 8)
    assert snapshot(coord, ["a"]) == before


def _hybrid_with_cached_prefix():
    # Full attention block 16 + Mamba align block 64; "a" (200 tokens) prefilled in chunks
    # ending at 128, 192, 200 and freed: states at 128 and 192 stay cached.
    coord = coordinator(64, fa_spec(16), mamba_spec(64))
    a = Request("a", tokens(200))
    prefill(coord, a, [128, 192, 200])
    coord.free("a")
    b = Request("b", tokens(200))
    hits, n = coord.get_computed_blocks(b)
    assert n == 192 and [len(h) for h in hits.blocks] == [12, 3]  # 192/16 and 192/64
    return coord, b, hits


@pytest.mark.parametrize("claimed", [0, 64, 256])
def test_hit_blocks_must_cover_exactly_the_claimed_tokens(claimed):
    coord, b, hits = _hybrid_with_cached_prefix()
    before = snapshot(coord)
    with pytest.raises(InvalidBlockError):  # claimed 256: 264 tokens pass b's 200; the hit check still comes
        # before the draft derivation's refusal (num_draft_tokens=None), which is checked after the hits
        coord.allocate(b, 8, num_new_computed_tokens=claimed, new_computed_blocks=hits)
    assert snapshot(coord) == before


def test_hits_missing_a_group_are_refused():
    # Only the attention hits: the Mamba group would start at token 192 with no state.
    coord, b, hits = _hybrid_with_cached_prefix()
    before = snapshot(coord)
    with pytest.raises(InvalidBlockError):
        coord.allocate(b, 8, num_new_computed_tokens=192, new_computed_blocks=KVCacheBlocks((hits.blocks[0], [])))
    assert snapshot(coord) == before
    assert coord.allocate(b, 8, num_new_computed_tokens=192, new_computed_blocks=hits) is not None
    coord.check_invariants()


def test_hits_from_another_coordinator_are_refused():
    coord, b, hits = _hybrid_with_cached_prefix()
    other, _, _ = _hybrid_with_cached_prefix()
    before, before_other = snapshot(coord), snapshot(other)
    with pytest.raises(InvalidBlockError):
        other.allocate(Request("b", tokens(200)), 8, num_new_computed_tokens=192, new_computed_blocks=hits)
    assert snapshot(coord) == before and snapshot(other) == before_other


@pytest.mark.parametrize("bad", [2.5, 64.0, True, "8", None])
def test_non_integer_counts_raise_before_any_change(bad):
    coord = coordinator(64, fa_spec(16), mamba_spec(16, 2))
    a = Request("a", tokens(40))
    step(coord, a, 32)
    before = snapshot(coord, ["a"])
    with pytest.raises(InvalidTokenCountError):
        coord.allocate(a, bad)
    with pytest.raises(InvalidTokenCountError):
        coord.retire("a", bad)
    assert snapshot(coord, ["a"]) == before
    assert coord.allocate(a, np.int64(8)) is not None  # numpy integers are integers


def test_non_integer_accepted_count_keeps_the_pending_verify():
    # Block 16, nspec 2: 32 computed, a verify step of 1 + 2 drafts (34 tokens known + 1 real).
    coord = coordinator(64, fa_spec(16), mamba_spec(16, 2))
    a = Request("a", tokens(33))
    step(coord, a, 32)
    coord.retire("a", 32)
    step(coord, a, 3)  # tokens 32..34; 33 known -> 2 drafts
    with pytest.raises(InvalidDraftCountError):
        coord.accept_drafts("a", 1.5)
    with pytest.raises(InvalidDraftCountError):
        coord.accept_drafts("a", 3)  # only 2 drafts
    # still pending: 1 accepted copies scratch block 0 (slot 3) into the running block (slot 2)
    (pairs,) = coord.accept_drafts("a", 1).values()
    table = coord.get_block_ids("a")[1]
    assert pairs == [(table[3], table[2])]


def test_more_drafts_than_speculative_blocks_are_refused():
    # nspec 2: a verify step of 1 real token + 4 drafts has no scratch block for drafts 3, 4.
    coord = coordinator(64, fa_spec(16), mamba_spec(16, 2))
    a = Request("a", tokens(33))
    step(coord, a, 32)
    before = snapshot(coord, ["a"])
    with pytest.raises(InvalidDraftCountError):
        coord.allocate(a, 5)  # 32 + 5 = 37 tokens, 33 known: 4 drafts
    with pytest.raises(InvalidDraftCountError):
        coord.allocate(a, 4, num_draft_tokens=3)
    assert snapshot(coord, ["a"]) == before
    assert coord.allocate(a, 3) is not None  # 2 drafts fit


def test_a_live_request_id_cannot_be_reused_by_another_request():
    coord = coordinator(64, fa_spec(16))
    a = Request("a", tokens(40))
    step(coord, a, 32)
    before = snapshot(coord, ["a"])
    with pytest.raises(InvalidRequestError):
        coord.allocate(Request("a", tokens(40, start=5)), 8)
    assert snapshot(coord, ["a"]) == before
    coord.free("a")
    assert coord.allocate(Request("a", tokens(40, start=5)), 8) is not None  # free: the id is reusable
