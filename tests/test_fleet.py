"""`mambakv fleet`: N reference schedulers behind a router on a trace's arrival clock.

The hand-made traces use Qwen3-Next-80B-A3B at 60 GiB (all groups in 544-token blocks, so hits
and announced blocks come in multiples of 544). Worked numbers, default step clock
(10 ms + 0.05 ms per token)::

    A: 1,536 tokens, ids [1, 2, 3]      chunk stop T = 1535 // 544 * 544 = 1,088
       step 1: 1,088 tokens, 10 + 54.4 = 64.4 ms   (the state at 1,088 is published)
       step 2:   448 tokens, 10 + 22.4 = 32.4 ms   (the first output is sampled)
       step 3:     1 token,  10.05 ms              (the second output: A finishes at 106.85 ms)
    B: 1,536 tokens, ids [10, 11, 12]   the same steps
    C: 2,048 tokens, ids [10, 11, 12, 13]: shares B's first 1,536 tokens; an instance that ran
       B caches B's attention blocks 0, 1 and the state at 1,088 (block 2 holds B's random
       outputs): C's hit there is 1,088 tokens, 2 announced blocks x 544.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mambakv import InvalidSpecError
from mambakv.cli import main
from mambakv.sim.fleet import percentile, run_fleet
from mambakv.sim.router import PrefixIndex, choose, least_loaded

TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "conversation_trace.jsonl"
A = {"timestamp": 0, "input_length": 1536, "output_length": 2, "hash_ids": [1, 2, 3]}
B = {"timestamp": 50, "input_length": 1536, "output_length": 2, "hash_ids": [10, 11, 12]}


def C(ts: float) -> dict:
    return {"timestamp": ts, "input_length": 2048, "output_length": 2, "hash_ids": [10, 11, 12, 13]}


def write(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------------- the choice rules
def test_least_loaded_ties_to_the_lowest_index():
    assert least_loaded([5, 3, 3, 9]) == 1
    assert least_loaded([0, 0]) == 0


def test_choose_best_score_then_load_then_index():
    assert choose([10, 10, 10], [0, 544, 544]) == 1            # best score; tie -> lower index
    assert choose([10, 5, 10], [0, 544, 544]) == 1             # tie -> least load
    assert choose([10, 12, 5], [0, 544, 544], load_bound=1.5) == 2
    assert choose([4, 4], [0, 0]) == 0


def test_the_load_bound_overrides_the_overlap():
    # mean 1: 2 > 1.5 x 1, so instance 1 is out although it holds 1,088 tokens; 2 <= 4 x 1
    assert choose([0, 2], [0, 1088], load_bound=1.5) == 0
    assert choose([0, 2], [0, 1088], load_bound=4) == 1
    # mean 100: bound 150 -> instance 2 (160) is out, instance 1 (140) holds the longest left
    assert choose([0, 140, 160], [0, 544, 1088]) == 1


def test_choose_rejects_bad_input():
    with pytest.raises(InvalidSpecError):
        choose([], [])
    with pytest.raises(InvalidSpecError):
        choose([1, 2], [0])
    with pytest.raises(InvalidSpecError):
        choose([1, 2], [0, 0], load_bound=0.9)


def test_prefix_index_matches_leading_announced_blocks():
    from mambakv.core.events import AllBlocksCleared, BlockRemoved, BlockStored

    idx = PrefixIndex(2)
    idx.apply(0, [BlockStored([b"a", b"b"], None, [1] * 8, 4, None)])
    idx.apply(1, [BlockStored([b"a"], None, [1] * 4, 4, None), BlockStored([b"c"], b"a", [2] * 4, 4, None)])
    assert idx.overlaps([b"a", b"b", b"x"], []) == [2, 1]
    assert idx.overlaps([b"b"], []) == [1, 0]  # keys are chain hashes: "b" names the chain a-b
    idx.apply(0, [BlockRemoved([b"b"])])
    assert idx.overlaps([b"a", b"b"], []) == [1, 1]
    idx.apply(1, [AllBlocksCleared()])
    assert idx.overlaps([b"a"], []) == [1, 0]


def test_percentile_nearest_rank():
    assert percentile([], 90) == 0.0
    assert percentile([0.0, 34.4], 90) == 34.4
    assert percentile(list(range(1, 11)), 90) == 9
    assert percentile(list(range(1, 11)), 50) == 5


# ---------------------------------------------------------------------- whole runs
@pytest.mark.parametrize("router", ["round-robin", "least-loaded", "kv", "oracle"])
def test_c_after_everything_finished(tmp_path, router):
    """C arrives at 1,000 ms, when both instances are idle (loads 0). A went to 0; B, arriving
    at 50 ms while A runs (load 1,536 + 2 - 1,088 = 450), to 1 under every router. Round-robin
    sends C (the third request) to 0, least-loaded to 0 (tie -> lower index); kv and oracle to 1,
    which holds 1,088 of C's tokens: fleet hit rate 1,088 / (1,536 + 1,536 + 2,048) = 0.2125."""
    res = run_fleet(write(tmp_path, [A, B, C(1000)]), instances=2, router=router)
    d = res.to_dict()
    expect_c = 1 if router in ("kv", "oracle") else 0
    assert res.fleet.assignments == [0, 1, expect_c]
    assert d["cached_tokens"] == (1088 if expect_c else 0)
    assert d["hit_rate"] == (0.2125 if expect_c else 0.0)
    assert d["finished"] == 3 and d["prompt_tokens"] == 5120
    per = d["per_instance"]
    assert [p["requests"] for p in per] == ([1, 2] if expect_c else [2, 1])
    # scheduled tokens: A and B 1,088 + 448 + 1 each; C 2,048 - hit + 1 decode
    c_tokens = 2048 - (1088 if expect_c else 0) + 1
    assert [p["scheduled_tokens"] for p in per] == ([1537, 1537 + c_tokens] if expect_c else [1537 + c_tokens, 1537])
    assert d["max_scheduled_share"] == round(max(1537, 1537 + c_tokens) / (3074 + c_tokens), 6)
    if expect_c:
        assert per[1]["hit_rate"] == round(1088 / 3584, 6)


@pytest.mark.parametrize("bound, expect_c, hit", [(1.5, 0, 0), (4.0, 1, 1088)])
@pytest.mark.parametrize("router", ["kv", "oracle"])
def test_the_load_bound_in_a_run(tmp_path, router, bound, expect_c, hit):
    """C arrives at 120 ms: instance 0 finished A at 106.85 ms (load 0); instance 1 started B
    at 50 ms and has run its two prefill steps (to 114.4, then 146.8 ms: its clock is past 120)
    so B still owes 1,536 + 2 - 1,536 = 2 tokens. Mean load 1: at bound 1.5 instance 1 (2) is
    out and C goes to 0 with no hit; at bound 4 it goes to 1 and hits 1,088 tokens."""
    res = run_fleet(write(tmp_path, [A, B, C(120)]), instances=2, router=router, load_bound=bound)
    assert res.fleet.assignments == [0, 1, expect_c]
    assert res.to_dict()["cached_tokens"] == hit


def test_round_robin_order(tmp_path):
    rows = [dict(A, timestamp=t, hash_ids=[100 + t, 200 + t, 300 + t]) for t in range(7)]
    res = run_fleet(write(tmp_path, rows), instances=3, router="round-robin")
    assert res.fleet.assignments == [0, 1, 2, 0, 1, 2, 0]
    assert [p["requests"] for p in res.to_dict()["per_instance"]] == [3, 2, 2]


def test_least_loaded_choice(tmp_path):
    """A at 0 -> 0; D (2,048 tokens) at 10 ms -> 1 (0 owes 450 after A's first step); E at 20 ms:
    loads 450 and 2,048 + 2 - 1,632 = 418 (D's first chunk ends at 2,047 // 544 * 544 = 1,632)
    -> instance 1."""
    d_row = {"timestamp": 10, "input_length": 2048, "output_length": 2, "hash_ids": [20, 21, 22, 23]}
    e_row = {"timestamp": 20, "input_length": 600, "output_length": 2, "hash_ids": [30, 31]}
    res = run_fleet(write(tmp_path, [A, d_row, e_row]), instances=2, router="least-loaded")
    assert res.fleet.assignments == [0, 1, 1]


def test_queueing_delay(tmp_path):
    """One instance: A at 0 runs its first chunk 0 -> 64.4 ms; B, arriving at 30 ms, is admitted
    at the next step, at 64.4 ms: delays 0 and 34.4, mean 17.2, p90 34.4."""
    res = run_fleet(write(tmp_path, [A, dict(B, timestamp=30)]), instances=1)
    d = res.to_dict()
    assert d["queue_delay_ms_mean"] == 17.2
    assert d["queue_delay_ms_p90"] == 34.4
    assert d["max_scheduled_share"] == 1.0


def test_oracle_probes_leave_the_stats_alone(tmp_path):
    """The oracle asks both instances for each of the 3 requests; each instance's counters
    still count only the requests it admitted (instance 1: B and C, 1,536 + 2,048 tokens)."""
    res = run_fleet(write(tmp_path, [A, B, C(1000)]), instances=2, router="oracle")
    s0, s1 = (inst.sched.coord.prefix_cache_stats for inst in res.fleet.instances)
    assert (s0.requests, s0.queries, s0.hits) == (1, 1536, 0)
    assert (s1.requests, s1.queries, s1.hits) == (2, 3584, 1088)


def test_run_fleet_rejects_bad_input(tmp_path):
    path = write(tmp_path, [A])
    with pytest.raises(InvalidSpecError, match="at least one instance"):
        run_fleet(path, instances=0)
    with pytest.raises(InvalidSpecError, match="unknown router"):
        run_fleet(path, router="random")
    with pytest.raises(InvalidSpecError, match="load bound"):
        run_fleet(path, router="kv", load_bound=0.5)
    with pytest.raises(InvalidSpecError, match="unknown index"):
        run_fleet(path, router="kv", index="redis")


def test_dynamo_index_gives_the_same_choices(tmp_path):
    pytest.importorskip("dynamo.llm", reason="needs ai-dynamo-runtime")
    pytest.importorskip("msgspec")
    rows = [A, B, C(120), C(1000), dict(A, timestamp=1100, input_length=1800, hash_ids=[1, 2, 3, 4]),
            dict(B, timestamp=1101), C(1102)]
    for bound in (1.5, 4.0):
        ours = run_fleet(write(tmp_path, rows), instances=3, router="kv", load_bound=bound)
        theirs = run_fleet(write(tmp_path, rows), instances=3, router="kv", load_bound=bound, index="dynamo")
        assert ours.fleet.assignments == theirs.fleet.assignments
        assert ours.to_dict()["cached_tokens"] == theirs.to_dict()["cached_tokens"] > 0


@pytest.mark.skipif(not TRACE.exists(), reason="../shared/traces/conversation_trace.jsonl absent")
def test_real_trace_kv_matches_dynamo_and_oracle_counts():
    """300 requests of the real trace, 4 instances: Dynamo's RadixTree makes the kv router's
    choices exactly; every request finishes; shares sum to 1."""
    kw = dict(instances=4, router="kv", limit=300)
    ours = run_fleet(TRACE, **kw)
    d = ours.to_dict()
    assert d["finished"] == 300
    assert abs(sum(p["scheduled_share"] for p in d["per_instance"]) - 1) < 1e-5
    assert sum(p["requests"] for p in d["per_instance"]) == 300
    pytest.importorskip("dynamo.llm", reason="needs ai-dynamo-runtime")
    theirs = run_fleet(TRACE, index="dynamo", **kw)
    assert ours.fleet.assignments == theirs.fleet.assignments


# ---------------------------------------------------------------------- the command
def test_cli_fleet_json(tmp_path, capsys):
    path = write(tmp_path, [A, B, C(1000)])
    assert main(["fleet", str(path), "--instances", "2", "--router", "kv", "--json", "--layout", "unified"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["hit_rate"] == 0.2125 and d["instances"] == 2 and d["router"] == "kv"
    assert [p["hit_rate"] for p in d["per_instance"]] == [0.0, round(1088 / 3584, 6)]
    # Decoupled (the default): B's last chunk ends at 1536, on the 64-token grid, so its state
    # there is published; the kv router (fed both pools' events) sends C to B's instance, and C
    # hits all of B: 1536 / (1536 + 2048) there, 1536 / 5120 overall.
    assert main(["fleet", str(path), "--instances", "2", "--router", "kv", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["hit_rate"] == 0.3 and d["layout"] == "decoupled"
    assert [p["hit_rate"] for p in d["per_instance"]] == [0.0, round(1536 / 3584, 6)]
    for key in ("queue_delay_ms_mean", "queue_delay_ms_p90", "max_scheduled_share", "preemptions"):
        assert key in d
    for key in ("preemptions", "peak_running", "peak_waiting", "finished", "scheduled_share"):
        assert key in d["per_instance"][0]


def test_cli_fleet_table(tmp_path, capsys):
    path = write(tmp_path, [A, B, C(1000)])
    assert main(["fleet", str(path), "--instances", "2", "--router", "oracle", "--layout", "unified"]) == 0
    out = capsys.readouterr().out
    assert "hit rate      0.2125" in out and "router oracle (load bound 1.5x mean)" in out


@pytest.mark.parametrize("argv, needle", [
    (["--instances", "0"], "--instances: expected an int > 0"),
    (["--router", "random"], "--router: invalid choice: 'random'"),
    (["--load-bound", "0.5"], "--load-bound: expected a finite number >= 1"),
    (["--index", "redis"], "--index: invalid choice"),
])
def test_cli_fleet_bad_input(tmp_path, capsys, argv, needle):
    path = write(tmp_path, [A])
    assert main(["fleet", str(path), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mambakv: error: ") and needle in err and err.count("\n") == 1


def test_cli_fleet_missing_trace(tmp_path, capsys):
    assert main(["fleet", str(tmp_path / "none.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mambakv: error: ") and err.count("\n") == 1


def test_cli_fleet_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = write(tmp_path, [A, B, C(1000)])
    png = tmp_path / "f.png"
    assert main(["fleet", str(path), "--instances", "2", "--router", "kv", "--plot", str(png), "--quiet"]) == 0
    assert png.stat().st_size > 1000


def test_one_instance_is_the_single_scheduler_run(tmp_path):
    """--instances 1 is `mambakv trace`: the same steps, clock, hits and preemptions."""
    from mambakv.sim import run_trace

    rows = [A, dict(B, timestamp=30), C(40), dict(A, timestamp=45, hash_ids=[1, 2, 3, 9], input_length=1900)]
    path = write(tmp_path, rows)
    for router in ("round-robin", "kv", "oracle"):
        fleet = run_fleet(path, instances=1, router=router).to_dict()
        single = run_trace(path).to_dict()
        for key in ("hit_rate", "cached_tokens", "preemptions", "sim_clock_ms", "scheduled_tokens"):
            assert fleet[key] == single[key], (router, key)
        assert fleet["cached_tokens"] > 0


@pytest.mark.skipif(not TRACE.exists(), reason="../shared/traces/conversation_trace.jsonl absent")
def test_real_trace_one_instance_is_the_single_run():
    from mambakv.sim import run_trace

    fleet = run_fleet(TRACE, instances=1, limit=300).to_dict()
    single = run_trace(TRACE, limit=300).to_dict()
    for key in ("hit_rate", "cached_tokens", "preemptions", "sim_clock_ms", "scheduled_tokens", "finished"):
        assert fleet[key] == single[key], key
    assert fleet["per_instance"][0]["steps"] == single["steps"]


def test_instances_generate_different_outputs(tmp_path):
    """Instance i's scheduler is seeded seed + i: A on 0 and B on 1 (both first on their
    instance) get different output ids; one instance alone keeps the command's seed."""
    outs: dict[str, list[int]] = {}

    def keep(sreq):
        outs[sreq.spec.request_id] = sreq.request.all_token_ids[sreq.spec.num_prompt_tokens:].tolist()

    run_fleet(write(tmp_path, [A, dict(B, timestamp=0)]), instances=2, on_finish=keep)
    assert len(outs["trace-0"]) == len(outs["trace-1"]) == 2 and outs["trace-0"] != outs["trace-1"]


@pytest.mark.parametrize("index", ["mambakv", "dynamo"])
def test_kv_index_follows_evictions(tmp_path, index):
    """Small pools (40 blocks of 544 tokens per instance): later requests evict earlier chains.
    After every step the index holds exactly what each instance announces (check_invariants),
    and the run still finds hits; Dynamo's tree makes the same choices."""
    if index == "dynamo":
        pytest.importorskip("dynamo.llm", reason="needs ai-dynamo-runtime")
        pytest.importorskip("msgspec")
    rows = []
    for k in range(16):
        fam = k % 5
        ids = [1000 * fam + j for j in range(2 + k % 3)] + [50_000 + k]
        rows.append({"timestamp": 150 * k, "input_length": 512 * len(ids), "output_length": 3, "hash_ids": ids})
    path = write(tmp_path, rows)
    res = run_fleet(path, instances=2, router="kv", num_blocks=40, check_invariants=True, index=index)
    d = res.to_dict()
    assert d["finished"] == 16 and d["cached_tokens"] > 0
    assert sum(p["evictions"] for p in d["per_instance"]) > 0
    assert res.fleet.assignments == run_fleet(path, instances=2, router="kv", num_blocks=40).fleet.assignments


def test_fleet_rejects_mixed_block_sizes():
    from mambakv.sim.fleet import Fleet
    from tests.coord_helpers import coordinator, fa_spec
    from tests.helpers import mamba_spec

    a = coordinator(20, fa_spec(4), mamba_spec(4), enable_kv_cache_events=True)
    b = coordinator(20, fa_spec(8), mamba_spec(8), enable_kv_cache_events=True)
    with pytest.raises(InvalidSpecError, match="different sizes"):
        Fleet([a, b], "oracle")
    with pytest.raises(InvalidSpecError, match="enable_kv_cache_events"):
        Fleet([coordinator(20, fa_spec(4), mamba_spec(4))], "kv")
    with pytest.raises(InvalidSpecError, match="at least one instance"):
        Fleet([], "kv")
    with pytest.raises(InvalidSpecError, match="lag 0"):
        Fleet([a], "kv", lag=1)


def test_cli_choices_are_the_simulators_and_the_parser_loads_no_simulator():
    import subprocess
    import sys

    from mambakv.cli import fleet as cli
    from mambakv.sim.fleet import INDEXES
    from mambakv.sim.router import DEFAULT_LOAD_BOUND, ROUTERS

    assert (cli.FLEET_ROUTERS, cli.FLEET_INDEXES, cli.FLEET_LOAD_BOUND) == (ROUTERS, INDEXES, DEFAULT_LOAD_BOUND)
    code = "import sys, mambakv.cli as c; c.build_parser(); print('mambakv.sim' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
