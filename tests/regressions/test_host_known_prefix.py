"""A write-on-evict store of a parent unit whose pages the host already holds (its child went first).

Geometry of tests/eviction/test_units.py: 4-token pages, a 176 B state, k = 2. A (13 tokens) leaves a
checkpoint at page 2 (12 tokens); B = A + 10 tokens (23) one at page 4 (20 tokens). The GPU evicts
leaf first: B's unit (pages 3-4 and its state) goes to the host with every page 0..4, then A's unit
(the state at page 2: its pages are on the host already). The bug: the host's registration started
at the known prefix (5 pages) and walked past page 2, so A's state was cached on the host with no
unit (its invariant failed), and no load could ever use it.
"""

from __future__ import annotations

from mambakv import Request
from tests.host.harness import A, B, C, D, HostHarness


def test_parent_state_stored_after_its_child_becomes_a_host_unit() -> None:
    h = HostHarness(n=8, host_superblocks=40, write="evict")
    coord = h.coord
    host = coord.host
    assert host is not None
    h.run("A", A, 0.0)
    h.run("B", B, 1.0)
    probe = Request("q", B, max_tokens=1)
    probe.set_hash_block_size(4)
    keys = probe.block_hashes
    h.run("X0", C, 2.0)  # the GPU evicts B's unit (the leaf): pages 0..4 and the state at 4 go
    assert host.host_state(keys[4]) and not host.host_state(keys[2])
    h.run("X1", D, 3.0)  # then A's unit: only its state at 2 (its pages are on the host)
    assert host.host_state(keys[2])
    units = sorted(u.index for u in host.units.live_units())
    assert units == [2, 4]  # the parent's state is a unit (before the fix: [4], the invariant failed)
    hit = coord.get_computed_blocks_tiered(Request("A2", A + [999], max_tokens=1), now=10.0)
    assert (hit.num_gpu_tokens, hit.num_host_tokens) == (0, 12)  # A's 3 pages and its state, from the host
    coord.check_invariants()


def test_write_through_state_above_the_known_prefix_becomes_a_unit() -> None:
    """C = B + 8 tokens (31): checkpoints at pages 2, 4 and 6 ((31 - 1) // 4 = 7 pages, the replay
    boundary at 28 tokens). The host holds A's and B's units; its unit at 2 is then lost (a cascade:
    its state goes, its pages stay below B's). C's free stores the states at 2 and 6 (4 is there):
    the host prefix is 5 pages, so the walk must start at page 2, not 5."""
    h = HostHarness(n=40, host_superblocks=40, write="through")
    coord = h.coord
    host = coord.host
    assert host is not None
    h.run("A", A, 0.0)
    h.run("B", B, 1.0)
    probe = Request("q", B, max_tokens=1)
    probe.set_hash_block_size(4)
    unit2 = host.units.unit_at(probe.block_hashes[2])
    assert unit2 is not None
    host.units.evict_unit(unit2, chosen=False)  # the lost state: pages 0..4 stay (B's unit below)
    assert not host.host_state(probe.block_hashes[2]) and host.host_prefix(probe.block_hashes, 5) == 5
    h.run("C", B + list(range(60, 68)), 2.0)
    units = sorted(u.index for u in host.units.live_units())
    assert units == [2, 4, 6]
