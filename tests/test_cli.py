"""The `mambakv` command: replay / trace / chat / models output, and bad input -> exit 2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mambakv.cli import main

ROOT = Path(__file__).resolve().parents[1]


def write_trace(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# Two requests: B's first 2000 tokens are A's whole prompt (hash ids 1..4, A's 4th block
# partial: 2000 - 3 x 512 = 464 tokens of id 4, B has the first 464 of the same 512).
ROWS = [
    {"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [1, 2, 3, 4]},
    {"timestamp": 50, "input_length": 2100, "output_length": 1, "hash_ids": [1, 2, 3, 4, 5]},
]


def test_replay_json_subprocess_smoke():
    out = subprocess.run([sys.executable, "-m", "mambakv.cli", "replay", "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""  # no progress bar when stderr is not a terminal
    d = json.loads(out.stdout)
    for key in ("steps", "wall_ms", "peak_mamba_blocks_per_request", "groups"):
        assert key in d
    assert d["peak_mamba_blocks_per_request"] == {"1": 9, "2": 9, "3": 9}  # 2 + 5 + 2
    for g in d["groups"]:
        assert {"kind", "block_size", "peak_blocks", "peak_bytes"} <= g.keys()
    assert d["blocks_returned"] is True


def test_replay_table_lists_groups_and_steps(capsys):
    assert main(["replay", "--in-flight", "0", "--output-tokens", "1"]) == 0
    out = capsys.readouterr().out
    assert "full_attention" in out and out.count("mamba ") >= 3
    assert "steps 60;" in out  # see test_sim: 59 aligned chunks + the last 223 tokens
    assert "all blocks returned: yes" in out


def test_trace_json_keys_and_exact_hit(tmp_path, capsys):
    p = write_trace(tmp_path / "t.jsonl", ROWS)
    assert main(["trace", str(p), "--one-at-a-time", "--json", "--quiet", "--layout", "unified"]) == 0
    d = json.loads(capsys.readouterr().out)
    for key in ("requests", "prompt_tokens", "cached_tokens", "hit_rate", "preemptions", "peak_blocks",
                "steps", "wall_s", "library_s"):
        assert key in d
    # A: stop 1999 // 544 * 544 = 1632 -> chunks [0,1632) [1632,2000), a state at 1632.
    # B: cap 2099 // 544 * 544 = 1632; 3 attention blocks + the state at 1632 -> 1632 cached.
    assert d["requests"] == 2 and d["prompt_tokens"] == 4100 and d["cached_tokens"] == 1632
    assert d["hit_rate"] == pytest.approx(1632 / 4100, abs=1e-6)
    # steps: A 2 chunks; B starts at its stop 1632 and computes 2100 - 1632 = 468 in 1 step
    assert d["preemptions"] == 0 and d["steps"] == 3
    # The default layout, decoupled: 64-token pages and states keyed on the 64-token grid.
    # A: stop 1999 // 64 * 64 = 1984 -> chunks [0,1984) [1984,2000), a state at 1984.
    # B: cap 2099 // 64 * 64 = 2048; A's 31 full pages cover 1984 and the state is at 1984 -> 1984;
    # B then stops at 2048 (its own replay boundary) and ends at 2100: 2 + 2 steps.
    assert main(["trace", str(p), "--one-at-a-time", "--json", "--quiet"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["layout"] == "decoupled" and d["page_tokens"] == 64 and d["mamba_policy"] == "none"
    assert d["cached_tokens"] == 1984 and d["steps"] == 4 and d["blocks_returned"]
    assert d["arena"]["pages_per_superblock"] == 9 and d["arena"]["superblock_bytes"] == 14_155_776


def test_chat_and_models(capsys):
    assert main(["chat", "--conversations", "2", "--turns", "2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["finished"] == 4 and d["cached_tokens"] > 0
    assert main(["models"]) == 0
    assert "qwen3-next-80b-a3b" in capsys.readouterr().out


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mambakv: error:") and "Traceback" not in err
    return err


def test_missing_file_exit_2(tmp_path, capsys):
    assert main(["trace", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl" in _one_line_error(capsys)


def test_malformed_line_exit_2_with_line_number(tmp_path, capsys):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(ROWS[1]) + "\n" + '{"timestamp": 3, "input_length": "x"}\n')
    assert main(["trace", str(p)]) == 2
    assert "line 3" in _one_line_error(capsys)


def test_unknown_model_exit_2(tmp_path, capsys):
    p = write_trace(tmp_path / "t.jsonl", ROWS)
    assert main(["trace", str(p), "--model", "no-such-model"]) == 2
    assert "no-such-model" in _one_line_error(capsys)
    assert main(["replay", "--config", str(tmp_path / "missing" / "config.json")]) == 2
    _one_line_error(capsys)


def test_budget_too_small_exit_2(tmp_path, capsys):
    p = write_trace(tmp_path / "t.jsonl", ROWS)
    # 0.05 GiB / 13,369,344 B per block = 4 blocks, 3 usable; a request needs 1 attention
    # block + 1 state in each of the 3 Mamba groups at least
    assert main(["trace", str(p), "--memory-gib", "0.05"]) == 2
    assert "budget too small for one request" in _one_line_error(capsys)


def test_plot(tmp_path, capsys):
    png = tmp_path / "p.png"
    rc = main(["chat", "--conversations", "2", "--turns", "2", "--plot", str(png)])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert rc == 2 and "matplotlib" in _one_line_error(capsys)
        assert not png.exists()
    else:
        assert rc == 0 and png.stat().st_size > 0


@pytest.mark.parametrize("argv, why", [
    (["replay", "--memory-gib", "nan"], "--memory-gib"), (["replay", "--memory-gib", "inf"], "--memory-gib"),
    (["replay", "--memory-gib", "0"], "--memory-gib"), (["replay", "--memory-gib", "-1"], "--memory-gib"),
    (["replay", "--memory-gib", "x"], "--memory-gib"),
    (["replay", "--acceptance-rate", "1.5"], "--acceptance-rate"),
    (["replay", "--acceptance-rate", "-0.1"], "--acceptance-rate"),
    (["replay", "--acceptance-rate", "nan"], "--acceptance-rate"),
    (["replay", "--step-ms", "-1"], "--step-ms"), (["replay", "--step-ms", "inf"], "--step-ms"),
    (["replay", "--ms-per-token", "nan"], "--ms-per-token"),
    (["replay", "--max-num-seqs", "0"], "--max-num-seqs"), (["replay", "--max-num-batched-tokens", "-5"], "batched"),
    (["replay", "--num-speculative-tokens", "-1"], "--num-speculative"), (["replay", "--in-flight", "-1"], "--in-flight"),
    (["replay", "--seed", "-1"], "--seed"), (["replay", "--prompt-tokens", "0"], "--prompt-tokens"),
    (["chat", "--turns", "1.5"], "--turns"), (["chat", "--conversations", "0"], "--conversations"),
    (["trace", "t.jsonl", "--limit", "0"], "--limit"), (["trace", "t.jsonl", "--max-output-tokens", "0"], "--max-output"),
    (["replay", "--no-such-flag"], "unrecognized"), ([], "required"),
])
def test_bad_arguments_one_line_exit_2(argv, why, capsys):
    assert main(argv) == 2  # returned, not a SystemExit
    assert why in _one_line_error(capsys)


@pytest.mark.parametrize("gib, why", [("1e30", "limit of"), ("1e308", "too large")])
def test_huge_memory_refused_fast(gib, why, capsys):
    # 1e30 GiB would be ~8e31 blocks of 13,369,344 B: the pool grew without end
    assert main(["replay", "--memory-gib", gib]) == 2
    assert why in _one_line_error(capsys)


def test_config_path_that_does_not_exist_says_cannot_read(tmp_path, capsys):
    for cfg in ("nosuch.json", str(tmp_path / "dir" / "config")):
        assert main(["replay", "--config", cfg]) == 2
        err = _one_line_error(capsys)
        assert "cannot read" in err and "not a packaged name" not in err
    assert main(["replay", "--config", "nosuch"]) == 2  # a bare name: still the unknown-model message
    assert "not a packaged name" in _one_line_error(capsys)


def test_nan_timestamp_and_non_utf8_trace_exit_2(tmp_path, capsys):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(ROWS[0]) + "\n" + '{"timestamp": NaN, "input_length": 6, "output_length": 1, '
                 '"hash_ids": [1]}\n')
    assert main(["trace", str(p)]) == 2
    assert "line 2" in _one_line_error(capsys)
    p.write_bytes(json.dumps(ROWS[0]).encode() + b"\n\xff\xfe\n")
    assert main(["trace", str(p)]) == 2
    err = _one_line_error(capsys)
    assert "line 2" in err and "UTF-8" in err


def test_help_is_plain_text_and_documents_every_flag(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "``" not in out and "mambakv command" in out
    for cmd in ("replay", "trace", "chat", "models"):
        assert main([cmd, "--help"]) == 0
        out = capsys.readouterr().out
        assert "``" not in out
        lines = out.split("options:")[1].splitlines()
        # every option line "  --flag METAVAR   help" has its help text on the line or the next one
        for i, line in enumerate(lines):
            if line.startswith("  -") and len(line.split("  ")) < 3:
                assert lines[i + 1].startswith(" " * 10), f"{cmd}: no help for {line.strip()}"
    assert main(["replay", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "(default 0.7)" in out and "--seed SEED seed of" in out and "(default 0)" in out


# --------------------------------------------------------------------------- issue 18
def test_version(capsys):
    from mambakv import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"mambakv {__version__}\n"
    out = subprocess.run([sys.executable, "-m", "mambakv", "--version"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == f"mambakv {__version__}\n"


def test_closed_pipe_ends_quietly():
    # `mambakv models | head -0`: the reader is gone before the table is written
    proc = subprocess.Popen([sys.executable, "-m", "mambakv", "models"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141
    assert err == ""  # no BrokenPipeError traceback, no "Exception ignored" at exit


@pytest.mark.parametrize("name, why", [
    ("x.txt", "must end in .png, .svg, .pdf"), ("nodir/x.png", "does not exist"), (".", "must end in"),
])
def test_bad_plot_path_refused_before_the_run(tmp_path, monkeypatch, capsys, name, why):
    pytest.importorskip("matplotlib")
    import mambakv.sim as sim

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sim, "run_replay", lambda *a, **k: pytest.fail("ran before checking --plot"))
    assert main(["replay", "--plot", name]) == 2
    assert why in _one_line_error(capsys)


def test_plot_dir_refused(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    (tmp_path / "d.png").mkdir()
    assert main(["replay", "--plot", str(tmp_path / "d.png")]) == 2
    assert "is a directory" in _one_line_error(capsys)


def test_plot_says_what_it_wrote(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "p.png"
    assert main(["chat", "--conversations", "2", "--turns", "2", "--plot", str(png), "--quiet"]) == 0
    assert capsys.readouterr().err == f"wrote {png}\n"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_implausible_speculative_tokens_warn(capsys):
    base = ["replay", "--prompt-tokens", "1000", "--output-tokens", "1", "--in-flight", "0"]
    assert main([*base, "--num-speculative-tokens", "64"]) == 0
    assert capsys.readouterr().err == ""
    assert main([*base, "--num-speculative-tokens", "65"]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mambakv: warning: --num-speculative-tokens 65 is implausibly")
    assert "(67 each here)" in err  # 2 + 65 blocks per request per Mamba group


def test_budget_too_small_says_how_much_is_needed(capsys):
    # Qwen3-Next: 1 attention group + 3 Mamba groups of 12 layers, block 544, 13,369,344 B
    # (12.75 MiB) per block.  8 GiB = 642 blocks (641 usable).  The default replay (480,031 +
    # 4 tokens, K = 5) needs 1 null + ceil(480,040 / 544) = 883 KV blocks + 3 x (2 + 5) = 905
    # blocks = 12,099,256,320 B = 11.268 GiB -> "--memory-gib 11.27".
    unified = ["--layout", "unified"]
    assert main(["replay", "--memory-gib", "8", *unified]) == 2
    err = _one_line_error(capsys)
    assert "641 blocks of the pool" in err and "needs about 905 blocks of 12.75 MiB: --memory-gib 11.27" in err
    # the figure is the real threshold: 11.27 GiB = 905.1 -> 905 blocks runs, 11.26 = 904.4 -> 904 does not
    assert main(["replay", "--memory-gib", "11.27", "--json", *unified]) == 0
    capsys.readouterr()
    assert main(["replay", "--memory-gib", "11.26", *unified]) == 2
    assert "needs about 905 blocks" in _one_line_error(capsys)
    # Decoupled (superblocks of 9 pages of 64 tokens, 14,155,776 B): 1 null + ceil(480,040 / 64)
    # = 7,502 pages = 834 superblocks, + 3 x (2 + 5) state slots = 855 superblocks =
    # 12,103,188,480 B = 11.272 GiB -> "--memory-gib 11.28".
    assert main(["replay", "--memory-gib", "8"]) == 2
    assert "needs about 855 superblocks of 13.50 MiB: --memory-gib 11.28" in _one_line_error(capsys)
    assert main(["replay", "--memory-gib", "11.28", "--json"]) == 0
    capsys.readouterr()


def test_request_beyond_max_model_len_is_rejected(tmp_path, capsys):
    # The default max_model_len of a trace is the model's own context length: 262,144 tokens for
    # Qwen3-Next (max_position_embeddings of its config.json). A 262,000-token prompt asking for
    # 200 tokens (262,200 > 262,144) and a 2,000-token prompt asking for 100,000,000 are both
    # rejected before the run. Before: max_model_len was 2**21 and only prompt + 1 counted, so
    # both ran, the second for hours (one decode step per token).
    long_prompt = {"timestamp": 10, "input_length": 262_000, "output_length": 200, "hash_ids": list(range(100, 612))}
    long_output = dict(ROWS[0], timestamp=20, output_length=100_000_000)
    p = write_trace(tmp_path / "t.jsonl", [ROWS[0], long_prompt, long_output])
    assert main(["trace", str(p), "--json", "--quiet"]) == 0
    captured = capsys.readouterr()
    d = json.loads(captured.out)
    assert (d["requests"], d["finished"], d["rejected"], d["max_model_len"]) == (3, 1, 2, 262_144)
    assert d["prompt_tokens"] == 2000 and d["output_tokens"] == 1  # only A ran
    assert captured.err == ("mambakv: warning: 2 of 3 requests rejected: prompt + output tokens exceed "
                            "max_model_len 262,144 (--max-model-len)\n")
    assert main(["trace", str(p), "--quiet"]) == 0
    assert "requests 1/3 finished, 2 rejected;" in capsys.readouterr().out
    # --max-model-len: A is 2,000 + 1 tokens: 2,001 runs it, 2,000 rejects it too (nothing runs)
    assert main(["trace", str(p), "--json", "--quiet", "--max-model-len", "2001"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["finished"], d["rejected"], d["max_model_len"]) == (1, 2, 2001)
    assert main(["trace", str(p), "--json", "--quiet", "--max-model-len", "2000"]) == 0
    captured = capsys.readouterr()
    d = json.loads(captured.out)
    assert (d["requests"], d["finished"], d["rejected"]) == (3, 0, 3)
    assert "3 of 3 requests rejected" in captured.err


def test_max_model_len_comes_from_the_config(tmp_path, capsys):
    # --config FILE: the file's max_position_embeddings; none in the file: DEFAULT_MAX_MODEL_LEN
    from mambakv.models.registry import packaged_config
    from mambakv.sim.runner import DEFAULT_MAX_MODEL_LEN

    p = write_trace(tmp_path / "t.jsonl", ROWS)
    cfg = packaged_config("qwen3-next-80b-a3b")
    cfg["max_position_embeddings"] = 2050  # A (2,000 + 1) fits, B (2,100 + 1) does not
    (tmp_path / "short.json").write_text(json.dumps(cfg))
    del cfg["max_position_embeddings"]
    (tmp_path / "none.json").write_text(json.dumps(cfg))
    assert main(["trace", str(p), "--json", "--quiet", "--config", str(tmp_path / "short.json")]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["finished"], d["rejected"], d["max_model_len"]) == (1, 1, 2050)
    assert main(["trace", str(p), "--json", "--quiet", "--config", str(tmp_path / "none.json")]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["finished"], d["rejected"], d["max_model_len"]) == (2, 0, DEFAULT_MAX_MODEL_LEN)
    # the flag wins over the config
    assert main(["trace", str(p), "--json", "--quiet", "--config", str(tmp_path / "short.json"),
                 "--max-model-len", "4096"]) == 0
    assert json.loads(capsys.readouterr().out)["rejected"] == 0


def test_fleet_max_model_len(tmp_path, capsys):
    # the fleet rejects as the trace does: prompt + output > max_model_len, counted, one warning
    p = write_trace(tmp_path / "t.jsonl", [*ROWS, dict(ROWS[0], timestamp=60, output_length=100_000_000)])
    assert main(["fleet", str(p), "--instances", "2", "--json", "--quiet"]) == 0
    captured = capsys.readouterr()
    d = json.loads(captured.out)
    assert (d["requests"], d["finished"], d["rejected"], d["max_model_len"]) == (3, 2, 1, 262_144)
    assert captured.err == ("mambakv: warning: 1 of 3 requests rejected: prompt + output tokens exceed "
                            "max_model_len 262,144 (--max-model-len)\n")
    assert main(["fleet", str(p), "--instances", "2", "--json", "--quiet", "--max-model-len", "2050"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["finished"], d["rejected"]) == (1, 2)


def test_rejection_boundary_in_runner():
    import numpy as np

    from mambakv.sim.runner import build_coordinator, run_workload
    from mambakv.sim.workloads import RequestSpec

    def spec(rid: str, n: int) -> RequestSpec:
        return RequestSpec(rid, 0.0, n, 3, lambda n=n: np.arange(n, dtype=np.int32) % 1000)

    coord = build_coordinator("qwen3-next-80b-a3b", 2.0, max_model_len=4096)
    # prompt + output: 4093 + 3 = 4096 <= 4096 runs (all 3 output tokens); 4094 + 3 > 4096 is
    # rejected, its prompt never built (before: only prompt + 1 counted, so it ran and stopped
    # at the length cap after 2 of its 3 tokens)
    never = RequestSpec("never", 0.0, 4094, 3, lambda: pytest.fail("rejected prompt was built"))
    result = run_workload(coord, [spec("ok", 4093), never])
    d = result.to_dict()
    assert (result.rejected, d["requests"], d["finished"], d["output_tokens"]) == (1, 2, 1, 3)


def test_budget_series_covers_every_step():
    # The decoupled chart's budget area was drawn from the scheduler's byte series, sampled after
    # allocations only: it stopped at step 60 of the default replay's 62 (2 decode steps allocate
    # nothing) while the "held by requests" line ran to step 62. Both now end at the last step.
    from mambakv.cli.plot import budget_series, plot_series
    from mambakv.sim.runner import run_replay

    r = run_replay(layout="decoupled")
    m = r.metrics
    assert m.steps == 62 and m.byte_series[-1][0] == 60
    steps, parts = budget_series(r)
    held_steps, _, _ = plot_series(r)
    assert steps[-1] == held_steps[-1] == 62 and steps[-2:] == [60, 62]
    end = r.to_dict()["arena"]["final_bytes"]
    assert parts[-1] == (end["pages"], end["states"], end["idle"])  # the budget at the end of the run
    assert parts[:-1] == [(s[2], s[3], s[4]) for s in m.byte_series]
    # the unified layout has no byte budget
    assert budget_series(run_replay(prompt_tokens=1000, output_tokens=1)) == ([], [])


def test_plot_series_runs_to_the_last_step():
    from mambakv.cli.plot import plot_series
    from mambakv.sim.runner import run_replay

    # default replay: 59 aligned chunks + the last 223 tokens = 60 allocating steps, then
    # 2 steps of decode (4 outputs, 5 drafts, 2 in flight) allocate nothing: the samples stop at
    # step 60 of 62.  The chart holds the last sample to step 62, where the tables are empty.
    r = run_replay()
    assert r.metrics.steps == 62 and r.metrics.series[-1][0] == 60
    steps, usage, hits = plot_series(r)
    # ceil(480,031 / 544) = 883 attention blocks; 2 + 5 + 2 = 9 per Mamba group
    assert steps[-2:] == [60, 62] and usage[-2:] == [(883, 9, 9, 9), (0, 0, 0, 0)]
    assert hits[-1] == 0.0


def test_identical_groups_merge_into_one_band():
    from mambakv.cli.plot import merge_identical_groups

    kinds = ["full_attention", "mamba", "mamba", "mamba"]
    assert merge_identical_groups(kinds, [(5, 2, 2, 2), (9, 3, 3, 3)]) == [([0], "full_attention"),
                                                                           ([1, 2, 3], "mamba")]
    # group 2 differs at the second sample: its own band
    assert merge_identical_groups(kinds, [(5, 2, 2, 2), (9, 3, 4, 3)]) == [([0], "full_attention"),
                                                                           ([1, 3], "mamba"), ([2], "mamba")]
    # equal counts of different kinds never merge
    assert merge_identical_groups(["full_attention", "mamba"], [(1, 1)]) == [([0], "full_attention"),
                                                                             ([1], "mamba")]


def test_help_needs_no_source_checkout(capsys):
    # a wheel ships no docs/: --help explains the report itself
    for argv in (["--help"], ["replay", "--help"], ["trace", "--help"], ["chat", "--help"], ["fleet", "--help"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "docs/" not in out
    assert main(["replay", "--help"]) == 0
    assert "hit rate (cached / prompt tokens" in " ".join(capsys.readouterr().out.split())


def test_help_cites_only_what_a_user_has(capsys):
    # `trace --help` cited CACHE.md, a design note beside the repository that users do not have
    for argv in (["--help"], ["replay", "--help"], ["trace", "--help"], ["chat", "--help"], ["fleet", "--help"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "CACHE.md" not in out and "DESIGN.md" not in out, argv
    assert main(["trace", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "in arrival order: a timestamp below the previous line's is an error" in out
    assert "--max-model-len TOKENS longest request, prompt + output tokens" in out
    assert "with a 256 GiB host tier, reuse scored 0.2434 and lru 0.2493" in out


def test_license_readme_and_changelog_agree_with_pyproject():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'license = { text = "Apache-2.0" }' in pyproject
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert '"torch>=2.1,<3"' in pyproject and "torch >= 2.1, < 3" in (ROOT / "README.md").read_text()
    from mambakv import __version__

    headings = [ln for ln in (ROOT / "CHANGELOG.md").read_text().splitlines() if ln.startswith("## ")]
    assert headings[0] == "## Unreleased" and headings[1].startswith(f"## {__version__} - 20")


def test_trace_budget_hint_uses_the_longest_request_that_runs(tmp_path, capsys):
    # 0.05 GiB = 4 blocks (3 usable).  The 2,097,152-token request is rejected, so the longest
    # that runs is B: 2,100 + 1 tokens, K = 0 -> 1 null + ceil(2,101 / 544) = 4 KV blocks +
    # 3 x 2 states = 11 blocks = 147,062,784 B = 0.137 GiB -> "--memory-gib 0.14"
    big = {"timestamp": 60, "input_length": 2_097_152, "output_length": 1, "hash_ids": list(range(100, 4196))}
    p = write_trace(tmp_path / "t.jsonl", [*ROWS, big])
    assert main(["trace", str(p), "--memory-gib", "0.05", "--layout", "unified"]) == 2
    err = _one_line_error(capsys)
    assert "the longest request (2,101 tokens) needs about 11 blocks of 12.75 MiB: --memory-gib 0.14 or more" in err
    # decoupled: 1 null + ceil(2,101 / 64) = 34 pages = 4 superblocks of 9, + 3 x 2 slots = 10
    # superblocks of 14,155,776 B = 0.132 GiB -> "--memory-gib 0.14"
    assert main(["trace", str(p), "--memory-gib", "0.05"]) == 2
    err = _one_line_error(capsys)
    assert "needs about 10 superblocks of 13.50 MiB: --memory-gib 0.14 or more" in err
    assert main(["trace", str(p), "--memory-gib", "0.14", "--quiet"]) == 0
    assert "requests 2/3 finished, 1 rejected;" in capsys.readouterr().out


def test_write_plot_of_a_bare_library_run(tmp_path):
    # run_workload without settings (a library user's own run): the chart needs only the result
    pytest.importorskip("matplotlib")
    from mambakv.cli.plot import write_plot
    from mambakv.sim.runner import build_coordinator, run_workload
    from mambakv.sim.workloads import long_prefill

    r = run_workload(build_coordinator("jamba-v0.1", 4.0), long_prefill(3000, output_len=2))
    write_plot(r, str(tmp_path / "bare.svg"))
    assert (tmp_path / "bare.svg").read_text().lstrip().startswith("<?xml")


def test_eviction_flags(tmp_path, capsys):
    """--eviction, --save-hazard-table / --hazard-table, --oracle-hints (issue 15) on the two-request trace."""
    p = write_trace(tmp_path / "t.jsonl", ROWS)
    table = tmp_path / "h.json"
    assert main(["trace", str(p), "--one-at-a-time", "--json", "--quiet", "--save-hazard-table", str(table)]) == 0
    out = capsys.readouterr()
    d = json.loads(out.out)
    assert d["eviction"]["policy"] == "reuse" and d["eviction"]["warm_start"] is False
    assert f"wrote {table}" in out.err
    # B's admission reuses A's leaf unit (the checkpoint at 1984, A's prompt end): one reuse, no eviction
    assert d["eviction"]["reuses"] == 1 and d["eviction"]["evictions"] == 0
    saved = json.loads(table.read_text())
    assert saved["format"] == "mambakv-hazard-table" and sum(map(sum, saved["reuses"])) == 1
    assert main(["trace", str(p), "--one-at-a-time", "--json", "--quiet", "--hazard-table", str(table),
                 "--oracle-hints"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["eviction"]["warm_start"] is True and d["oracle_hints"] is True and d["hazard_warm_start"] is True
    assert d["cached_tokens"] == 1984  # hints and a warm table move evictions, not this hit (nothing is evicted)
    assert main(["trace", str(p), "--one-at-a-time", "--json", "--quiet", "--eviction", "lru"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["eviction"]["policy"] == "lru" and "hazard_table" not in d["eviction"]


@pytest.mark.parametrize("argv", [
    ["--layout", "unified", "--eviction", "reuse"],
    ["--layout", "unified", "--save-hazard-table", "x.json"],
    ["--eviction", "lru", "--save-hazard-table", "x.json"],
    ["--eviction", "lru", "--hazard-table", "x.json"],
    ["--eviction", "fifo"],
])
def test_eviction_bad_flags_exit_2(tmp_path, capsys, argv):
    p = write_trace(tmp_path / "t.jsonl", ROWS)
    if "--hazard-table" in argv:
        (tmp_path / "x.json").write_text("{}")
    argv = [a if a != "x.json" else str(tmp_path / "x.json") for a in argv]
    assert main(["trace", str(p), "--one-at-a-time", "--quiet", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mambakv: error:") and err.count("\n") == 1, err


def test_save_hazard_table_folder_checked_before_the_run(tmp_path, capsys):
    p = write_trace(tmp_path / "t.jsonl", ROWS)
    assert main(["trace", str(p), "--quiet", "--save-hazard-table", str(tmp_path / "no" / "h.json")]) == 2
    assert "does not exist" in _one_line_error(capsys)


def _no_run(monkeypatch):
    """Any simulated run fails the test: the command must refuse before any work."""
    import mambakv.sim as sim
    import mambakv.sim.fleet as sim_fleet

    for name in ("run_replay", "run_trace", "run_conversations"):
        monkeypatch.setattr(sim, name, lambda *a, **k: pytest.fail("ran before checking its output paths"))
    monkeypatch.setattr(sim_fleet, "run_fleet", lambda *a, **k: pytest.fail("ran before checking its output paths"))


@pytest.mark.parametrize("flag, target, why", [
    # a directory: before, --save-hazard-table DIR ran the whole trace, then failed with a raw errno
    ("--save-hazard-table", "{tmp}", "is a directory"),
    ("--save-hazard-table", "{tmp}/no/h.json", "folder {tmp}/no does not exist"),
    # a virtual file system: the folder exists and root may "write" it, but no file can be created
    ("--save-hazard-table", "/proc/h.json", "cannot write there"),
    ("--plot", "/proc/x.png", "cannot write there"),
    ("--plot", "{tmp}/d.png", "is a directory"),
])
def test_output_paths_refused_before_any_work(tmp_path, monkeypatch, capsys, flag, target, why):
    if flag == "--plot":
        pytest.importorskip("matplotlib")
    (tmp_path / "d.png").mkdir()
    p = write_trace(tmp_path / "t.jsonl", ROWS)
    _no_run(monkeypatch)
    target, why = target.format(tmp=tmp_path), why.format(tmp=tmp_path)
    assert main(["trace", str(p), "--quiet", flag, target]) == 2
    err = _one_line_error(capsys)
    assert err.startswith(f"mambakv: error: {flag} {target}: ") and why in err and "Errno" not in err
    if flag == "--plot":
        assert main(["fleet", str(p), "--quiet", flag, target]) == 2
        assert why in _one_line_error(capsys)
        assert main(["replay", flag, target]) == 2
        assert why in _one_line_error(capsys)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes a read-only folder")
def test_output_path_in_a_read_only_folder(tmp_path, monkeypatch, capsys):
    p = write_trace(tmp_path / "t.jsonl", ROWS)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        _no_run(monkeypatch)
        assert main(["trace", str(p), "--quiet", "--save-hazard-table", str(ro / "h.json")]) == 2
        assert "cannot write there" in _one_line_error(capsys)
    finally:
        ro.chmod(0o700)


def test_output_path_check_leaves_no_trace(tmp_path):
    # the test write creates and removes a new file, and leaves an existing one as it was
    from mambakv.cli.args import check_output_path

    check_output_path(str(tmp_path / "new.json"), "--save-hazard-table")
    assert list(tmp_path.iterdir()) == []
    old = tmp_path / "old.png"
    old.write_bytes(b"keep me")
    check_output_path(str(old), "--plot")
    assert old.read_bytes() == b"keep me"
    check_output_path(None, "--plot")


# --------------------------------------------------------------------------- issue 17
# A (2000 tokens), X (3000, unrelated), then B = A's 4 blocks + 1 (2100). 0.2 GiB holds 15
# superblocks of 13.5 MiB (9 pages of 64 tokens): X's prefill evicts A's unit from the GPU; the
# host tier (write-through at A's free) still holds it.
HOST_ROWS = [
    {"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [1, 2, 3, 4]},
    {"timestamp": 10000, "input_length": 3000, "output_length": 1, "hash_ids": [11, 12, 13, 14, 15, 16]},
    {"timestamp": 20000, "input_length": 2100, "output_length": 1, "hash_ids": [1, 2, 3, 4, 5]},
]


def test_trace_host_tier_hit_and_bandwidth_moves_the_clock_only(tmp_path, capsys):
    p = write_trace(tmp_path / "t.jsonl", HOST_ROWS)
    argv = ["trace", str(p), "--one-at-a-time", "--json", "--quiet", "--memory-gib", "0.2"]
    assert main(argv) == 0
    gpu_only = json.loads(capsys.readouterr().out)
    assert gpu_only["cached_tokens"] == 0 and "hit_rate_host" not in gpu_only  # A's unit was evicted
    runs = {}
    for gbps in ("25", "5"):
        assert main([*argv, "--host-memory-gib", "1", "--h2d-gbps", gbps]) == 0
        runs[gbps] = json.loads(capsys.readouterr().out)
    d = runs["25"]
    # B's hit: A's 31 full pages (1984 tokens) and the 3 Mamba states at 1984, all from the host:
    # 31 x 1,572,864 B (64 tokens x 24,576 B) + 3 x 13,172,736 B = 88,276,992 B
    assert d["cached_tokens"] == 1984 and d["hit_rate"] == pytest.approx(1984 / 7100, abs=1e-6)
    assert d["hit_rate_gpu"] == 0.0 and d["hit_rate_host"] == d["hit_rate"]
    assert d["bytes_h2d"] == 31 * 1_572_864 + 3 * 13_172_736 == 88_276_992
    assert d["host"]["loads"] == 1 and d["host"]["load_ms"] == pytest.approx(88_276_992 / 25e6, abs=1e-3)
    assert d["bytes_d2h"] > 0 and d["host_write"] == "through" and d["blocks_returned"]
    slow = runs["5"]  # the bandwidth moves the clock by the load's extra time, not the hit rate
    assert slow["hit_rate"] == d["hit_rate"] and slow["bytes_h2d"] == d["bytes_h2d"]
    assert slow["sim_clock_ms"] - d["sim_clock_ms"] == pytest.approx(88_276_992 / 5e6 - 88_276_992 / 25e6, abs=1e-3)
    assert main(["trace", str(p), "--one-at-a-time", "--quiet", "--memory-gib", "0.2", "--host-memory-gib", "1"]) == 0
    assert "host tier 1.0 GiB (through): hit rate gpu 0.0000 + host 0.2794; 1 loads" in capsys.readouterr().out


@pytest.mark.parametrize("argv, why", [
    (["--host-memory-gib", "0"], "--host-memory-gib"), (["--host-memory-gib", "nan"], "--host-memory-gib"),
    (["--h2d-gbps", "0"], "--h2d-gbps"), (["--host-write", "later"], "--host-write"),
    (["--host-eviction", "fifo"], "--host-eviction"),
])
def test_bad_host_arguments_exit_2(argv, why, capsys):
    assert main(["replay", *argv]) == 2
    assert why in _one_line_error(capsys)


def test_host_write_evict_needs_decoupled(tmp_path, capsys):
    p = write_trace(tmp_path / "t.jsonl", HOST_ROWS)
    assert main(["trace", str(p), "--quiet", "--layout", "unified", "--host-memory-gib", "1",
                 "--host-write", "evict"]) == 2
    assert "decoupled" in _one_line_error(capsys)


@pytest.mark.parametrize("flag", [["--host-write", "evict"], ["--host-eviction", "reuse"], ["--h2d-gbps", "5"]])
def test_host_flags_without_a_host_tier_exit_2(tmp_path, flag, capsys):
    p = write_trace(tmp_path / "t.jsonl", HOST_ROWS)
    assert main(["trace", str(p), "--quiet", *flag]) == 2  # they would do nothing: refused before the run
    assert "--host-memory-gib" in _one_line_error(capsys)


# --------------------------------------------------------------------------- issue 31, docs
def _all_blocks_returned_recipe() -> str:
    """The ```py block under "### All blocks returned" in docs/engine-integration.md."""
    text = (ROOT / "docs" / "engine-integration.md").read_text()
    section = text.split("### All blocks returned", 1)[1]
    return re.findall(r"^```py\n(.*?)^```", section, flags=re.S | re.M)[0]


@pytest.mark.parametrize("layout", ["unified", "decoupled"])
def test_all_blocks_returned_recipe_of_the_docs(tmp_path, layout):
    """The doc's recipe, run as written after a trace in both layouts: true once every request
    is freed, false while one still holds blocks."""
    from mambakv import Request
    from mambakv.sim.runner import run_trace

    recipe: dict = {}
    exec(compile(_all_blocks_returned_recipe(), "engine-integration.md", "exec"), recipe)
    all_blocks_returned = recipe["all_blocks_returned"]
    p = write_trace(tmp_path / "t.jsonl", ROWS)
    kv = run_trace(p, layout=layout, memory_gib=4.0).coord
    assert len(kv.pools) == (2 if layout == "decoupled" else 1)
    assert all_blocks_returned(kv) and kv.usage == 0.0
    req = Request("held", list(range(1, 200)))
    blocks, n = kv.get_computed_blocks(req)
    assert kv.allocate(req, 199 - n, num_new_computed_tokens=n, new_computed_blocks=blocks,
                       num_draft_tokens=0) is not None
    assert not all_blocks_returned(kv)
    kv.free("held")
    assert all_blocks_returned(kv)
