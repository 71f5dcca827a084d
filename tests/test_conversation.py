"""Conversation replay (mambakv.sim.conversation), hit causes (mambakv.sim.causes), ``--skip``
and ``--replay``: hand-made traces with hand-worked parents, tokens and hits, and the counts
of CACHE.md on the real trace."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from mambakv import InvalidSpecError, MambaKVError, TraceFormatError
from mambakv.cli import main
from mambakv.sim import RequestSpec, load_trace, run_trace, trace_block_tokens
from mambakv.sim.causes import CAUSES, HitCauses, hit_cause
from mambakv.sim.conversation import ConversationReplay, Link, Relation, TraceRow, link_requests, read_trace_rows
from mambakv.sim.sim_request import SimRequest

TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "conversation_trace.jsonl"
needs_trace = pytest.mark.skipif(not TRACE.exists(), reason="../shared/traces/conversation_trace.jsonl absent")


def write_trace(path: Path, rows: Sequence[tuple[float, int, int, list[int]]]) -> Path:
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": ids})
                            + "\n" for t, n, o, ids in rows))
    return path


def block(h: int, start: int, stop: int) -> np.ndarray:
    return trace_block_tokens(h)[start:stop]


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mambakv: error: "), err
    return err


# --------------------------------------------------------------------------- --skip
def test_skip_starts_at_line_n_plus_1(tmp_path: Path) -> None:
    p = write_trace(tmp_path / "t.jsonl", [(0, 100, 1, [1]), (5, 200, 2, [2]), (9, 300, 3, [3])])
    specs = load_trace(p, skip=1)
    assert [(s.request_id, s.arrival_ms, s.num_prompt_tokens, s.output_len) for s in specs] == [
        ("trace-1", 5.0, 200, 2), ("trace-2", 9.0, 300, 3)]
    assert np.array_equal(specs[0].prompt(), block(2, 0, 200))
    assert [s.request_id for s in load_trace(p, skip=1, limit=1)] == ["trace-1"]
    assert [r.input_length for r in read_trace_rows(p, skip=1)] == [200, 300]
    assert [s.request_id for s in load_trace(p)] == ["trace-0", "trace-1", "trace-2"]  # skip 0: as before
    with pytest.raises(TraceFormatError, match="no requests after line 3"):
        load_trace(p, skip=3)
    for bad in (-1, 1.5, True):
        with pytest.raises(TraceFormatError, match="skip must be an int >= 0"):
            load_trace(p, skip=bad)  # type: ignore[arg-type]
        with pytest.raises(TraceFormatError, match="skip must be an int >= 0"):
            read_trace_rows(p, skip=bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- relations
def rows_of(*rows: tuple[int, int, list[int]]) -> list[TraceRow]:
    return [TraceRow(n, o, tuple(ids)) for n, o, ids in rows]


def test_relations_and_parents_on_a_hand_trace() -> None:
    rows = rows_of(
        (1100, 50, [1, 2, 3]),     # 0: first turn
        (1300, 10, [1, 2, 4]),     # 1: shares [1, 2] = F(0) = 1100 // 512 = 2 full blocks; 1300 >= 1100 + 50
        (600, 5, [1, 9]),          # 2: only the first block
        (1700, 1, [1, 2, 4, 5]),   # 3: deepest [1, 2, 4] with 1 (latest); F(1) = 2 <= 3; 1700 >= 1310
        (1200, 1, [1, 2, 10]),     # 4: deepest [1, 2], latest through it is 3, F(3) = 3 > 2: a branch
        (1100, 7, [1, 2, 3]),      # 5: the ids of 0 again
        (1105, 1, [1, 2, 3, 11]),  # 6: extends 5 (latest through [1, 2, 3]), 1105 < 1100 + 7: no parent
    )
    assert link_requests(rows) == [
        Link(Relation.NONE, 0, None, None),
        Link(Relation.NEXT_TURN, 2, 0, 0),
        Link(Relation.NONE, 1, 1, None),
        Link(Relation.NEXT_TURN, 3, 1, 1),
        Link(Relation.BRANCH, 2, 3, None),
        Link(Relation.REPEAT, 3, 0, None),
        Link(Relation.NEXT_TURN, 3, 5, None),
    ]


def test_the_deepest_match_is_the_only_candidate() -> None:
    # 2 extends all full blocks of 0 ([1, 2]) and is long enough, but shares 3 blocks with 1,
    # which it leaves inside 1's 4 full blocks: it branched off 1, it is not 0's next turn.
    rows = rows_of((1100, 10, [1, 2, 3]), (2100, 10, [1, 2, 20, 21, 22]), (2000, 1, [1, 2, 20, 23]))
    assert link_requests(rows)[2] == Link(Relation.BRANCH, 3, 1, None)
    # 1's first 3 blocks are 0's 2 full blocks and a new one: 1 is 0's child
    assert link_requests(rows)[1] == Link(Relation.NEXT_TURN, 2, 0, 0)


def test_a_parent_needs_two_full_blocks() -> None:
    # F(0) = 1000 // 512 = 1: 1 extends it (a next turn) but gets no parent, long as it is
    rows = rows_of((1000, 1, [1, 2]), (2000, 1, [1, 2, 3, 4]), (3000, 1, [1, 2, 3, 4, 5, 6]))
    assert link_requests(rows)[1] == Link(Relation.NEXT_TURN, 2, 0, None)
    assert link_requests(rows)[2] == Link(Relation.NEXT_TURN, 4, 1, 1)  # F(1) = 3


# --------------------------------------------------------------------------- content
CONV_ROWS = [(0, 1100, 50, [1, 2, 3]), (1, 1300, 10, [1, 2, 4]), (2, 1700, 1, [1, 2, 4, 5])]


def run_capturing(path: Path, **kw: object) -> tuple[dict[str, object], dict[str, np.ndarray]]:
    seen: dict[str, np.ndarray] = {}

    def grab(s: SimRequest) -> None:
        seen[s.request.request_id] = np.array(s.request.all_token_ids)

    r = run_trace(path, num_blocks=2000, on_finish=grab, **kw)  # type: ignore[arg-type]
    return r.to_dict(), seen


def test_a_child_begins_with_its_parents_prompt_and_generated_ids(tmp_path: Path) -> None:
    p = write_trace(tmp_path / "t.jsonl", CONV_ROWS)
    d, seen = run_capturing(p, one_at_a_time=True, replay="conversation")
    t0, t1, t2 = seen["trace-0"], seen["trace-1"], seen["trace-2"]
    # 0: strict: blocks 1, 2 and the first 1100 - 1024 = 76 tokens of block 3; 50 outputs
    assert t0.size == 1150 and np.array_equal(t0[:1100], np.concatenate([block(1, 0, 512), block(2, 0, 512),
                                                                         block(3, 0, 76)]))
    # 1 (child of 0): 0's 1100 prompt + 0's 50 generated ids + its strict ids 1150 .. 1299
    #   = block 4's tokens 1150 - 1024 = 126 .. 275
    assert np.array_equal(t1[:1150], t0)
    assert np.array_equal(t1[1150:1300], block(4, 126, 276))
    # 2 (child of 1): 1's 1300 prompt (0's content inside) + 1's 10 outputs + strict 1310 .. 1699
    #   = block 4's 286 .. 511, then block 5's 0 .. 163
    assert np.array_equal(t2[:1310], t1)
    assert np.array_equal(t2[1310:1700], np.concatenate([block(4, 286, 512), block(5, 0, 164)]))
    assert (d["conversation_children"], d["conversation_prompts"], d["strict_fallbacks"]) == (2, 2, 0)
    # the same seed gives the same tokens
    _, again = run_capturing(p, one_at_a_time=True, replay="conversation")
    assert all(np.array_equal(seen[k], again[k]) for k in seen)


def test_strict_replay_ignores_parents(tmp_path: Path) -> None:
    p = write_trace(tmp_path / "t.jsonl", CONV_ROWS)
    d, seen = run_capturing(p, one_at_a_time=True)
    assert d["replay"] == "strict" and "conversation_prompts" not in d
    assert np.array_equal(seen["trace-1"][:1300], np.concatenate([block(1, 0, 512), block(2, 0, 512),
                                                                  block(4, 0, 276)]))


def test_concurrent_child_of_a_running_parent_is_strict(tmp_path: Path) -> None:
    # 1 arrives at 1 ms while 0 decodes its 50 tokens (a step is >= 10 ms); 2 arrives at 100 s
    rows = [(0, 1100, 50, [1, 2, 3]), (1, 1300, 10, [1, 2, 4]), (100_000, 1700, 1, [1, 2, 4, 5])]
    p = write_trace(tmp_path / "t.jsonl", rows)
    d, seen = run_capturing(p, replay="conversation")
    assert (d["conversation_prompts"], d["strict_fallbacks"]) == (1, 1)
    assert np.array_equal(seen["trace-1"][:1300], np.concatenate([block(1, 0, 512), block(2, 0, 512),
                                                                  block(4, 0, 276)]))
    assert np.array_equal(seen["trace-2"][:1310], seen["trace-1"])


def test_hits_of_the_two_replays(tmp_path: Path) -> None:
    # Qwen3-Next: hits on a 544-token grid; one chunk per prompt here (budget 8192).
    # strict: 0's only state is at its stop 1099 // 544 * 544 = 1088. 1 shares 1024 tokens:
    #   attention hit 544, no state there -> hit 0, 544 state-missing tokens; its chunk ends at
    #   the junction 544 (a state), then at its stop 1088. 2 shares 1 's 1300 tokens -> 1088.
    # conversation: 1 shares 0's 1150 tokens -> 1088; 2 shares 1's 1310 -> 1088; nothing missing.
    p = write_trace(tmp_path / "t.jsonl", CONV_ROWS)
    strict, _ = run_capturing(p, one_at_a_time=True)
    conv, _ = run_capturing(p, one_at_a_time=True, replay="conversation")
    assert strict["cached_tokens"] == 1088 and strict["state_missing_tokens"] == 544
    assert strict["hit_tokens_by_cause"] == {"shared_prefix": 0, "next_turn": 1088, "branch": 0, "repeat": 0}
    assert conv["cached_tokens"] == 2176 and conv["state_missing_tokens"] == 0
    assert conv["hit_tokens_by_cause"] == {"shared_prefix": 0, "next_turn": 2176, "branch": 0, "repeat": 0}


def test_replay_checks_its_inputs(tmp_path: Path) -> None:
    p = write_trace(tmp_path / "t.jsonl", CONV_ROWS)
    specs, rows = load_trace(p), read_trace_rows(p)
    with pytest.raises(TraceFormatError, match="3 requests but 2 trace rows"):
        ConversationReplay(specs, rows[:2])
    with pytest.raises(TraceFormatError, match="1300 prompt tokens but the trace row has input_length 1100"):
        ConversationReplay(specs, [rows[0], rows[0], rows[2]])
    with pytest.raises(InvalidSpecError, match="unknown replay 'bogus'"):
        run_trace(p, replay="bogus")


# --------------------------------------------------------------------------- causes
def test_hit_cause_rule() -> None:
    assert hit_cause(512, Relation.NEXT_TURN) == "shared_prefix"   # within the first block
    assert hit_cause(513, Relation.NEXT_TURN) == "next_turn"
    assert hit_cause(544, Relation.BRANCH) == "branch"
    assert hit_cause(1088, Relation.REPEAT) == "repeat"
    assert hit_cause(1088, Relation.NONE) == "shared_prefix"
    assert hit_cause(64, Relation.NONE, shared_tokens=64) == "shared_prefix"
    specs = [RequestSpec(f"r{i}", 0.0, 1, 1, lambda: np.zeros(1, np.int32)) for i in range(3)]
    with pytest.raises(MambaKVError, match="3 requests but 2 links"):
        HitCauses(specs, [Link(Relation.NONE, 0, None, None)] * 2)


def test_causes_on_a_tiny_trace(tmp_path: Path) -> None:
    rows = [
        (0, 1536, 1, [1, 2, 3]),           # a: first turn; one chunk to its stop 1535 // 544 * 544 = 1088
        (1, 2560, 1, [1, 2, 3, 4, 5]),     # b: next turn of a: shares 1536 -> attention 1088, state 1088
        (2, 2200, 1, [1, 2, 3, 4, 9]),     # c: leaves b inside its 5 full blocks (D = 4): a branch;
                                           #    shares 2048 -> attention 1632, states 1088 and b's 2176 -> 1088
        (3, 1536, 1, [1, 2, 3]),           # d: a's ids again: a repeat, cap 1535 -> 1088
        (4, 900, 1, [1, 7]),               # e: only the first block: 512 < 544, no hit
    ]
    p = write_trace(tmp_path / "t.jsonl", rows)
    links = link_requests(read_trace_rows(p))
    assert [link.kind for link in links] == [Relation.NONE, Relation.NEXT_TURN, Relation.BRANCH, Relation.REPEAT,
                                             Relation.NONE]
    d = run_trace(p, num_blocks=2000, one_at_a_time=True).to_dict()
    assert d["hit_tokens_by_cause"] == {"shared_prefix": 0, "next_turn": 1088, "branch": 1088, "repeat": 1088}
    assert sum(d["hit_tokens_by_cause"].values()) == d["cached_tokens"] == 3 * 1088
    assert d["state_missing_tokens"] == 1632 - 1088   # c's attention hit beyond its state


# --------------------------------------------------------------------------- the real trace
@needs_trace
def test_cache_md_counts_on_the_real_trace() -> None:
    links = link_requests(read_trace_rows(TRACE, limit=3000))
    assert sum(link.parent is not None for link in links) == 730
    kinds = Counter(link.kind for link in links)
    # CACHE.md: 2,033 of the later 2,999 share nothing else (+ the first request), 795 next
    # turns, 148 branches, 23 repeats
    assert kinds == {Relation.NONE: 2034, Relation.NEXT_TURN: 795, Relation.BRANCH: 148, Relation.REPEAT: 23}
    later = link_requests(read_trace_rows(TRACE, skip=3000, limit=3000))
    assert sum(link.parent is not None for link in later) == 686


@needs_trace
def test_conversation_replay_of_the_real_trace_hits_more() -> None:
    kw = dict(limit=600, one_at_a_time=True, memory_gib=60.0)
    strict = run_trace(TRACE, **kw).to_dict()  # type: ignore[arg-type]
    conv = run_trace(TRACE, replay="conversation", **kw).to_dict()  # type: ignore[arg-type]
    assert conv["prompt_tokens"] == strict["prompt_tokens"]
    assert conv["conversation_prompts"] == conv["conversation_children"] > 0 and conv["strict_fallbacks"] == 0
    assert conv["hit_tokens_by_cause"]["next_turn"] > strict["hit_tokens_by_cause"]["next_turn"]
    for d in (strict, conv):
        assert sum(d["hit_tokens_by_cause"].values()) == d["cached_tokens"]
        assert list(d["hit_tokens_by_cause"]) == list(CAUSES)


# --------------------------------------------------------------------------- the command
def test_cli_replay_and_skip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = write_trace(tmp_path / "t.jsonl", CONV_ROWS)
    assert main(["trace", str(p), "--one-at-a-time", "--json", "--quiet", "--replay", "conversation",
                 "--layout", "unified"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["replay"], d["skip"], d["cached_tokens"], d["state_missing_tokens"]) == ("conversation", 0, 2176, 0)
    assert d["hit_tokens_by_cause"]["next_turn"] == 2176
    assert main(["trace", str(p), "--one-at-a-time", "--json", "--quiet", "--skip", "1"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["skip"], d["requests"], d["prompt_tokens"]) == (1, 2, 3000)
    assert main(["trace", str(p), "--one-at-a-time", "--quiet", "--skip", "1", "--replay", "conversation",
                 "--layout", "unified"]) == 0
    out = capsys.readouterr().out
    assert "replay conversation (skip 1): hit tokens by cause: shared prefix 0, next turn 1,088, branch 0, " \
           "repeat 0; state missing where attention hit: 0 tokens" in out


@pytest.mark.parametrize("argv, why", [
    (["--skip", "-1"], "--skip"), (["--skip", "x"], "--skip"), (["--replay", "bogus"], "--replay"),
    (["--skip", "3"], "no requests after line 3"),
])
def test_cli_bad_replay_or_skip_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                       why: str) -> None:
    p = write_trace(tmp_path / "t.jsonl", CONV_ROWS)
    assert main(["trace", str(p), "--quiet", *argv]) == 2
    assert why in one_line_error(capsys)
