"""Eviction units through the coordinator (decoupled layout): order, tails, ghosts, hazard, hints, cascades.

Geometry used throughout: 4-token pages of 128 B, a Mamba state of 176 B, superblocks of k = 2 pages
(a state slot takes a whole superblock); superblock 0 holds the null page and one usable page.
A 13-token prompt run in the harness's chunks (0..12, 12..13) takes 4 pages (tokens 0..13 incl. the
output slot) and 2 state slots, and leaves 3 cached pages (0..2) plus its checkpoint at page 2
(the replay boundary (13 - 1) // 4 * 4 = 12 tokens) when freed.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from mambakv import KVCacheCoordinator, Request
from mambakv.core.arena import SuperblockGeometry, count_unhashed
from mambakv.core.errors import InvalidClockError, InvalidSpecError, InvalidTokenCountError
from mambakv.core.eviction import ReuseEviction
from mambakv.core.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

ATTN = FullAttentionSpec(4, num_kv_heads=1, head_size=8, dtype="bfloat16")  # 4-token pages, 128 B per page
MAMBA = MambaSpec(4, ((3, 8), (2, 4, 4)), ("bfloat16", "float32"), mode="align")  # 176 B state

A = list(range(1, 14))                 # 13 tokens: checkpoint at page 2
B = A + list(range(50, 60))            # A's next turn, 23 tokens: checkpoint at (23 - 1) // 4 * 4 = 20 -> page 4
C = list(range(100, 113))
D = list(range(200, 213))
E = list(range(300, 313))


def config(n: int, mamba: MambaSpec = MAMBA) -> KVCacheConfig:
    geo = SuperblockGeometry(n, 2, 128, 176)
    return KVCacheConfig(geo.num_pages, [KVCacheGroupSpec(["a0"], ATTN), KVCacheGroupSpec(["m0"], mamba)], geo)


class Harness:
    def __init__(self, n: int = 12, eviction: object = "lru", mamba: MambaSpec = MAMBA) -> None:
        self.coord = KVCacheCoordinator(config(n, mamba), max_model_len=256, eviction=eviction)

    def prefill(self, rid: str, toks: list[int], now: float, retain: object = None, out: int = 1) -> tuple[Request, int]:
        coord = self.coord
        req = Request(rid, toks, max_tokens=out, retain=retain)
        hits, hit = coord.get_computed_blocks(req)
        c, first = hit, True
        while c < len(toks):
            end = coord.next_chunk_end(req, 64, num_computed_tokens=c)
            if first:
                r = coord.allocate(req, end - c, num_new_computed_tokens=hit, new_computed_blocks=hits,
                                   num_draft_tokens=0, now=now)
                first = False
            else:
                r = coord.allocate(req, end - c, num_draft_tokens=0, now=now)
            assert r is not None, rid
            req.num_computed_tokens = end
            coord.retire(rid, end)
            coord.take_step_plan()
            coord.check_invariants()
            c = end
        return req, hit

    def run(self, rid: str, toks: list[int], now: float, retain: object = None) -> int:
        _, hit = self.prefill(rid, toks, now, retain)
        self.coord.free(rid, now=now)
        self.coord.check_invariants()
        return hit

    def abcd(self, retain_c: object = None, retain_d: object = None) -> None:
        assert self.run("A", A, 0.0) == 0
        assert self.run("B", B, 10.0) == 12
        assert self.run("C", C, 20.0, retain_c) == 0
        assert self.run("D", D, 30.0, retain_d) == 0

    @property
    def stats(self):  # noqa: ANN201
        return self.coord.units.stats

    def units(self) -> list[tuple[int, int, float, bool]]:
        """(page index of the checkpoint, class, last_use, leaf), sorted."""
        return sorted((i, u.cls, u.last_use, u.leaf) for _, i, u in self.coord.units.page_entries() if u)

    def keys(self) -> dict[tuple[int, float], bytes]:
        """(index, last_use) -> the unit's key, for the live units."""
        return {(i, u.last_use): key for key, i, u in self.coord.units.page_entries() if u}

    def hit(self, toks: list[int]) -> int:
        return self.coord.get_computed_blocks(Request("probe", toks))[1]


def test_abcd_setup_units():
    h = Harness()
    h.run("A", A, 0.0)
    assert h.units() == [(2, 0, 0.0, True)]  # depth 1, no gap, prompt < 2k: class 0
    assert h.coord.units.num_pages == 3     # pages 0..2
    h.run("B", B, 10.0)
    # B: depth 2, gap 10 s < 60 (bin 1), prompt < 2k: (1 * 4 + 1) * 4 + 0 = 20; A's unit is now interior
    assert h.units() == [(2, 0, 10.0, False), (4, 20, 10.0, True)]
    h.run("C", C, 20.0)
    h.run("D", D, 30.0)
    assert h.units() == [(2, 0, 10.0, False), (2, 0, 20.0, True), (2, 0, 30.0, True), (4, 20, 10.0, True)]
    assert h.coord.units.num_pages == 11  # 3 (A) + 2 (B's pages 3, 4) + 3 (C) + 3 (D)
    assert h.stats.evictions == 0


@pytest.mark.parametrize("n", [12, 13])
def test_lru_evicts_oldest_leaf_then_parent_becomes_leaf(n):
    # After A..D with 12 superblocks: no FREE superblock; 7 page superblocks = 13 usable pages (11 cached + 2
    # unhashed), 5 slot superblocks (4 cached states + 1 unhashed). E needs 4 pages + 2 slots: short 2 pages and
    # 1 slot. The oldest leaf is B's unit (last_use 10; A's unit, also 10, is interior): it frees pages 3, 4 and
    # one slot -> 4 pages, 2 slots: exactly enough. With 13 superblocks the one FREE superblock gives the slot
    # but the pages are still 2 short -> still one eviction; with 14 there are two FREE superblocks -> none.
    h = Harness(n)
    h.abcd()
    keys = h.keys()
    b_key, a_key = keys[(4, 10.0)], keys[(2, 10.0)]
    assert h.run("E", E, 40.0) == 0
    assert h.stats.evictions == 1
    assert h.stats.evictions_by_class[20] == 1  # B's class
    # B's unit is gone, A's unit became a leaf at 40 (a leaf's life, and age, start when it becomes one);
    # E's unit is new
    assert h.units() == [(2, 0, 20.0, True), (2, 0, 30.0, True), (2, 0, 40.0, True), (2, 0, 40.0, True)]
    assert h.coord.units.num_pages == 11 - 2 + 3  # B's pages 3, 4 dropped, E's 0..2 added
    assert b_key in h.coord.units.policy.ghost
    assert a_key not in h.coord.units.policy.ghost
    assert h.hit(B) == 12  # B's prompt now only reaches A's state at 12 tokens
    h.coord.check_invariants()


def test_no_eviction_with_14_superblocks():
    h = Harness(14)
    h.abcd()
    h.run("E", E, 40.0)
    assert h.stats.evictions == 0  # two FREE superblocks: one slot + 2 pages, plus 2 unhashed pages


def decode(h: Harness, rid: str, toks: list[int], nout: int, now: float) -> Request:
    req, _ = h.prefill(rid, toks, now, out=nout)
    coord = h.coord
    for i in range(nout):
        req.append_output_token_ids(500 + i)
        n = req.num_tokens
        assert coord.allocate(req, 1, num_draft_tokens=0, now=now) is not None
        req.num_computed_tokens = n
        coord.retire(rid, n)
        coord.take_step_plan()
        coord.check_invariants()
    return req


def test_tail_pages_dropped_at_free():
    mamba = MambaSpec(4, ((3, 8), (2, 4, 4)), ("bfloat16", "float32"), mode="align", decode_checkpoints="none")
    h = Harness(12, mamba=mamba)
    req = decode(h, "T", A, 12, 0.0)
    assert req.num_tokens == 25  # 7 pages: 0..5 full, 6 partial
    assert h.units() == []  # nothing registers before free
    pages = h.coord.arena.pages
    assert pages.get_num_free_blocks() == 0  # every usable page is held (7 pages = sb0's + 3 superblocks)
    h.coord.free("T", now=5.0)
    h.coord.check_invariants()
    # deepest checkpoint: page 2 (12 tokens, no decode checkpoints); pages 3, 4, 5 are full and hashed but past it
    assert h.stats.tail_pages == 3
    assert h.units() == [(2, 0, 5.0, True)]
    assert h.coord.units.num_pages == 3
    assert pages.get_num_free_blocks() == 7  # all 7 pages free again
    assert count_unhashed(pages, 100) == 4   # 3 tail pages + the partial page 6, unhashed at the head
    assert sum(len(m) for m in h.coord.block_pool.cached_block_hash_to_block.values()) == 3  # pages 0..2 only
    assert h.hit(list(req.all_token_ids) + [9]) == 12  # nothing past the checkpoint can hit


def test_decode_checkpoints_every_leaves_no_tail():
    h = Harness(12)
    req = decode(h, "T", A, 12, 0.0)
    h.coord.free("T", now=5.0)
    h.coord.check_invariants()
    # checkpoints at pages 2 (prompt) and 3, 4, 5 (decode, every full page): no tail
    assert h.units() == [(2, 0, 5.0, False), (3, 0, 5.0, False), (4, 0, 5.0, False), (5, 0, 5.0, True)]
    assert h.stats.tail_pages == 0
    assert h.hit(list(req.all_token_ids) + [9]) == 24


def test_ghost_hit_after_eviction():
    h = Harness(12)
    h.abcd()
    b_key = h.keys()[(4, 10.0)]
    h.run("E", E, 40.0)  # evicts B's unit (test above)
    policy = h.coord.units.policy
    assert b_key in policy.ghost
    F = B + list(range(70, 75))  # 28 tokens: prompt pages 0..6, B's checkpoint key at page 4
    hit = h.run("F", F, 50.0)
    assert hit == 12  # A's state
    assert h.stats.ghost_hits == 1
    # hit pages = 12 // 4 = 3; ghost at position 4: (4 + 1 - 3) * 4 = 8 tokens (12..19, up to B's checkpoint at 20)
    assert h.stats.ghost_hit_tokens == 8
    assert h.stats.ghost_hits_by_class[20] == 1
    assert b_key not in policy.ghost  # popped
    assert h.stats.reuses == 2  # A's leaf at B's admission (t=10) and again at F's (A had become a leaf)


def test_hazard_learns_reuses_through_coordinator():
    h = Harness(20, eviction="reuse")
    hz = h.coord.units.policy.hazard
    assert hz.bin_seconds == 30.0
    h.run("A", A, 0.0)
    h.run("B", B, 10.0)
    # B's admission passes A's leaf unit at age 10 - 0 = 10 s: class 0, bin 10 // 30 = 0
    assert hz.reuses[0][0] == 1 and hz.ends[0][0] == 1
    assert hz.num_reuses == 1 and hz.num_lives == 1
    assert h.stats.reuses == 1 and h.stats.reuses_by_class[0] == 1
    assert h.stats.hit_tokens_by_class[0] == 12  # 3 hit pages x 4 tokens
    B3 = B + list(range(80, 90))  # 33 tokens, hit 20 (B's checkpoint at page 4)
    assert h.run("B3", B3, 100.0) == 20
    # B's unit (class 20, leaf) reused at age 100 - 10 = 90 s: bin 3; A's unit is interior: no new count
    assert hz.reuses[20][3] == 1 and hz.ends[20][3] == 1
    assert hz.reuses[0][0] == 1 and sum(map(sum, hz.reuses)) == 2
    assert h.stats.reuses == 2 and h.stats.reuses_by_class[20] == 1
    assert h.stats.hit_tokens_by_class[20] == 20
    # B3: depth 3 (A, B, B3), gap 90 s (< 300: bin 2), prompt < 2k: (2 * 4 + 2) * 4 + 0 = 40; checkpoint (33-1)//4*4=32
    assert (7, 40, 100.0, True) in h.units()


def test_low_hint_evicted_before_older_normal():
    h = Harness(12)
    h.abcd(retain_c="low")
    c_key = h.keys()[(2, 20.0)]
    h.run("E", E, 40.0)
    # C (low, last_use 20) goes before B (normal, last_use 10); its 3 pages + 1 slot cover E's shortfall
    assert h.stats.evictions == 1
    assert list(k for k, _ in h.coord.units.policy.ghost.items()) == [c_key]
    assert h.units() == [(2, 0, 10.0, False), (2, 0, 30.0, True), (2, 0, 40.0, True), (4, 20, 10.0, True)]


def test_high_hint_survives_eviction_of_every_normal_unit():
    h = Harness(12)
    h.abcd(retain_d="high")
    keys = h.keys()
    E37 = list(range(300, 337))  # 37 tokens: 10 pages + 2 slots, checkpoint at (37 - 1) // 4 * 4 = 36 -> page 8
    h.run("E", E37, 40.0)
    # every normal unit goes (B, A once a leaf, C); D (high) stays
    ghosts = [k for k, _ in h.coord.units.policy.ghost.items()]
    assert sorted(ghosts) == sorted([keys[(4, 10.0)], keys[(2, 10.0)], keys[(2, 20.0)]])
    assert ghosts[0] == keys[(4, 10.0)]  # B first: the oldest leaf
    assert h.stats.evictions == 3
    assert h.units() == [(2, 0, 30.0, True), (8, 0, 40.0, True)]
    assert h.hit(D + [1]) == 12


def test_ttl_hint_high_while_fresh():
    h = Harness(12)
    h.abcd(retain_d=15.0)
    b_key = h.keys()[(4, 10.0)]
    h.run("E", E, 40.0)  # D idle 40 - 30 = 10 < 15: still high; B (oldest normal leaf) goes
    assert [k for k, _ in h.coord.units.policy.ghost.items()] == [b_key]
    # A's unit became a leaf at 40, when B's went: its last use is then
    assert h.units() == [(2, 0, 20.0, True), (2, 0, 30.0, True), (2, 0, 40.0, True), (2, 0, 40.0, True)]


def test_ttl_hint_expired_is_normal_oldest_first():
    # X (ttl 15) is the oldest unit; once idle >= 15 s it is normal and, being least recently used, goes first
    h = Harness(12)
    h.run("X", A, 0.0, retain=15.0)
    h.run("B", B, 1.0)  # X's next turn: X's unit interior (it keeps ttl 15; last_use 1)
    h.run("C", C, 2.0)
    h.run("D", D, 3.0)
    b_key = h.keys()[(4, 1.0)]
    h.run("E", E, 20.0)  # X idle 19 >= 15 but interior; leaves: B (1), C (2), D (3): B goes
    assert [k for k, _ in h.coord.units.policy.ghost.items()] == [b_key]
    assert h.stats.evictions == 1


def test_ttl_hint_expired_goes_in_lru_order_lru():
    h = Harness(12)
    h.abcd(retain_d=15.0)
    b_key = h.keys()[(4, 10.0)]
    h.run("E", E, 45.0)  # D idle 45 - 30 = 15 >= 15: normal, last_use 30; B (last_use 10) is the LRU normal leaf
    assert [k for k, _ in h.coord.units.policy.ghost.items()] == [b_key]


def test_ttl_hint_expired_goes_in_lru_order_reuse_cold():
    # the same with the reuse policy and a cold table (probabilities 0: ties broken by last_use): B goes
    h = Harness(12, eviction="reuse")
    h.abcd(retain_d=15.0)
    b_key = h.keys()[(4, 10.0)]
    h.run("E", E, 45.0)
    assert [k for k, _ in h.coord.units.policy.ghost.items()] == [b_key]


def test_cascade_on_lost_page():
    h = Harness(12)
    h.run("A", A, 0.0)
    h.run("B", B, 10.0)
    units = h.coord.units
    p1 = next(key for key, i, _ in units.page_entries() if i == 1)
    state_keys = [key for key, _, u in units.page_entries() if u]
    assert len(state_keys) == 2 and units.num_pages == 5
    entry = h.coord.block_pool.cached_block_hash_to_block[0][p1]
    block_id = entry.block_id if not isinstance(entry, dict) else next(iter(entry.values())).block_id
    h.coord.block_pool.evict_blocks([block_id])
    h.coord.check_invariants()
    # page 1 lost: pages 1..4 (A's unit at 2, B's at 4) go; page 0 has no child or state left: pruned too
    assert h.stats.cascades == 1
    assert h.stats.cascade_evictions == 2 and h.stats.evictions == 0
    assert units.num_pages == 0 and h.units() == []
    for m in h.coord.state_block_pool.cached_block_hash_to_block.values():
        assert not any(k in m for k in state_keys)
    assert h.hit(B) == 0


def test_ghost_capacity_bound_records_censored():
    h = Harness(8, eviction=ReuseEviction(ghost_capacity=2))
    policy = h.coord.units.policy
    for i in range(6):
        h.run(f"R{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 13)), 10.0 * i)
        assert len(policy.ghost) <= 2
    # 8 superblocks hold two 13-token units plus a running request: R2 (t=20) evicts R0's, R3 R1's, R4 R2's,
    # R5 R3's. The 3rd ghost (t=40) drops R0's (last_use 0): censored at age 40 -> bin 1; at t=50 R1's (10): age 40
    assert h.stats.evictions == 4
    assert len(policy.ghost) == 2
    assert policy.hazard.ends[0][:3] == (0, 2, 0)
    assert sum(map(sum, policy.hazard.reuses)) == 0
    assert policy.hazard.num_lives == 2 and policy.hazard.num_reuses == 0


def test_unified_config_rejects_reuse():
    unified = KVCacheConfig(20, [KVCacheGroupSpec(["a0"], ATTN), KVCacheGroupSpec(["m0"], MAMBA)])
    with pytest.raises(InvalidSpecError):
        KVCacheCoordinator(unified, max_model_len=256, eviction="reuse")
    with pytest.raises(InvalidSpecError):
        KVCacheCoordinator(unified, max_model_len=256, eviction="fifo")
    assert KVCacheCoordinator(unified, max_model_len=256, eviction="lru").units is None


def test_unknown_policy_name():
    with pytest.raises(InvalidSpecError):
        KVCacheCoordinator(config(12), max_model_len=256, eviction="fifo")


def test_bad_now_changes_nothing():
    h = Harness(12)
    h.run("A", A, 5.0)
    coord = h.coord
    req = Request("Z", C)
    hits, hit = coord.get_computed_blocks(req)
    free_before = coord.arena.pages.get_num_free_blocks(), coord.arena.slots.get_num_free_blocks()
    for bad in (float("nan"), float("inf"), "x", True, 10**400):
        with pytest.raises(InvalidClockError):
            coord.allocate(req, 12, num_new_computed_tokens=hit, new_computed_blocks=hits, num_draft_tokens=0, now=bad)
        assert coord.now == 5.0 and coord.units.now == 5.0
        assert (coord.arena.pages.get_num_free_blocks(), coord.arena.slots.get_num_free_blocks()) == free_before
        coord.check_invariants()
    req2, _ = h.prefill("Y", D, 6.0)
    held = coord.arena.pages.get_num_free_blocks()
    for bad in ("x", math.nan, -math.inf, None.__class__):
        with pytest.raises(InvalidClockError):
            coord.free("Y", now=bad)
        assert coord.now == 6.0
        assert coord.arena.pages.get_num_free_blocks() == held  # Y still holds its pages
        coord.check_invariants()
    # a call refused by another check leaves the clock alone; an unknown id moves nothing
    with pytest.raises(InvalidTokenCountError):
        coord.allocate(Request("W", C), 10_000, now=99.0)
    coord.free("nobody", now=98.0)
    assert coord.now == 6.0
    coord.free("Y", now=np.float32(7.0))  # any real number
    coord.check_invariants()
    assert (2, 0, 7.0, True) in h.units()


def test_new_leaf_queued_by_last_use():
    h = Harness(12)
    h.abcd(retain_d="high")
    keys = h.keys()
    h.run("E", list(range(300, 337)), 40.0)
    # LRU by last use: B (10) goes first; A becomes a leaf then, at 40 (its life as a leaf starts), so C (20)
    # goes before it, then A (40, E's own unit being in its table)
    assert [k for k, _ in h.coord.units.policy.ghost.items()] == [keys[(4, 10.0)], keys[(2, 20.0)], keys[(2, 10.0)]]


@pytest.mark.parametrize("eviction", ["lru", "reuse"])
def test_a_ttl_unit_shared_with_a_high_request_stays_high(eviction):
    """Regression (found by a fresh-user test): A (ttl 30 s) then A's exact repeat A2 with
    retain="high" share A's unit, which keeps the stronger hint, high without a ttl; the policy
    must re-queue it as a plain high leaf (it crashed comparing a None ttl on the next eviction).
    Then C, D, E (normal, 13 tokens each) push out what they need: never A's unit, which is high."""
    h = Harness(12, eviction=eviction)
    h.run("A", A, 0.0, retain=30.0)
    assert h.run("A2", A, 1.0, retain="high") == 12  # A's state at 12: the whole unit is A2's hit
    a_unit = next(h.coord.units.live_units())
    assert a_unit.retain.tier == 2 and a_unit.retain.ttl is None
    for i, toks in enumerate((C, D, E, [t + 400 for t in C], [t + 400 for t in D])):
        h.run(f"x{i}", toks, 100.0 + 50 * i)  # idle 100+ s: a ttl of 30 s would long have expired
    assert a_unit.node is not None  # still cached: high units go only when nothing else can
    assert h.stats.evictions >= 1


def test_a_state_lost_in_one_group_leaves_no_partial_state():
    """Regression (fuzzer): two Mamba groups; while R runs, its checkpoint state at 12 tokens
    (page index 2, retired: free and cached) loses its hash in the first group (``evict_blocks``:
    data lost). The second group's copy is then a partial state (it can never hit: a hit needs
    both): it is dropped at once, no unit is made at index 2 when R is freed, and the
    invariants hold throughout. (A copy still held at that moment is dropped when R is freed.)"""
    geo = SuperblockGeometry(16, 2, 128, 176)
    cfg = KVCacheConfig(geo.num_pages, [KVCacheGroupSpec(["a0"], ATTN), KVCacheGroupSpec(["m0"], MAMBA),
                                        KVCacheGroupSpec(["m1"], MAMBA)], geo)
    coord = KVCacheCoordinator(cfg, max_model_len=256, eviction="lru")
    h = Harness.__new__(Harness)
    h.coord = coord
    req, _ = h.prefill("R", A, 1.0)  # 13 tokens: chunks end at 12 (a state at page index 2) and 13
    key = req.block_hashes[2]  # hash_block_size = the page size (4): the hash of page index 2
    m0, m1 = (coord.state_block_pool.cached_block_hash_to_block[g] for g in (1, 2))
    assert key in m0 and key in m1
    coord.state_block_pool.evict_blocks([m0[key].block_id])
    coord.check_invariants()
    assert key not in m0 and key not in m1 and coord.units.stats.partial_states == 1
    coord.free("R", now=2.0)
    coord.check_invariants()
    assert not any(coord.units.live_units())
