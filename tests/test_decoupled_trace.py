"""The decoupled layout on the real trace (first 300 requests, one at a time, 60 GiB): skipped
when ../shared/traces is absent. The full 3000-request figures are in docs/replay.md."""

from __future__ import annotations

from pathlib import Path

import pytest

from mambakv.sim import run_trace

TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "conversation_trace.jsonl"
needs_trace = pytest.mark.skipif(not TRACE.exists(), reason="../shared/traces/conversation_trace.jsonl absent")


@needs_trace
@pytest.mark.parametrize("replay", ["strict", "conversation"])
def test_decoupled_beats_unified_on_the_first_300(replay):
    runs = {layout: run_trace(TRACE, limit=300, one_at_a_time=True, replay=replay, layout=layout)
            for layout in ("unified", "decoupled")}
    u, d = (runs[k].to_dict() for k in ("unified", "decoupled"))
    assert u["prompt_tokens"] == d["prompt_tokens"] and u["finished"] == d["finished"] == 300
    assert u["blocks_returned"] and d["blocks_returned"] and d["preemptions"] == 0
    # 64-token pages let the 512-token block every request shares hit (unified's 544 grid never
    # can: its shared_prefix cause is 0), and states keyed on the 64-token grid serve next turns.
    assert u["hit_tokens_by_cause"]["shared_prefix"] == 0 < d["hit_tokens_by_cause"]["shared_prefix"]
    assert d["hit_rate"] >= 2 * u["hit_rate"] > 0
    a = d["arena"]
    b = a["final_bytes"]
    assert b["pages"] + b["states"] + b["idle"] + b["free"] == a["superblocks"] * a["superblock_bytes"]
    assert b["idle"] == (b["states"] // a["state_bytes"]) * (a["superblock_bytes"] - a["state_bytes"])
    runs["decoupled"].coord.check_invariants()


def test_state_slot_ids_are_slots_of_the_state_pool():
    # Decoupled, 2 drafts: a 100-token prompt on 64-token pages; before it runs every entry is
    # -1; after allocate, (running, scratch, scratch) are three distinct slot ids of the slot
    # pool, in the request's table, per Mamba group.
    from mambakv import KVCacheCoordinator, Request
    from mambakv.models import build_kv_cache_config

    cfg = build_kv_cache_config("qwen3-next-80b-a3b", 2 << 30, layout="decoupled", num_speculative_blocks=2)
    kv = KVCacheCoordinator(cfg, max_model_len=4096)
    req = Request("r", list(range(100)))
    assert set(kv.get_state_slot_ids("r").values()) == {(-1, -1, -1)}
    kv.allocate(req, 100, num_draft_tokens=0)
    ids = kv.get_state_slot_ids("r")
    assert sorted(ids) == [1, 2, 3]
    tables = kv.get_block_ids("r")
    for gid, rows in ids.items():
        assert len(set(rows)) == 3 and all(0 < r < cfg.superblocks.num_superblocks for r in rows)
        assert all(r in tables[gid] for r in rows)
        assert all(kv.state_block_pool.blocks[r].ref_cnt == 1 for r in rows)
