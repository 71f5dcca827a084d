"""Shared by the KV-event tests: a mirror that replays the raw event stream and checks its
rules, and a small synchronous engine that drives a coordinator through hits, chunked
prefill, decode, finishes, preemptions and prefix-cache resets."""

from __future__ import annotations

import random

from mambakv import AllBlocksCleared, BlockPool, BlockRemoved, BlockStored, KVCacheCoordinator, Request
from mambakv.core.hashing import hash_block_tokens


def pool_hashed(pool: BlockPool) -> set[tuple[int, bytes]]:
    """``(group, hash)`` of every hashed block (copies collapse)."""
    return {(b.cache_group_id, b.block_hash) for b in pool.blocks if b.block_hash is not None}


class StreamMirror:
    """Replays ``take_events()`` batches: every (group, hash) is stored once before it is
    removed; each BlockStored is one chain whose hashes its tokens reproduce."""

    def __init__(self, *, check_chain: bool = True) -> None:
        self.stored: set[tuple[int, bytes]] = set()
        self.check_chain = check_chain
        self.num_stored = self.num_removed = self.num_cleared = 0
        self.groups_stored: set[int] = set()

    def apply(self, events) -> None:
        for ev in events:
            if isinstance(ev, BlockStored):
                bs = ev.block_size
                assert len(ev.token_ids) == len(ev.block_hashes) * bs, ev
                parent = ev.parent_block_hash
                extra = ("lora:" + ev.lora_name,) if ev.lora_name is not None else None
                for i, h in enumerate(ev.block_hashes):
                    key = (ev.group_id, h)
                    assert key not in self.stored, f"{key} stored twice"
                    self.stored.add(key)
                    if self.check_chain:
                        assert hash_block_tokens(parent, ev.token_ids[i * bs : (i + 1) * bs], extra) == h
                    parent = h
                self.num_stored += len(ev.block_hashes)
                self.groups_stored.add(ev.group_id)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    key = (ev.group_id, h)
                    assert key in self.stored, f"{key} removed but never stored"
                    self.stored.remove(key)
                self.num_removed += len(ev.block_hashes)
            else:
                assert isinstance(ev, AllBlocksCleared)
                self.stored.clear()
                self.num_cleared += 1


class MiniEngine:
    """Synchronous scheduling of one coordinator: prefill chunks end on block boundaries (the
    Mamba align rule), one decode token per step, preemption when the pool is full."""

    def __init__(self, coord: KVCacheCoordinator, block_size: int, rng: random.Random, *,
                 chunk_blocks: int = 2, name: str = "w") -> None:
        self.coord = coord
        self.bs = block_size
        self.rng = rng
        self.chunk_blocks = chunk_blocks
        self.name = name
        self.running: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self._n = 0
        self.num_preemptions = 0

    def submit(self, tokens: list[int], max_tokens: int = 3, **kw) -> Request:
        self._n += 1
        req = Request(f"{self.name}-{self._n}", tokens, max_tokens=max_tokens, **kw)
        self.waiting.append(req)
        return req

    def _chunk(self, req: Request) -> int:
        """Tokens to schedule: up to the next chunk boundary, at most the known tokens (a
        decode step is the one sampled token; a preempted request recomputes its outputs)."""
        computed = req.num_computed_tokens
        return min(req.num_tokens, (computed // self.bs + self.chunk_blocks) * self.bs) - computed

    def _preempt(self, req: Request) -> None:
        self.coord.free(req.request_id)
        req.num_computed_tokens = 0
        self.running.pop(req.request_id, None)
        self.waiting.insert(0, req)
        self.num_preemptions += 1

    def step(self) -> None:
        """Admit at most one waiting request, then run one step of every running one."""
        c = self.coord
        admitted = None
        if self.waiting:
            req = self.waiting.pop(0)
            blocks, hit = c.get_computed_blocks(req)
            req.num_computed_tokens = 0
            end = min(req.num_tokens, (hit // self.bs + self.chunk_blocks) * self.bs)
            if c.allocate(req, end - hit, num_new_computed_tokens=hit, new_computed_blocks=blocks) is None:
                self.waiting.insert(0, req)
            else:
                req.num_computed_tokens = end
                self.running[req.request_id] = req
                admitted = req
                self._after_forward(req)
        for req in list(self.running.values()):
            if req is admitted or req.request_id not in self.running:
                continue
            n = self._chunk(req)
            if c.allocate(req, n) is None:
                self._preempt(req)
                continue
            req.num_computed_tokens += n
            self._after_forward(req)
        c.take_copy_plan(), c.take_zero_plan()

    def _after_forward(self, req: Request) -> None:
        c = self.coord
        c.retire(req.request_id, req.num_computed_tokens)
        if req.num_computed_tokens == req.num_tokens:  # a token is sampled
            if req.num_output_tokens >= (req.max_tokens or 0):
                c.free(req.request_id)
                del self.running[req.request_id]
            else:
                req.append_output_token_ids(self.rng.randrange(50, 60))

    def preempt_all(self) -> None:
        for rid in self.coord.preempt_all():
            req = self.running.pop(rid)
            self.waiting.insert(0, req)
