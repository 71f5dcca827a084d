"""``KVCacheBlocks.table_appends``: what an append-only worker table gains per step (vLLM's
worker convention). A worker that appends every ``table_appends[g]`` to its copy of the table
(and starts a new copy for a new or resumed request) has ``get_block_ids``' length and agrees
with it at every slot where ``get_block_ids`` is not null, after every step: chunked prefill,
spec decode with its verifies, async lag, preemption and hits, in both layouts."""

from __future__ import annotations

import random

import pytest

from mambakv import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheCoordinator,
    KVCacheGroupSpec,
    MambaSpec,
    Request,
    SlidingWindowSpec,
)
from mambakv.core.arena import SuperblockGeometry
from tests.helpers import STATE_DTYPES, STATE_SHAPES

BS = 16
ATTN = FullAttentionSpec(BS, num_kv_heads=1, head_size=8, dtype="bfloat16")


def build(layout: str, nspec: int) -> KVCacheCoordinator:
    mamba = MambaSpec(BS, STATE_SHAPES, STATE_DTYPES, mode="align", num_speculative_blocks=nspec)
    groups = [KVCacheGroupSpec(["a"], ATTN), KVCacheGroupSpec(["m1"], mamba), KVCacheGroupSpec(["m2"], mamba),
              KVCacheGroupSpec(["w"], SlidingWindowSpec(BS, 1, 8, "bfloat16", 40))]
    if layout == "unified":
        config = KVCacheConfig(120, groups)
    else:
        geo = SuperblockGeometry(120, 1, ATTN.page_size_bytes, mamba.raw_page_size_bytes)
        config = KVCacheConfig(geo.num_pages, groups, geo)
    return KVCacheCoordinator(config, max_model_len=400)


class Worker:
    """The engine's worker: append-only block tables per request and group."""

    def __init__(self, num_groups: int) -> None:
        self.num_groups = num_groups
        self.tables: dict[str, list[list[int]]] = {}

    def apply(self, rid: str, result, new: bool) -> None:  # type: ignore[no-untyped-def]
        if new or rid not in self.tables:
            self.tables[rid] = [[] for _ in range(self.num_groups)]
        for g, ids in enumerate(result.get_table_append_ids()):
            self.tables[rid][g] += ids

    def check(self, coord: KVCacheCoordinator) -> None:
        for rid in coord.request_ids:
            ours = coord.get_block_ids(rid)
            mine = self.tables[rid]
            for g in range(self.num_groups):
                assert len(mine[g]) == len(ours[g]), (rid, g, mine[g], ours[g])
                for slot, (w, b) in enumerate(zip(mine[g], ours[g])):
                    assert b == 0 or w == b, f"{rid} group {g} slot {slot}: worker {w}, coordinator {b}"


@pytest.mark.parametrize("layout", ["unified", "decoupled"])
@pytest.mark.parametrize("nspec", [0, 2])
def test_an_append_only_worker_table_follows_every_step(layout: str, nspec: int) -> None:
    bases = [list(range(1000 + 97 * k, 1000 + 97 * k + 300)) for k in range(2)]
    for seed in range(6):
        rng = random.Random(seed)
        coord, worker = build(layout, nspec), Worker(4)
        reqs: dict[str, Request] = {}
        pending: dict[str, list[int]] = {}   # computed counts of steps not retired (async lag)
        drafted: dict[str, int] = {}
        for i in range(150):
            coord.new_step()
            r = rng.random()
            if (r < 0.2 or not reqs) and len(reqs) < 3:
                base = rng.choice(bases)
                prompt = base[: rng.randrange(20, len(base))] + [rng.randrange(5000, 6000)]
                req = Request(f"r{i}", prompt)
                blocks, hit = coord.get_computed_blocks(req)
                n = min(len(prompt) - hit, rng.choice([BS, 2 * BS, 5 * BS]))
                res = coord.allocate(req, n, num_new_computed_tokens=hit, new_computed_blocks=blocks, num_draft_tokens=0)
                if res is not None:
                    worker.apply(req.request_id, res, new=True)
                    req.num_computed_tokens = hit + n
                    reqs[req.request_id] = req
                    pending[req.request_id] = [req.num_computed_tokens]
            elif r < 0.85 and reqs:
                rid = rng.choice(sorted(reqs))
                req = reqs[rid]
                if rid in drafted:  # verify first
                    d = drafted.pop(rid)
                    a = rng.randrange(d + 1)
                    coord.accept_drafts(rid, a)
                    req.num_computed_tokens -= d - a
                    req.append_output_token_ids([7] * (a + 1))
                    pending[rid].append(req.num_computed_tokens)
                    continue
                if rng.random() < 0.5 and len(pending[rid]) > 1:  # outputs of older steps come back
                    k = rng.randrange(len(pending[rid]))
                    coord.retire(rid, pending[rid][k])
                    del pending[rid][:k]
                left = req.num_prompt_tokens - req.num_computed_tokens
                if left > 0:
                    n, d = min(left, rng.choice([BS, 2 * BS, 3 * BS, rng.randrange(1, 2 * BS)])), 0
                else:
                    if req.num_computed_tokens >= req.num_tokens:
                        req.append_output_token_ids([8])
                    d = rng.randrange(nspec + 1) if rng.random() < 0.6 else 0
                    n = 1 + d
                if req.num_computed_tokens + n + 5 > coord.max_model_len:
                    continue
                res = coord.allocate(req, n, num_draft_tokens=d)
                if res is None:  # no room: preempt the newest other request (the engine re-queues it)
                    victim = sorted(reqs)[-1] if sorted(reqs)[-1] != rid else None
                    if victim is not None:
                        coord.free(victim)
                        reqs.pop(victim)
                        drafted.pop(victim, None)
                        pending.pop(victim)
                        worker.tables.pop(victim)
                    continue
                worker.apply(rid, res, new=False)
                req.num_computed_tokens += n
                if d:
                    drafted[rid] = d
                else:
                    pending[rid].append(req.num_computed_tokens)
            elif reqs:
                rid = rng.choice(sorted(reqs))
                coord.free(rid)
                reqs.pop(rid)
                drafted.pop(rid, None)
                pending.pop(rid)
                worker.tables.pop(rid)
            coord.take_step_plan()
            worker.check(coord)
            coord.check_invariants()


def test_grow_appends_the_relocated_scratch_block_by_hand() -> None:
    """FA 16 + Mamba 16 (nspec 1) unified. A 100-token prompt, admission to 16: FA [1], Mamba
    [R=2 S=3] (running slot 0). Chunk to 64: FA takes 4 5 6; Mamba's running slot moves to 3:
    pad to 3 -> [2 3 0], relocate scratch 3 (slot 1, now below the running slot) to the end ->
    [2 0 0 3], take one block 7 -> [2 0 0 3 7]. blocks = [7]; table_appends = [0 3 7]: the worker
    [2 3] + [0 3 7] = [2 3 0 3 7] agrees with [2 0 0 3 7] wherever the latter is not null."""
    mamba = MambaSpec(BS, STATE_SHAPES, STATE_DTYPES, mode="align", num_speculative_blocks=1)
    coord = KVCacheCoordinator(KVCacheConfig(30, [KVCacheGroupSpec(["a"], ATTN), KVCacheGroupSpec(["m"], mamba)]),
                               max_model_len=400)
    req = Request("a", list(range(100)))
    first = coord.allocate(req, 16, num_draft_tokens=0)
    assert first is not None and first.get_table_append_ids() == ([1], [2, 3]) == first.get_block_ids()
    req.num_computed_tokens = 16
    res = coord.allocate(req, 48, num_draft_tokens=0)
    assert res is not None
    assert coord.get_block_ids("a") == ([1, 4, 5, 6], [2, 0, 0, 3, 7])
    assert res.get_block_ids() == ([4, 5, 6], [7])
    assert res.get_table_append_ids() == ([4, 5, 6], [0, 3, 7])
