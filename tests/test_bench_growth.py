"""``bench/growth.py`` (issue 32's growth curves) on tiny points: a 30k-token replay and the
first 30 trace requests, a few seconds. The records carry every field, positive times and host
memory, and the peaks the run's own result dict reports."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from mambakv.sim import run_replay, run_trace

BENCH = Path(__file__).resolve().parents[1] / "bench" / "growth.py"
TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "conversation_trace.jsonl"


@pytest.fixture(scope="module")
def growth() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_growth_script", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_replay_point_records(growth: ModuleType) -> None:
    records = growth.replay_point(30_000, 60.0, repeat=2)
    by = {r["layout"]: r for r in records}
    assert sorted(by) == ["decoupled", "unified"]
    for layout, r in by.items():
        assert r["fits"] and r["prompt_tokens"] == 30_000 and r["axis"] == "prompt"
        assert len(r["library_s_all"]) == 2 and r["library_s"] == min(r["library_s_all"]) > 0
        assert r["library_ms"] == pytest.approx(r["library_s"] * 1e3)
        assert r["library_us_per_1k"] == pytest.approx(r["library_s"] * 1e9 / 30_000)
        assert r["py_peak"] > 0 and 0 < r["lib_retained"], (layout, r)
        # the cache's peak as the run's own result reports it (runs are deterministic)
        assert r["peak_bytes"] == run_replay(prompt_tokens=30_000, memory_gib=60.0, layout=layout).to_dict()["peak_bytes"]
    # 64-token pages against 544-token blocks: the two peaks are not one number by accident
    assert by["decoupled"]["peak_bytes"] != by["unified"]["peak_bytes"]
    lines = growth.prompt_table(records)
    assert len(lines) == 3 and lines[2].startswith("| 30,000 | ")


def test_replay_point_that_does_not_fit(growth: ModuleType) -> None:
    records = growth.replay_point(480_000, 2.0)
    assert [r["fits"] for r in records] == [False, False] and all(r["error"] for r in records)
    assert "does not fit" in growth.prompt_table(records)[2]


@pytest.mark.skipif(not TRACE.exists(), reason="../shared/traces/conversation_trace.jsonl absent")
def test_trace_point_records(growth: ModuleType) -> None:
    records = growth.trace_point(60.0, 30, TRACE, memory_limit=10)
    by = {r["layout"]: r for r in records}
    assert sorted(by) == ["decoupled", "unified"]
    for layout, r in by.items():
        assert r["requests"] == 30 and r["memory_requests"] == 10 and r["memory_gib"] == 60.0
        assert r["library_s"] > 0 and r["library_us_per_request"] == pytest.approx(r["library_s"] * 1e6 / 30)
        assert 0.0 <= r["hit_rate"] <= 1.0 and r["py_peak"] > 0 and r["lib_retained"] > 0
        d = run_trace(TRACE, limit=30, memory_gib=60.0, one_at_a_time=True, replay="conversation",
                      layout=layout).to_dict()
        assert (r["peak_bytes"], r["hit_rate"], r["num_blocks"]) == (d["peak_bytes"], d["hit_rate"], d["num_blocks"])
    assert by["decoupled"]["num_blocks"] != by["unified"]["num_blocks"]
    lines = growth.cache_table(records)
    assert len(lines) == 3 and lines[2].startswith("| 60 | ")


@pytest.mark.parametrize(("argv", "why"), [
    (["--repeat", "0"], "--repeat must be >= 1"),
    (["--limit", "-5"], "--limit must be >= 1"),
    (["--memory-limit", "0"], "--memory-limit must be >= 1"),
    (["--replay-memory-gib", "inf"], "--replay-memory-gib must be a finite number"),
    (["--json", "/nonexistent-dir/x.json"], "--json: /nonexistent-dir is not a directory"),
    (["--only", "cache", "--trace", "/nonexistent.jsonl"], "needs the trace"),
])
def test_bad_options_are_refused_before_any_work(growth: ModuleType, capsys: pytest.CaptureFixture[str],
                                                 argv: list[str], why: str) -> None:
    """One line and exit 2 before the first point (a full run takes about 20 minutes)."""
    with pytest.raises(SystemExit) as exit_info:
        growth.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr()
    assert why in err.err and "py_ref_ms" not in err.out
