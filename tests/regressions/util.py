"""Helpers of the regression suite: tiny configs, a snapshot of all pool / table state (to prove
that a refused call changed nothing) and the engine's step order in a few lines."""

from __future__ import annotations

from mambakv import (
    BlockPool,
    KVCacheCoordinator,
    Request,
)
from tests.coord_helpers import coordinator, fa_spec, sw_spec, tokens  # noqa: F401 (re-exported)
from tests.helpers import STATE_DTYPES, STATE_SHAPES, mamba_spec  # noqa: F401 (re-exported)

# The suite's tiny specs and configs are the shared ones of tests/coord_helpers.py:
# fa(bs), sw(bs, w), mamba(bs, nspec, mode), coordinator(num_blocks, *specs), tokens(n).
fa, sw, mamba = fa_spec, sw_spec, mamba_spec


def admit(coord: KVCacheCoordinator, req: Request, num_new: int | None = None):
    """A new request: look up its prefix, allocate the rest (or `num_new` tokens after the hit),
    advance its computed count. Returns (hit tokens, new blocks or None)."""
    blocks, hit = coord.get_computed_blocks(req)
    n = req.num_tokens - hit if num_new is None else num_new
    new = coord.allocate(req, n, num_new_computed_tokens=hit, new_computed_blocks=blocks)
    if new is not None:
        req.num_computed_tokens = hit + n
    coord.check_invariants()
    return hit, new


def queue_ids(pool: BlockPool) -> list[int]:
    """The free queue from head (reused first) to tail."""
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def hashed_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.blocks if b.block_hash is not None]


def pool_snapshot(pool: BlockPool) -> tuple:
    """Queue order, every block's (ref count, hash, group, links set) and the prefix-cache map."""
    blocks = [(b.ref_cnt, b.block_hash, b.cache_group_id, b.prev_free_block is None, b.next_free_block is None)
              for b in pool.blocks]
    cache = {gid: {h: (e.block_id if not isinstance(e, dict) else tuple(sorted(e))) for h, e in m.items()}
             for gid, m in pool.cached_block_hash_to_block.items()}
    return pool.get_num_free_blocks(), queue_ids(pool), blocks, cache


def snapshot(coord: KVCacheCoordinator) -> tuple:
    """The pool snapshot plus every group's tables and per-request bookkeeping (public views)."""
    tables = [{rid: m.describe(rid) for rid in m.req_to_blocks} for m in coord.managers]
    plans = [m.pending_plan() for m in coord.mamba_managers]
    return pool_snapshot(coord.block_pool), tables, plans, sorted(coord.request_ids)


class Engine:
    """A tiny engine loop for the properties: chunked prefill (chunks of whole blocks of
    `block` tokens, the last one up to the prompt end), decode of 1 token + `drafts` drafts once
    the previous result is back, results processed oldest first (``process``): drafts verified
    (``accept_drafts``, half of them accepted), then ``retire`` to the settled count.

    Prompts come from a few fixed "families" so that requests share prefixes.
    """

    def __init__(self, coord: KVCacheCoordinator, block: int, drafts: int = 0) -> None:
        self.coord = coord
        self.block = block
        self.drafts = drafts
        self.reqs: dict[str, Request] = {}
        self.pending: dict[str, list[tuple[int, int]]] = {}  # (scheduled end, drafts) not processed
        self.settled: dict[str, int] = {}                    # last retired count (or the hit)
        self.hits: dict[str, int] = {}
        self.n = 0

    @staticmethod
    def prompt(family: int, length: int) -> list[int]:
        return tokens(length, start=1000 * (family + 1))

    def admit(self, family: int, length: int, chunk_blocks: int) -> str | None:
        rid = f"r{self.n}"
        self.n += 1
        req = Request(rid, self.prompt(family, length))
        blocks, hit = self.coord.get_computed_blocks(req)
        end = min(hit + chunk_blocks * self.block, length)
        new = self.coord.allocate(req, end - hit, num_new_computed_tokens=hit, new_computed_blocks=blocks)
        if new is None:
            return None
        req.num_computed_tokens = end
        self.reqs[rid], self.pending[rid], self.settled[rid], self.hits[rid] = req, [(end, 0)], hit, hit
        return rid

    def schedule(self, rid: str, chunk_blocks: int) -> bool:
        req = self.reqs[rid]
        c = req.num_computed_tokens
        drafts = 0
        if c >= req.num_tokens:  # (c > num_tokens: drafts of the last step still unverified)
            if self.pending[rid]:
                return False  # waits for its sampled token
            req.append_output_token_ids(7)
            end, drafts = c + 1 + self.drafts, self.drafts
        else:
            end = min(c + chunk_blocks * self.block, req.num_tokens)
        if self.coord.allocate(req, end - c) is None:
            return False  # (an appended token stays: the next schedule prefills it)
        req.num_computed_tokens = end
        self.pending[rid].append((end, drafts))
        return True

    def process(self, rid: str) -> int | None:
        if not self.pending[rid]:
            return None
        end, drafts = self.pending[rid].pop(0)
        if drafts:
            accepted = drafts // 2
            self.coord.accept_drafts(rid, accepted)
            req = self.reqs[rid]
            if accepted:
                req.append_output_token_ids([7] * accepted)
            end = end - drafts + accepted
            req.num_computed_tokens = end
        self.coord.retire(rid, end)
        self.settled[rid] = end
        return end

    def free(self, rid: str) -> None:
        self.coord.free(rid)
        for d in (self.reqs, self.pending, self.settled, self.hits):
            d.pop(rid)

    def run(self, ops):
        """Apply ops, yielding each after it ran: (0, family, length, chunk) admit;
        (1, i, chunk) schedule; (2, i) process; (3, i) free; i picks a live request modulo
        their number. check_invariants() after every op."""
        for op in ops:
            live = sorted(self.reqs)
            if op[0] == 0:
                self.admit(op[1], op[2], op[3])
            elif live:
                rid = live[op[1] % len(live)]
                if op[0] == 1:
                    self.schedule(rid, op[2])
                elif op[0] == 2:
                    self.process(rid)
                else:
                    self.free(rid)
            self.coord.check_invariants()
            yield op
