"""``mambakv sweep``: grids, one ordinary ``trace`` run per point, resumable records, parallel
workers and Ray, the table / CSV / figure (issue 33)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

import mambakv.cli.sweep as sweep
from mambakv.cli import main
from mambakv.cli.sweep import Point, SweepError, parse_grid, sweep_points

TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "conversation_trace.jsonl"
#: keys that measure time (or where the machine was): they differ between any two runs
TIMINGS = {"wall_s", "wall_ms", "build_s", "library_s", "library_ms", "library_us_per_step", "library_calls",
           "library_net_us_per_step", "step_us", "hash_ms"}


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 requests of the real trace (or a synthetic one without it): a few seconds per point."""
    path = tmp_path_factory.mktemp("sweep") / "t.jsonl"
    if TRACE.exists():
        lines = TRACE.read_text().splitlines()[:40]
    else:  # pragma: no cover - the trace ships beside the project
        lines = [json.dumps({"timestamp": 1000 * i, "input_length": 1024 + 64 * (i % 5), "output_length": 8,
                             "hash_ids": list(range(i % 3, i % 3 + 2 + i % 5))}) for i in range(40)]
    path.write_text("\n".join(lines) + "\n")
    return path


def without_timings(d: dict) -> dict:
    return {k: v for k, v in d.items() if k not in TIMINGS}


def trace_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["trace", *argv, "--json", "--quiet"]) == 0
    return json.loads(capsys.readouterr().out)


# --------------------------------------------------------------------------- grids
def test_parse_grid_lists_and_ranges() -> None:
    assert parse_grid("20,40, 60", float, "memory-gib") == [20.0, 40.0, 60.0]
    assert parse_grid("20:60:20", float, "memory-gib") == [20.0, 40.0, 60.0]  # STOP on the grid: included
    assert parse_grid("20:50:20", float, "memory-gib") == [20.0, 40.0]
    assert parse_grid("0.5:1.5:0.5", float, "memory-gib") == [0.5, 1.0, 1.5]
    assert parse_grid("40,20,40", float, "memory-gib") == [40.0, 20.0]  # order kept, repeats dropped
    for bad in ("", "a,b", "20:10:5", "1:2:0", "1:2", "inf:5:1"):
        with pytest.raises(SweepError):
            parse_grid(bad, float, "memory-gib")


def test_a_host_record_matches_the_memory_asked_for() -> None:
    """A host tier of 64 GiB in whole 13.5 MiB superblocks reads 63.9932 GiB in its record."""
    pts = sweep_points([10], [0, 64], ["decoupled"], ["reuse"], [64])
    rec = {"layout": "decoupled", "eviction_policy": "reuse", "host_memory_gib": 63.9932, "page_tokens": 64,
           "memory_gib": 10.0}
    assert sweep.match_point(rec, pts) == Point("decoupled", "reuse", 64.0, 64, 10.0)
    assert sweep.match_point({**rec, "host_memory_gib": None}, pts) == Point("decoupled", "reuse", 0.0, 64, 10.0)
    assert sweep.match_point({**rec, "host_memory_gib": 60.0}, pts) is None


def test_unified_points_do_not_multiply_by_eviction_or_page_size() -> None:
    """2 memories x 2 host settings: unified 4 points; decoupled 2 x 2 x 2 evictions x 2 pages = 16."""
    pts = sweep_points([20, 40], [0, 256], ["unified", "decoupled"], ["reuse", "lru"], [64, 128])
    assert len([p for p in pts if p.layout == "unified"]) == 4
    assert len([p for p in pts if p.layout == "decoupled"]) == 16
    assert Point("unified", None, 256.0, None, 20.0).trace_options() == [
        "--layout", "unified", "--memory-gib", "20.0", "--host-memory-gib", "256.0"]


# --------------------------------------------------------------------------- a point is a trace run
def test_every_point_equals_the_trace_command(small_trace: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sweep", str(small_trace), "--memory-gib", "4,8", "--layout", "unified,decoupled", "--eviction",
            "reuse,lru", "--one-at-a-time", "--json", "--quiet", "--workers", "1"]
    assert main(argv) == 0
    records = json.loads(capsys.readouterr().out)
    assert len(records) == 2 + 4  # unified x 2 memories, decoupled x 2 memories x 2 policies
    for d in records:
        p = Point.of_record(d)
        alone = trace_json(capsys, str(small_trace), "--one-at-a-time", *p.trace_options())
        assert without_timings(d) == without_timings(alone), p


def test_parallel_workers_give_the_same_records(small_trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["sweep", str(small_trace), "--memory-gib", "4,6", "--layout", "decoupled", "--one-at-a-time", "--json",
            "--quiet"]
    assert main([*base, "--workers", "1"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert main([*base, "--workers", "2"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert [without_timings(d) for d in one] == [without_timings(d) for d in two]


# --------------------------------------------------------------------------- resuming
def test_a_sweep_resumes_and_reuses_only_matching_points(small_trace: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s"
    calls: list[tuple] = []
    real = sweep.run_point

    def counting(trace: str, options: list[str]) -> dict:
        calls.append(tuple(options))
        return real(trace, options)

    monkeypatch.setattr(sweep, "run_point", counting)
    argv = ["sweep", str(small_trace), "--memory-gib", "4,8", "--layout", "unified", "--one-at-a-time", "--out",
            str(out), "--quiet", "--workers", "1"]
    assert main(argv) == 0
    assert len(calls) == 2
    lines = (out / "points.jsonl").read_text().splitlines()
    assert len(lines) == 2 and all(json.loads(x)["layout"] == "unified" for x in lines)
    assert main(argv) == 0  # everything reused
    assert len(calls) == 2
    assert main([*argv[:3], "4,8,12", *argv[4:]]) == 0  # one new point
    assert len(calls) == 3 and len((out / "points.jsonl").read_text().splitlines()) == 3
    # a torn last line (a crash while writing it) is dropped and that point runs again
    with open(out / "points.jsonl", "ab") as f:
        f.write(b'{"layout": "unified", "memory_')
    assert main([*argv[:3], "4,8,12,16", *argv[4:]]) == 0
    assert len(calls) == 4
    assert all(json.loads(x) for x in (out / "points.jsonl").read_text().splitlines())
    # another option: nothing is reused
    assert main([*argv, "--max-num-seqs", "8"]) == 0
    assert len(calls) == 6 and (out / "points.jsonl.old").exists()
    # the trace file changed: nothing is reused
    small_copy = tmp_path / "t2.jsonl"
    small_copy.write_text(small_trace.read_text())
    out2 = tmp_path / "s2"
    argv2 = [argv[0], str(small_copy), *argv[2:]]
    argv2[argv2.index(str(out))] = str(out2)
    assert main(argv2) == 0
    n = len(calls)
    small_copy.write_text(small_trace.read_text().replace('"output_length": ', '"output_length": 1', 1))
    assert main(argv2) == 0
    assert len(calls) == n + 2
    capsys.readouterr()


def test_ctrl_c_leaves_only_whole_points(small_trace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s"
    real = sweep.run_point
    done: list[int] = []

    def interrupted(trace: str, options: list[str]) -> dict:
        if done:
            raise KeyboardInterrupt
        done.append(1)
        return real(trace, options)

    monkeypatch.setattr(sweep, "run_point", interrupted)
    argv = ["sweep", str(small_trace), "--memory-gib", "4,8,12", "--layout", "unified", "--one-at-a-time", "--out",
            str(out), "--quiet", "--workers", "1"]
    assert main(argv) == 130
    lines = (out / "points.jsonl").read_bytes().splitlines(keepends=True)
    assert len(lines) == 1 and lines[0].endswith(b"\n") and json.loads(lines[0])["memory_gib"] == 4.0
    monkeypatch.setattr(sweep, "run_point", real)
    assert main(argv) == 0  # resumes: 8 and 12 run
    assert len((out / "points.jsonl").read_text().splitlines()) == 3
    capsys.readouterr()


# --------------------------------------------------------------------------- Ray
def test_ray_runs_one_task_per_point(small_trace: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A stand-in ``ray`` module (the real one is the optional extra mambakv[ray]): tasks run at
    ``remote()``; the sweep waits for them one at a time."""
    seen: dict[str, object] = {}

    class Ref:
        def __init__(self, value: object) -> None:
            self.value = value

    def remote(fn):  # type: ignore[no-untyped-def]
        return types.SimpleNamespace(remote=lambda *a: Ref(fn(*a)))

    fake = types.SimpleNamespace(
        is_initialized=lambda: bool(seen), init=lambda address=None, **kw: seen.setdefault("address", address),
        remote=remote, wait=lambda refs, num_returns=1: (refs[:num_returns], refs[num_returns:]),
        get=lambda ref: ref.value, cancel=lambda ref: None)
    monkeypatch.setitem(sys.modules, "ray", fake)
    assert main(["sweep", str(small_trace), "--memory-gib", "4,8", "--layout", "unified", "--one-at-a-time",
                 "--json", "--quiet", "--ray", "ray://head:10001"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert seen["address"] == "ray://head:10001" and [d["memory_gib"] for d in records] == [4.0, 8.0]


def test_ray_missing_is_one_line(small_trace: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    assert main(["sweep", str(small_trace), "--memory-gib", "4", "--layout", "unified", "--ray", "--quiet"]) == 2
    assert "mambakv[ray]" in capsys.readouterr().err


# --------------------------------------------------------------------------- what a person reads
def test_table_csv_plot_and_reading(small_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png, csv_path = tmp_path / "s.png", tmp_path / "s.csv"
    assert main(["sweep", str(small_trace), "--memory-gib", "3,4,8", "--layout", "unified,decoupled",
                 "--one-at-a-time", "--quiet", "--workers", "1", "--plot", str(png), "--csv", str(csv_path)]) == 0
    text = capsys.readouterr().out
    assert "reading the sweep:" in text and "unified (vLLM 0.33)" in text and "decoupled reuse" in text
    rows = csv_path.read_text().splitlines()
    assert rows[0].startswith("layout,eviction,host_gib") and len(rows) == 1 + 6
    assert png.stat().st_size > 10_000


def test_reading_names_the_smallest_memory_reaching_90_percent() -> None:
    """Hit rates 0.10 / 0.18 / 0.20 at 20 / 40 / 60 GiB: 90% of 0.20 is 0.18, first reached at 40."""
    def rec(mem: float, hit: float) -> dict:
        return {"layout": "unified", "memory_gib": mem, "host_memory_gib": None, "page_tokens": 64, "hit_rate": hit}

    pairs = [(Point("unified", None, 0.0, None, float(m)), rec(m, h)) for m, h in ((20, 0.10), (40, 0.18), (60, 0.20))]
    (line,) = sweep.readings(pairs)
    assert line.startswith("unified (vLLM 0.33): 40 GiB reaches 90% of its hit rate at 60 GiB (0.2000)")


@pytest.mark.parametrize(("argv", "needle"), [
    (["--memory-gib", "x"], "--memory-gib"),
    (["--layout", "unified,fancy"], "--layout"),
    (["--workers", "0"], "--workers"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),           # a trace option, checked before any point runs
    (["--plot", "/nonexistent/dir/x.png"], "--plot"),
])
def test_bad_sweeps_exit_2_before_any_point(small_trace: Path, argv: list[str], needle: str,
                                            monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sweep, "run_point", lambda *a: pytest.fail("a point ran"))
    assert main(["sweep", str(small_trace), "--quiet", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mambakv: error:") and needle in err and err.count("\n") == 1


def test_real_ray_gives_the_process_pool_records(small_trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A local Ray instance (the extra mambakv[ray]; skipped without it): the same points as two
    worker processes, record for record apart from timings."""
    ray = pytest.importorskip("ray")
    argv = ["sweep", str(small_trace), "--memory-gib", "4,8", "--layout", "unified,decoupled", "--one-at-a-time",
            "--json", "--quiet"]
    assert main([*argv, "--workers", "2"]) == 0
    pooled = json.loads(capsys.readouterr().out)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        assert main([*argv, "--ray"]) == 0  # joins the running local instance
        on_ray = json.loads(capsys.readouterr().out)
    finally:
        ray.shutdown()
    assert len(pooled) == 4
    assert [without_timings(d) for d in on_ray] == [without_timings(d) for d in pooled]
