"""A host-tier harness on the geometry of tests/eviction/test_units.py (public API only).

GPU: 4-token pages of 128 B, a Mamba state of 176 B, superblocks of k = 2 pages (256 B); with 12
superblocks the page pool has 13 usable pages (superblock 0: the null page + 1) and the arena
turns superblocks into pages or one state slot each as needed.
Host: ``HostTierSpec(memory_bytes)`` holds ``memory_bytes // 256`` superblocks of the same
shape (its page 0 and slot 0 null).

The engine's transfer steps (mambakv/core/transfers.py, "The fence"): ``drain()`` takes the
step's transfer plan, "runs" its copies (nothing to copy here: no device memory) and reports them
done with ``transfers_done(plan.fence)``, as an engine on one stream would right after enqueueing
them; until then the GPU blocks a write-through store reads (and an aborted load's destinations)
are held. ``abcd`` / ``evict_b`` drain after every request, as the engine's next step would.
"""

from __future__ import annotations

from mambakv import KVCacheCoordinator, Request
from mambakv.core.host_tier import HostTierSpec
from mambakv.core.transfers import TransferPlan
from tests.eviction.test_units import A, B, C, D, E, config
from tests.property.fuzz_checks import in_use, snapshot

__all__ = ["A", "B", "B2", "C", "D", "E", "SB", "HostHarness", "full_snapshot"]

SB = 256  # bytes of one superblock: k = 2 pages of 128 B
B2 = B + [7, 7, 7]  # B's next turn: 26 tokens, cap (26 - 1) // 4 = 6 pages; B's chain is 5 pages


def full_snapshot(coord: KVCacheCoordinator) -> tuple:
    """Everything a refused call must leave alone: the GPU pools / managers / requests / arena
    (tests/property/fuzz_checks.snapshot), the host pools' free counts and the host stats."""
    host = coord.host
    extra = () if host is None else (host.arena.pages.get_num_free_blocks(), host.arena.slots.get_num_free_blocks(),
                                     repr(host.stats), host.units.num_pages)
    return snapshot(coord), extra, repr(coord.prefix_cache_stats)


class HostHarness:
    def __init__(self, n: int = 12, host_superblocks: int = 20, write: str = "through", eviction: str = "lru",
                 host_eviction: str | None = None) -> None:
        spec = HostTierSpec(host_superblocks * SB, write=write, eviction=host_eviction)
        self.coord = KVCacheCoordinator(config(n), max_model_len=256, eviction=eviction, host_tier=spec)

    @classmethod
    def over(cls, coord: KVCacheCoordinator) -> HostHarness:
        """The harness's calls over a coordinator built elsewhere (e.g. a unified layout)."""
        h = cls.__new__(cls)
        h.coord = coord
        return h

    # ------------------------------------------------------------------ the engine's calls
    def drain(self) -> TransferPlan:
        """One step's transfers on one stream: take the plan, run its copies, report them done
        (``transfers_done(plan.fence)``; fence 0 for the empty plan: a no-op);
        ``check_invariants()`` after each call. Returns the plan."""
        coord = self.coord
        plan = coord.take_transfer_plan()
        coord.check_invariants()
        self.land(plan)
        return plan

    def land(self, plan: TransferPlan) -> None:
        """The device finished `plan`'s copies (and every earlier plan's): ``transfers_done``."""
        self.coord.transfers_done(plan.fence)
        self.coord.check_invariants()

    def prefill(self, rid: str, toks: list[int], now: float, *, request: Request | None = None,
                free: bool = False) -> tuple[Request, int]:
        """Look up (tier-unaware), admit and prefill `toks` in 64-token chunks, retiring after
        each; ``check_invariants()`` after every call. Returns (request, hit tokens)."""
        coord = self.coord
        req = request or Request(rid, toks, max_tokens=1)
        hits, hit = coord.get_computed_blocks(req)
        coord.check_invariants()
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
            coord.check_invariants()
            req.num_computed_tokens = end
            coord.retire(rid, end)
            coord.take_step_plan()
            coord.check_invariants()
            c = end
        if free:
            coord.free(rid, now=now)
            coord.check_invariants()
        return req, hit

    def run(self, rid: str, toks: list[int], now: float, request: Request | None = None) -> int:
        return self.prefill(rid, toks, now, request=request, free=True)[1]

    def abcd(self) -> None:
        """A, B, C, D in turn, each freed, its stores drained and landed (the next step's plan)."""
        for rid, toks, now, hit in (("A", A, 0.0, 0), ("B", B, 10.0, 12), ("C", C, 20.0, 0), ("D", D, 30.0, 0)):
            assert self.run(rid, toks, now) == hit
            self.drain()

    def evict_b(self) -> None:
        """A..D then E: the GPU evicts B's unit (pages 3, 4 and the state at page 4), the oldest
        leaf (tests/eviction/test_units.py::test_lru_evicts_oldest_leaf_then_parent_becomes_leaf).
        E's stores (write-through; write 'evict': B's unit's) are drained and landed too: no
        transfer is left in flight and the fence holds nothing."""
        self.abcd()
        before = self.coord.units.stats.evictions
        assert self.run("E", E, 40.0) == 0
        assert self.coord.units.stats.evictions == before + 1
        self.drain()

    # ------------------------------------------------------------------ queries
    def gpu_hit(self, toks: list[int]) -> int:
        n = self.coord.get_computed_blocks(Request("probe", toks))[1]
        self.coord.check_invariants()
        return n

    def free_counts(self) -> tuple[int, int, int, int]:
        """(GPU free pages, GPU free slots, host pinned pages, host pinned slots). (Host free
        counts move with the host arena's conversions; pinned ones only with loads.)"""
        c = self.coord
        return (c.block_pool.get_num_free_blocks(), c.state_block_pool.get_num_free_blocks(),
                in_use(c.host.arena.pages), in_use(c.host.arena.slots))

    def nothing_held(self) -> None:
        """No GPU block in use; no host block pinned."""
        c = self.coord
        assert not any(in_use(p) for p in c.pools), "a GPU block is still held"
        assert not any(in_use(p) for p in (c.host.arena.pages, c.host.arena.slots)), "a host block is still pinned"
