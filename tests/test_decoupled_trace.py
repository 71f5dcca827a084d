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
