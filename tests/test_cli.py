"""The `mambakv` command: replay / trace / chat / models output, and bad input -> exit 2."""

from __future__ import annotations

import json
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
    assert main(["trace", str(p), "--one-at-a-time", "--json", "--quiet"]) == 0
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
