"""The Mooncake conversation trace, first 3000 requests, one at a time, 60 GiB (4818 blocks).

Reports library time per scheduler step (coordinator calls, prompt hashing and Request
appends) and the hit rate; vLLM 0.33.0 on the same run: hit rate 0.0381, about 45 us per step
(target: <= 0.3 of its time, hit rate >= its). Skipped when ../shared/traces/ is absent.

Run: ``pytest bench/bench_trace.py --benchmark-only``
"""

from __future__ import annotations

from pathlib import Path

import pytest
from common import py_ref_ms

from mambakv.sim import run_replay, run_trace

TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "conversation_trace.jsonl"
NUM_REQUESTS = 3000


@pytest.mark.skipif(not TRACE.exists(), reason="trace absent: ../shared/traces/conversation_trace.jsonl")
def test_trace_3000_one_at_a_time(benchmark):
    results = []

    def run():
        results.append(run_trace(TRACE, limit=NUM_REQUESTS, memory_gib=60.0, one_at_a_time=True))

    benchmark.pedantic(run, rounds=1, iterations=1)
    res = results[-1]
    d = res.to_dict()
    assert d["blocks_returned"] and d["finished"] == NUM_REQUESTS
    assert d["num_blocks"] == 4818
    benchmark.extra_info.update(hit_rate=d["hit_rate"], steps=d["steps"], library_s=d["library_s"],
                                library_us_per_step=d["library_us_per_step"], py_ref_ms=py_ref_ms())


@pytest.mark.skipif(not TRACE.exists(), reason="trace absent: ../shared/traces/conversation_trace.jsonl")
@pytest.mark.parametrize(("replay", "skip"), [("strict", 0), ("conversation", 0), ("conversation", 3000)],
                         ids=["strict", "conversation", "conversation-skip3000"])
@pytest.mark.parametrize("layout", ["unified", "decoupled"])
def test_trace_3000_by_layout(benchmark, replay, skip, layout):
    """The layouts' planning cost on the same 3000 requests, one at a time, 60 GiB (decoupled:
    64-token pages and state slots, 4,551 superblocks): requests 1-3000 under both replays and
    3001-6000 (``skip=3000``) under conversation replay. Issue 14's targets: decoupled hit rate
    >= 0.080 on the first 3000 (conversation); issue 32's: decoupled ``library_s`` at most 1.2x
    unified's on the first 3000 and 1.3x after ``skip=3000`` (compare the rows' extra_info,
    measured in one window)."""
    results = []

    def run():
        results.append(run_trace(TRACE, limit=NUM_REQUESTS, memory_gib=60.0, one_at_a_time=True,
                                 replay=replay, skip=skip, layout=layout))

    benchmark.pedantic(run, rounds=1, iterations=1)
    d = results[-1].to_dict()
    assert d["blocks_returned"] and d["finished"] == NUM_REQUESTS
    if layout == "decoupled":
        assert d["arena"]["superblocks"] == 4551
        if replay == "conversation" and not skip:
            assert d["hit_rate"] >= 0.080
    benchmark.extra_info.update(hit_rate=d["hit_rate"], library_s=d["library_s"], steps=d["steps"],
                                library_us_per_step=d["library_us_per_step"], py_ref_ms=py_ref_ms())


@pytest.mark.parametrize("layout", ["unified", "decoupled"])
def test_replay_480k_by_layout(benchmark, layout):
    """The 480,031-token replay (``mambakv replay``'s defaults: 5 drafts, 2 steps in flight,
    60 GiB) in each layout. Issue 32's target: decoupled ``library_s`` at most 2x unified's; the
    peaks of both are those of docs/replay.md (compare the rows' extra_info)."""
    results = []

    def run():
        results.append(run_replay(layout=layout))

    benchmark.pedantic(run, rounds=3, iterations=1)
    d = results[-1].to_dict()
    assert d["blocks_returned"] and d["finished"] == 1
    benchmark.extra_info.update(library_s=d["library_s"], peak_bytes=d["peak_bytes"], steps=d["steps"],
                                py_ref_ms=py_ref_ms())


@pytest.mark.skipif(not TRACE.exists(), reason="trace absent: ../shared/traces/conversation_trace.jsonl")
@pytest.mark.parametrize("eviction", ["reuse", "lru"])
def test_trace_3000_conversation_by_eviction(benchmark, eviction):
    """Issue 15's figure: the decoupled layout's eviction units on the same 3000 requests
    (conversation replay, 60 GiB, the trace clock as ``now``). Targets: reuse-aware (learned
    online) hit rate >= 0.100; its ``library_s`` within 1.5x of ``lru``'s (compare the rows'
    extra_info)."""
    results = []

    def run():
        results.append(run_trace(TRACE, limit=NUM_REQUESTS, memory_gib=60.0, one_at_a_time=True,
                                 replay="conversation", layout="decoupled", eviction=eviction))

    benchmark.pedantic(run, rounds=1, iterations=1)
    d = results[-1].to_dict()
    assert d["blocks_returned"] and d["finished"] == NUM_REQUESTS
    assert d["eviction"]["policy"] == eviction and d["eviction"]["cascade_evictions"] == 0
    if eviction == "reuse":
        assert d["hit_rate"] >= 0.100
    benchmark.extra_info.update(hit_rate=d["hit_rate"], library_s=d["library_s"], steps=d["steps"],
                                library_us_per_step=d["library_us_per_step"], unit_evictions=d["eviction"]["evictions"],
                                ghost_hits=d["eviction"]["ghost_hits"], py_ref_ms=py_ref_ms())


@pytest.mark.skipif(not TRACE.exists(), reason="trace absent: ../shared/traces/conversation_trace.jsonl")
@pytest.mark.parametrize("host", [None, "through", "evict"])
def test_trace_3000_conversation_by_host_tier(benchmark, host):
    """Issue 17's figures: a 256 GiB host tier under the 60 GiB decoupled GPU tier (conversation
    replay, one at a time, 3000 requests). Targets: ``hit_rate`` (GPU + host) >= 0.23; the
    library time with the tier within 1.5x of the same run without one (compare the rows'
    ``library_us_per_step``)."""
    results = []

    def run():
        results.append(run_trace(TRACE, limit=NUM_REQUESTS, memory_gib=60.0, one_at_a_time=True,
                                 replay="conversation", layout="decoupled",
                                 host_memory_gib=None if host is None else 256.0, host_write=host or "through"))

    benchmark.pedantic(run, rounds=1, iterations=1)
    d = results[-1].to_dict()
    assert d["blocks_returned"] and d["finished"] == NUM_REQUESTS
    if host is not None:
        assert d["hit_rate"] >= 0.23 and d["host"]["aborted_loads"] == 0
    benchmark.extra_info.update(hit_rate=d["hit_rate"], hit_rate_host=d.get("hit_rate_host", 0.0),
                                library_s=d["library_s"], steps=d["steps"],
                                library_us_per_step=d["library_us_per_step"], bytes_h2d=d.get("bytes_h2d", 0),
                                bytes_d2h=d.get("bytes_d2h", 0), py_ref_ms=py_ref_ms())
