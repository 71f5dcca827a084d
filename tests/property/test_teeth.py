"""Teeth: plant the two classic bugs and check that the fuzzer catches each within the CI budget.

1. Retirement by the walk that goes down from the highest skipped slot and stops at the first
   null, with no watermark (vLLM before its fix, DESIGN.md 5.1 "the null-gap leak"): in align
   mode null gaps sit between live states (interior boundaries of a multi-block chunk, relocated
   scratch slots), so the state below a gap is never freed. E.g. block 2, nspec 0, chunks of
   4 + 4 tokens: the table is ``[0, A, 0, B]`` (A = state at 4, B = state at 8); retiring to 8
   processed tokens must free A (slots < (8 - 1) // 2 = 3), but the walk starts at slot 2, sees
   null and stops: A leaks (the LEAK check), and further chunks push the count past
   ``2 + nspec + lag`` (the BOUND check).
2. A free that appends unhashed blocks to the tail: the queue stops being
   ``[unhashed ...][hashed ...]`` and a cached block would be evicted while an unhashed free
   block waits (the EVICTION ORDER check).

3. (decoupled layout) superblock 0 treated as convertible once its non-null pages are free
   (the null block's ref count is 0): the arena would hand the null page's bytes to a state.

The runs are derandomized (same examples every time) and skip shrinking, so they are fast
and deterministic; each stops at the first failing example.
"""

from __future__ import annotations

import pytest
from hypothesis.stateful import run_state_machine_as_test

from mambakv import BlockPool, MambaManager
from mambakv.core.arena_pool import ArenaPool
from tests.helpers import retire_until_first_null
from tests.property.fuzz_machine import KVFuzzMachine, teeth_settings
from tests.property.test_fuzz import DecoupledFuzzMachine


class MambaFuzzMachine(KVFuzzMachine):
    force_mamba = True  # the leak needs a Mamba group


walk_stops_at_first_null = retire_until_first_null  # the pre-fix retirement (tests/helpers.py)


def free_unhashed_to_tail(self, blocks):
    """A free that queues every freed block at the tail, hashed or not."""
    freed = []
    for b in blocks:
        if b.is_null:
            continue
        b.ref_cnt -= 1
        if b.ref_cnt == 0:
            freed.append(b)
    if freed:
        self.free_block_queue.append_n(freed)


def _run_expecting(machine, pattern: str) -> None:
    with pytest.raises(AssertionError) as info:
        run_state_machine_as_test(machine, settings=teeth_settings(max_examples=300))
    assert info.match(pattern), f"caught by another check: {info.value}"


def test_fuzzer_catches_stop_at_first_null_retirement(monkeypatch) -> None:
    monkeypatch.setattr(MambaManager, "retire_slots", walk_stops_at_first_null)
    _run_expecting(MambaFuzzMachine, r"^(LEAK|BOUND)")


def test_fuzzer_catches_unhashed_blocks_freed_to_the_tail(monkeypatch) -> None:
    monkeypatch.setattr(BlockPool, "free_blocks", free_unhashed_to_tail)
    _run_expecting(KVFuzzMachine, r"^EVICTION ORDER")


def superblock_0_may_be_free(self, sb):
    """ArenaPool.superblock_is_free without its superblock-0 rule: the null block's ref count
    is 0, so superblock 0 looks free once its other pages are."""
    if not self.lent[sb]:
        return False
    k = self.per_superblock
    return not any(b.ref_cnt for b in self.blocks[sb * k:(sb + 1) * k])


def test_decoupled_fuzzer_catches_superblock_0_converted(monkeypatch) -> None:
    monkeypatch.setattr(ArenaPool, "superblock_is_free", superblock_0_may_be_free)
    # caught when the arena withdraws superblock 0: its null block is in no queue
    with pytest.raises(Exception, match=r"block 0 "):
        run_state_machine_as_test(DecoupledFuzzMachine, settings=teeth_settings(max_examples=300))
