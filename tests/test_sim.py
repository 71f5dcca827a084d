"""Reference scheduler (mambakv.sim): replay bounds, the boundary rule, trace hit rates,
preemption, async lag, spec decode, state-pool copies, the step clock and the workloads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mambakv import (
    FullAttentionSpec,
    InvalidSpecError,
    InvalidTokenCountError,
    KVCacheConfig,
    KVCacheCoordinator,
    KVCacheGroupSpec,
    TraceFormatError,
)
from mambakv.sim import RequestSpec, Scheduler, conversations, load_trace, run_replay, run_trace, trace_block_tokens
from tests.helpers import mamba_spec

TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "conversation_trace.jsonl"


def small_coord(num_blocks: int = 64, *, block: int = 16, nspec: int = 0) -> KVCacheCoordinator:
    """Full attention + one align-mode Mamba group, both of block size `block`."""
    cfg = KVCacheConfig(num_blocks, [KVCacheGroupSpec(["attn"], FullAttentionSpec(block, 1, 8, "float16")),
                                     KVCacheGroupSpec(["mamba"], mamba_spec(block, nspec))])
    return KVCacheCoordinator(cfg, max_model_len=1 << 16)


def spec(rid: str, n: int, out: int = 1, at: float = 0.0, seed: int = 0) -> RequestSpec:
    toks = np.random.default_rng(seed).integers(0, 1000, n, dtype=np.int32)
    return RequestSpec(rid, at, n, out, lambda: toks)


def assert_all_returned(coord: KVCacheCoordinator) -> None:
    coord.check_invariants()
    pool = coord.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1
    assert all(not m.req_to_blocks for m in coord.managers)


# --------------------------------------------------------------------------- the 480k replay
def test_replay_defaults_peak_nine_mamba_blocks_per_request():
    r = run_replay()  # Qwen3-Next, 480,031 tokens, budget 8192, K = 5, 2 steps in flight
    d = r.to_dict()
    # bound: last state + running state + 5 scratch + 2 states of chunks still in flight
    assert d["peak_mamba_blocks_per_request"] == {"1": 2 + 5 + 2, "2": 9, "3": 9}
    assert d["blocks_returned"] and d["finished"] == 1
    assert_all_returned(r.coord)
    attn = d["groups"][0]
    # attention holds every block of the prompt: cdiv(480,031, 544) = 883
    assert attn["kind"] == "full_attention" and attn["peak_blocks"] == 883
    # 12 layers x 544 tokens x 2048 B per token per layer = 13,369,344 B per block
    assert attn["peak_bytes"] == 883 * 13_369_344


def test_replay_synchronous_peaks_seven_and_takes_sixty_steps():
    r = run_replay(in_flight=0, output_tokens=1)
    d = r.to_dict()
    assert d["peak_mamba_blocks_per_request"] == {"1": 2 + 5, "2": 7, "3": 7}
    # stop T = 480,030 // 544 * 544 = 479,808; chunk = 8192 // 544 * 544 = 8160;
    # 479,808 = 58 x 8160 + 6528 -> 59 chunks, then 480,031 - 479,808 = 223: 60 steps
    assert d["steps"] == 60
    assert_all_returned(r.coord)


def test_replay_one_in_flight_peaks_eight():
    d = run_replay(in_flight=1, output_tokens=1).to_dict()
    assert set(d["peak_mamba_blocks_per_request"].values()) == {8}


# --------------------------------------------------------------------------- the (P-1)//B*B rule
@pytest.mark.parametrize("prompt, rule, hit", [
    # P=32: stop 31//16*16 = 16 -> chunks [0,16) [16,32); the repeat (cap 31 -> 16) hits 16.
    (32, True, 16),
    # vLLM's stop 32 - 32 % 16 = 32: one chunk [0,32), the state is at 32 only; cap 16 -> miss.
    (32, False, 0),
    (48, True, 32),   # stop 47//16*16 = 32: chunks [0,32) [32,48); cap 47 -> 32 -> state at 32
    (48, False, 0),   # stop 48: one chunk, state at 48 only; cap 32 -> no state at 32 or 16
    (31, True, 16), (31, False, 16),   # 30//16*16 = 16 = 31 - 31 % 16
    (33, True, 32), (33, False, 32),   # 32//16*16 = 32 = 33 - 33 % 16
])
def test_last_boundary_rule_end_to_end(prompt, rule, hit):
    coord = small_coord()
    sched = Scheduler(coord, stop_before_last_token=rule, check_invariants=True)
    m = sched.run([spec("a", prompt), spec("b", prompt)], one_at_a_time=True)
    assert m.cached_tokens == hit and m.finished == 2
    assert_all_returned(coord)


def test_prefill_chunk_alignment():
    sched = Scheduler(small_coord(), max_num_batched_tokens=40)
    assert sched.prefill_chunk(0, 100, 40) == 32      # largest multiple of 16 within 40
    assert sched.prefill_chunk(0, 100, 10) == 10      # nothing aligned fits: unaligned remainder
    assert sched.prefill_chunk(10, 100, 40) == 38     # an unaligned start ends on 48
    assert sched.prefill_chunk(80, 100, 40) == 16     # stops at 99 // 16 * 16 = 96
    assert sched.prefill_chunk(96, 100, 40) == 4


@pytest.mark.parametrize(("specs", "budget", "prompt", "hit"), [
    # full attention 12 + Mamba 16: alignment lcm = 48; budget 64, a 70-token prompt: the first
    # chunk ends at min(64, 69 // 48 * 48 = 48) // 48 * 48 = 48 (a state at 48, a multiple of 12
    # and 16), the second at 70; the repeat (cap 69) hits 48. Chunks on the Mamba block (64, 70)
    # left no state a hit could use: 0.
    ((FullAttentionSpec(12, 1, 8, "float16"), mamba_spec(16)), 64, 70, 48),
    # Mamba 16 + Mamba 24: lcm 48; budget 80, an 80-token prompt: stop 79 // 48 * 48 = 48, chunks
    # 48 + 32; the repeat hits 48. On the larger block (24) the chunks ended at 72 (not a
    # multiple of 16: no state in the 16-group) and 80 (beyond the cap 79): no hit at all.
    ((mamba_spec(16), mamba_spec(24)), 80, 80, 48),
])
def test_chunks_end_on_the_coordinators_alignment(specs, budget, prompt, hit):
    groups = [KVCacheGroupSpec([f"g{i}"], s) for i, s in enumerate(specs)]
    coord = KVCacheCoordinator(KVCacheConfig(64, groups), max_model_len=1 << 12,
                               hash_block_size=4 if isinstance(specs[0], FullAttentionSpec) else 8)
    sched = Scheduler(coord, max_num_batched_tokens=budget, check_invariants=True)
    m = sched.run([spec("a", prompt), spec("b", prompt)], one_at_a_time=True)
    assert m.cached_tokens == hit and m.finished == 2
    assert_all_returned(coord)


# --------------------------------------------------------------------------- the real trace
def ideal_hit_tokens(rows: list[dict], block: int) -> int:
    """Unbounded cache: each request hits its longest run of leading hash ids whose 512-token
    blocks an earlier request had in full, capped at input_length - 1, then rounded down to a
    multiple of `block` (512: no rounding)."""
    seen: set[tuple[int, ...]] = set()
    total = 0
    for row in rows:
        ids, n = row["hash_ids"], row["input_length"]
        j = 0
        while j < len(ids) and tuple(ids[: j + 1]) in seen:
            j += 1
        total += min(j * 512, n - 1) // block * block
        for k in range(n // 512):
            seen.add(tuple(ids[: k + 1]))
    return total


@pytest.mark.skipif(not TRACE.exists(), reason="../shared/traces/conversation_trace.jsonl absent")
def test_trace_hit_rate_between_ideals_and_drops_with_small_budget():
    with TRACE.open() as f:
        rows = [json.loads(line) for _, line in zip(range(1000), f)]
    prompt = sum(r["input_length"] for r in rows)
    ideal_512 = ideal_hit_tokens(rows, 512) / prompt
    ideal_544 = ideal_hit_tokens(rows, 544) / prompt
    # Outputs are random ids no later prompt shares: capped at 4 tokens to keep the test fast
    # (with an ample pool they cannot change a hit).
    kw = dict(limit=1000, one_at_a_time=True, num_speculative_tokens=0, use_eagle=False, max_output_tokens=4)
    ample = run_trace(TRACE, num_blocks=200_000, **kw)
    d = ample.to_dict()
    assert d["requests"] == d["finished"] == 1000 and d["prompt_tokens"] == prompt
    assert d["hit_rate"] <= ideal_512
    assert d["hit_rate"] >= 0.8 * ideal_544
    assert d["evictions"] == 0
    assert_all_returned(ample.coord)
    small = run_trace(TRACE, memory_gib=60, **kw)  # 4818 blocks
    assert small.metrics.hit_rate < ample.metrics.hit_rate
    assert small.coord.block_pool.num_evictions > 0
    assert_all_returned(small.coord)


# --------------------------------------------------------------------------- preemption, lag, drafts
def test_tiny_pool_forces_preemptions_and_every_request_finishes():
    coord = small_coord(num_blocks=40, nspec=2)
    specs = [spec(f"r{i}", 100 + 37 * i, out=30, seed=i) for i in range(8)]
    sched = Scheduler(coord, max_num_seqs=8, max_num_batched_tokens=256, num_speculative_tokens=2, lag=2,
                      check_invariants=True)
    m = sched.run(specs)
    assert m.preemptions > 0
    assert m.finished == 8 and m.output_tokens == 8 * 30
    assert_all_returned(coord)


def test_spec_decode_appends_exact_output_count_and_runs_copies_on_a_state_pool():
    from mambakv import MambaStatePool

    coord = small_coord(num_blocks=64, nspec=3)
    pool = MambaStatePool(coord.managers[1].kv_cache_spec, 1, 64, device="cpu")
    done = {}
    sched = Scheduler(coord, num_speculative_tokens=3, state_pools={1: pool}, check_invariants=True,
                      on_finish=lambda s: done.__setitem__(s.request.request_id, s.request.num_tokens))
    m = sched.run([spec("a", 50, out=40), spec("b", 70, out=25, at=5.0)])
    assert done == {"a": 50 + 40, "b": 70 + 25}
    assert m.copies > 0  # boundary crossings (50 -> 90 crosses 64, 80) copy last -> running
    pool.check_invariants()
    assert_all_returned(coord)


def test_budget_too_small_for_one_request():
    from mambakv.sim import BudgetTooSmallError

    coord = small_coord(num_blocks=4)  # 3 usable; a 100-token prompt needs 7 attention blocks
    with pytest.raises(BudgetTooSmallError, match="budget too small for one request"):
        Scheduler(coord).run([spec("a", 100)])


# --------------------------------------------------------------------------- the step clock
def test_step_clock_and_arrivals():
    coord = small_coord()
    m = Scheduler(coord).run([spec("a", 100), spec("b", 100, at=1000.0, seed=1)])
    # each request: stop 99//16*16 = 96 -> steps of 96 and 4 tokens:
    # (10 + 0.05 x 96) + (10 + 0.05 x 4) = 25 ms; b waits for its arrival at 1000 ms
    assert m.steps == 4
    assert m.clock_ms == pytest.approx(1000.0 + 25.0)
    m2 = Scheduler(small_coord(), step_ms=1.0, ms_per_token=0.0).run([spec("a", 100)])
    assert m2.clock_ms == pytest.approx(2.0)


# --------------------------------------------------------------------------- workloads
def test_trace_tokens_share_exactly_their_hash_ids(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 700, "output_length": 3, "hash_ids": [5, 6]}\n\n'
                 '{"timestamp": 9, "input_length": 1100, "output_length": 1, "hash_ids": [5, 7, 8]}\n')
    a, b = load_trace(p)
    pa, pb = a.prompt(), b.prompt()
    assert pa.size == 700 and pb.size == 1100 and b.output_len == 1 and b.arrival_ms == 9.0
    assert np.array_equal(pa[:512], pb[:512]) and np.array_equal(pa[:512], trace_block_tokens(5))
    assert not np.array_equal(pa[512:700], pb[512:700])
    assert np.array_equal(pa[512:], trace_block_tokens(6)[:188])


@pytest.mark.parametrize("line, why", [
    ("{not json", "not valid JSON"),
    # a ValueError that is not a JSONDecodeError (no .msg): used to escape as AttributeError
    ('{"timestamp": 0, "input_length": ' + "9" * 5000 + ', "output_length": 1, "hash_ids": [1]}',
     "not valid JSON .*digits"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "hash_ids"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}', "input_length 600"),
    ('{"timestamp": -1, "input_length": 6, "output_length": 1, "hash_ids": [1]}', "timestamp"),
    # json.loads accepts NaN / Infinity; NaN < 0 is False, so they used to pass (nan / inf clock)
    ('{"timestamp": NaN, "input_length": 6, "output_length": 1, "hash_ids": [1]}', "timestamp .*finite"),
    ('{"timestamp": Infinity, "input_length": 6, "output_length": 1, "hash_ids": [1]}', "timestamp .*finite"),
    ('{"timestamp": -Infinity, "input_length": 6, "output_length": 1, "hash_ids": [1]}', "timestamp"),
    ('{"timestamp": "5", "input_length": 6, "output_length": 1, "hash_ids": [1]}', "timestamp"),
])
def test_malformed_trace_line_names_its_line(tmp_path, line, why):
    p = tmp_path / "t.jsonl"
    good = '{"timestamp": 0, "input_length": 6, "output_length": 1, "hash_ids": [1]}\n'
    p.write_text(good + good + line + "\n")
    with pytest.raises(TraceFormatError, match=f"line 3: .*{why}"):
        load_trace(p)
    assert len(load_trace(p, limit=2)) == 2  # the bad line is never read
    with pytest.raises(TraceFormatError, match="cannot read"):
        load_trace(tmp_path / "missing.jsonl")


def test_non_utf8_trace_line_names_its_line(tmp_path):
    p = tmp_path / "t.jsonl"
    good = b'{"timestamp": 0, "input_length": 6, "output_length": 1, "hash_ids": [1]}\n'
    p.write_bytes(good + b'{"timestamp": 1, "x": "\xff\xfe", "input_length": 6}\n')
    with pytest.raises(TraceFormatError, match="line 2: not UTF-8"):
        load_trace(p)
    assert len(load_trace(p, limit=1)) == 1


@pytest.mark.parametrize("gib, why", [(float("nan"), "finite"), (float("inf"), "finite"), (0, "> 0"),
                                      (-1, "> 0"), ("60", "finite"), (1e308, "too large"),
                                      # 1e30 GiB / 13,369,344 B per block ~ 8e31 blocks
                                      (1e30, "exceeds the simulator's limit")])
def test_build_coordinator_refuses_bad_or_huge_memory(gib, why):
    from mambakv.sim.runner import build_coordinator

    with pytest.raises(InvalidSpecError, match=why):
        build_coordinator("qwen3-next-80b-a3b", gib)


def test_block_limit_boundary():
    from mambakv.sim.runner import MAX_NUM_BLOCKS, build_coordinator

    with pytest.raises(InvalidSpecError, match="num_blocks"):
        build_coordinator("qwen3-next-80b-a3b", 1.0, num_blocks=MAX_NUM_BLOCKS + 1)
    # 1 GiB / 13,369,344 B = 80 blocks: far below the limit
    assert build_coordinator("qwen3-next-80b-a3b", 1.0).block_pool.num_blocks == 80


def test_oversized_workloads_refused_before_building():
    from mambakv.sim.runner import DEFAULT_MAX_MODEL_LEN

    with pytest.raises(InvalidTokenCountError, match="max_model_len"):  # a 400 GB prompt was allocated
        run_replay(prompt_tokens=10**11)
    with pytest.raises(InvalidTokenCountError, match="max_model_len"):
        run_replay(prompt_tokens=DEFAULT_MAX_MODEL_LEN, output_tokens=1)
    with pytest.raises(TraceFormatError, match="use fewer"):
        conversations(10**11, 4)  # built every prompt up front: ran without end
    # the worst case of 8 chats x 4 turns: 8 x (4 x 1024 + 1024 x 10 + 256 x 6) = 126,976 tokens
    assert len(conversations(8, 4)) == 32


def test_conversation_turn_extends_previous_prompt_and_output():
    specs = {s.request_id: s for s in conversations(2, 3, seed=1)}
    t0, t1 = specs["chat-0-0"], specs["chat-0-1"]
    prev = np.concatenate([t0.prompt(), t0.output_token_ids])
    assert np.array_equal(t1.prompt()[: prev.size], prev) and t1.num_prompt_tokens > prev.size
    assert np.array_equal(specs["chat-1-0"].prompt()[:1024], t0.prompt()[:1024])  # shared system prompt
    coord = small_coord(num_blocks=512)
    m = Scheduler(coord, check_invariants=True).run(list(specs.values()))
    assert m.finished == 6 and m.cached_tokens > 0
    assert_all_returned(coord)


def test_generation_stops_at_max_model_len():
    """An output longer than the model allows ends at max_model_len, as an engine's length cap
    does: a 100-token prompt asking for 10**12 outputs finishes with exactly 160 tokens."""
    cfg = KVCacheConfig(64, [KVCacheGroupSpec(["m"], mamba_spec(16))])
    coord = KVCacheCoordinator(cfg, max_model_len=160)
    spec = RequestSpec("long", 0.0, 100, 10**12, lambda: np.arange(100, dtype=np.int32))
    done = []
    metrics = Scheduler(coord, on_finish=done.append).run([spec], one_at_a_time=True)
    assert metrics.finished == 1 and done[0].request.num_tokens == 160
    assert metrics.output_tokens == 60  # 160 - 100
    coord.check_invariants()
    assert coord.block_pool.get_num_free_blocks() == 63
