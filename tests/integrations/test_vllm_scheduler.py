"""mambakv inside vLLM 0.33.0's real Scheduler (CPU, fake model outputs, seeded random
workloads): attention-only runs are identical to vLLM's own KVCacheManager step for step
(scheduled tokens, computed tokens, new and resumed block ids, the worker's append-only
tables, preemptions, finishes, free blocks, usage, KV events, prefix-cache stats, the tokens
out), synchronous and async, with the whole-prompt gate on and off, a watermark, and drafts.
Hybrid models (Mamba align mode, no drafts): with room identical but for when states are
published, mambakv's planned state copies are the ones vLLM's worker makes, and under pressure
the same tokens out. Refusals name their feature in one line. Skipped without vLLM (``scripts/install_vllm_cpu.sh`` installs it)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
harness = pytest.importorskip("tests.integrations.vllm_harness")
integration = pytest.importorskip("mambakv.integrations.vllm")
VllmScheduler = importlib.import_module("vllm.v1.core.sched.scheduler").Scheduler
VllmAsyncScheduler = importlib.import_module("vllm.v1.core.sched.async_scheduler").AsyncScheduler


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = harness.write_model(tmp_path_factory.mktemp("tiny-llama"))
    return path


def check(sched: Any) -> None:
    sched.kv_cache_manager.check_invariants()


def both(model: Path, work: list[Any], num_blocks: int, *, in_flight: int, num_drafts: int = 0,
         log_stats: bool = True, hybrid: bool = False, **config: Any) -> tuple[Any, Any]:
    """The same workload on mambakv's scheduler class and on vLLM's own."""
    ours_cls, theirs_cls = ((integration.AsyncScheduler, VllmAsyncScheduler) if in_flight
                            else (integration.Scheduler, VllmScheduler))
    runs = []
    for cls in (ours_cls, theirs_cls):
        sched = harness.make_scheduler(cls, harness.make_vllm_config(model, async_scheduling=bool(in_flight),
                                                                     **config), num_blocks,
                                       log_stats=log_stats, hybrid=hybrid)
        runs.append(harness.drive(sched, work, in_flight=in_flight, num_drafts=num_drafts,
                                  check=check if cls is ours_cls else None))
    return runs[0], runs[1]


def assert_identical(ours: Any, theirs: Any) -> None:
    for i, (a, b) in enumerate(zip(ours.steps, theirs.steps)):
        assert a == b, f"step {i} differs"
    assert len(ours.steps) == len(theirs.steps)
    assert ours.finished == theirs.finished
    assert ours.stats == theirs.stats
    assert ours.end == theirs.end and ours.end[0] is True


SCENARIOS = {
    # name: (num_blocks, workload options, config options)
    "roomy": (400, {}, {}),
    "tight": (40, {}, {}),
    "preempting": (24, {"max_output": 60}, {"reserve_full_isl": False}),
    "whole-prompt-gate": (24, {"max_output": 60}, {}),
    "watermark": (40, {"max_output": 40}, {"reserve_full_isl": False, "watermark": 0.1}),
}


@pytest.mark.parametrize("in_flight", [0, 1], ids=["sync", "async"])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("seed", [0, 1])
def test_attention_only_identical_to_vllm(model: Path, scenario: str, in_flight: int, seed: int) -> None:
    num_blocks, work_options, config = SCENARIOS[scenario]
    work = harness.random_workload(seed + 10 * sorted(SCENARIOS).index(scenario), **work_options)
    ours, theirs = both(model, work, num_blocks, in_flight=in_flight, **config)
    assert_identical(ours, theirs)
    assert ours.end[1] == [("AllBlocksCleared",)]
    assert len(ours.finished) == len(work)
    if scenario == "preempting":
        assert sum(len(s["preempted"]) for s in ours.steps) > 0
    assert sum(s[3] for s in ours.stats) > 0  # prefix hits happened


@pytest.mark.parametrize("in_flight", [0, 1], ids=["sync", "async"])
def test_without_caching_or_stats_identical_to_vllm(model: Path, in_flight: int) -> None:
    """Prefix caching off (no hits, no events), and log_stats off (no statistics: None)."""
    work = harness.random_workload(8, max_output=40)
    ours, theirs = both(model, work, 30, in_flight=in_flight, enable_prefix_caching=False, reserve_full_isl=False)
    assert_identical(ours, theirs)
    assert not any(s["events"] for s in ours.steps) and sum(s[3] for s in ours.stats) == 0
    ours, theirs = both(model, work, 30, in_flight=in_flight, log_stats=False)
    assert_identical(ours, theirs)
    assert ours.stats == [] and ours.end[2] is None


@pytest.mark.parametrize("in_flight", [0, 1], ids=["sync", "async"])
@pytest.mark.parametrize("num_blocks", [30, 400])
def test_drafts_identical_to_vllm(model: Path, num_blocks: int, in_flight: int) -> None:
    """Spec decode (3 drafts; async: vLLM's placeholder drafts): verify steps with 0 .. 3 accepted."""
    work = harness.random_workload(6, max_output=40)
    ours, theirs = both(model, work, num_blocks, in_flight=in_flight, num_drafts=3, num_spec_tokens=3,
                        reserve_full_isl=False)
    assert_identical(ours, theirs)
    assert any(s["spec"] for s in ours.steps)


def test_vllm_hashes_each_block_once(model: Path) -> None:
    """vLLM's block hasher runs once per full block of every request (mambakv reads
    ``request.block_hashes`` and hashes nothing), and mambakv's events carry those keys."""
    calls = {"n": 0}
    made: list[bytes] = []
    inner = harness.HASHER

    def counting(request: Any) -> Any:
        out = inner(request)
        calls["n"] += len(out)
        made.extend(out)
        return out

    harness.HASHER = counting
    try:
        work = harness.random_workload(2)
        sched = harness.make_scheduler(integration.Scheduler, harness.make_vllm_config(model, async_scheduling=False),
                                       400)
        run = harness.drive(sched, work, in_flight=0)
    finally:
        harness.HASHER = inner
    expected = sum((len(a.prompt) + len(run.finished[a.request_id])) // harness.BLOCK for a in work)
    assert calls["n"] == expected
    convert = importlib.import_module("vllm.v1.core.kv_cache_utils").maybe_convert_block_hash
    keys = {h for s in run.steps for e in s["events"] if e[0] == "BlockStored" for h in e[1]}
    assert keys and keys <= {convert(h) for h in made}  # vLLM's own sha256 keys, as vLLM publishes them


@pytest.mark.parametrize("name", ["Scheduler", "AsyncScheduler"])
def test_the_classes_resolve_by_name(model: Path, name: str) -> None:
    config = harness.make_vllm_config(model, async_scheduling=name == "AsyncScheduler",
                                      scheduler_cls=f"mambakv.integrations.vllm.{name}")
    cls = config.scheduler_config.get_scheduler_cls()
    assert cls is getattr(integration, name)
    sched = harness.make_scheduler(cls, config, 64)
    assert type(sched.kv_cache_manager).__module__.startswith("mambakv.")
    assert issubclass(cls, VllmAsyncScheduler if name == "AsyncScheduler" else VllmScheduler)
    run = harness.drive(sched, harness.random_workload(1, num_requests=6), in_flight=int(name == "AsyncScheduler"))
    assert len(run.finished) == 6


@pytest.mark.parametrize("name", ["Scheduler", "AsyncScheduler"])
def test_a_class_that_does_not_match_async_scheduling_is_refused(model: Path, name: str) -> None:
    """``Scheduler`` under async scheduling (or ``AsyncScheduler`` without it) ran, but vLLM
    pairs its own classes with the setting: the mismatch gets one line naming the class to use."""
    from mambakv import UnsupportedEngineError

    config = harness.make_vllm_config(model, async_scheduling=name == "Scheduler",
                                      scheduler_cls=f"mambakv.integrations.vllm.{name}")
    other = "AsyncScheduler" if name == "Scheduler" else "Scheduler"
    with pytest.raises(UnsupportedEngineError, match=f"use mambakv.integrations.vllm.{other}$") as err:
        harness.make_scheduler(config.scheduler_config.get_scheduler_cls(), config, 64)
    assert "\n" not in str(err.value)


def test_another_vllm_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm

    from mambakv import UnsupportedEngineError

    monkeypatch.setattr(vllm, "__version__", "0.34.1")
    for mod in [m for m in sys.modules if m.startswith("mambakv.integrations.vllm")]:
        monkeypatch.delitem(sys.modules, mod)
    with pytest.raises(UnsupportedEngineError) as err:
        importlib.import_module("mambakv.integrations.vllm")
    message = str(err.value)
    assert "\n" not in message and "0.34.1" in message and "0.33" in message


def test_hybrid_with_drafts_and_other_mamba_modes_are_refused(model: Path) -> None:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from mambakv import UnsupportedEngineError

    config = harness.make_vllm_config(model, async_scheduling=False, num_spec_tokens=2)
    with pytest.raises(UnsupportedEngineError, match="hybrid .* speculative decoding") as err:
        harness.make_scheduler(integration.Scheduler, config, 64, hybrid=True)
    assert "\n" not in str(err.value)
    config = harness.make_vllm_config(model, async_scheduling=False)
    config.cache_config.num_gpu_blocks = 64
    attn = FullAttentionSpec(block_size=harness.BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32)
    mamba = MambaSpec(block_size=harness.BLOCK, shapes=((2, 4),), dtypes=(torch.float32,), mamba_cache_mode="none")
    groups = [KVCacheGroupSpec(["model.layers.0.self_attn"], attn), KVCacheGroupSpec(["model.layers.1.mamba"], mamba)]
    config.cache_config.enable_prefix_caching = False
    with pytest.raises(UnsupportedEngineError, match="Mamba cache mode 'none'"):
        integration.Scheduler(vllm_config=config, kv_cache_config=KVCacheConfig(64, [], groups),
                              structured_output_manager=StructuredOutputManager(config), block_size=harness.BLOCK)


def stored_keys(run: Any) -> list[tuple[int, Any]]:
    return [(e[8], h) for s in run.steps for e in s["events"] if e[0] == "BlockStored" for h in e[1]]


@pytest.mark.parametrize("in_flight", [0, 1], ids=["sync", "async"])
@pytest.mark.parametrize("seed", [0, 1])
def test_hybrid_with_room_matches_vllm(model: Path, seed: int, in_flight: int) -> None:
    """A hybrid model (one attention and one Mamba group, align mode) with room in the pool:
    every step schedules the same tokens, gives the same block ids to new and resumed requests,
    the same worker tables, zero lists, preemptions and finishes as vLLM's own manager; the same
    hits and tokens out; and the Mamba state copies mambakv plans are exactly the ones vLLM's
    worker makes from those tables (checked in the harness every step). What differs, by
    design: a Mamba state's BlockStored comes when the step that writes it is processed (1 step
    later synchronously, 1 or 2 with async scheduling), never at allocation; each (group, hash)
    is stored once (vLLM repeats some); async: the free count differs by at most one block at a
    few steps (a state block is given back at a different step)."""
    work = harness.random_workload(seed, max_output=30)
    ours, theirs = both(model, work, 400, in_flight=in_flight, hybrid=True, reserve_full_isl=False)
    assert len(ours.steps) == len(theirs.steps)
    loose = {"events", "free", "usage"} if in_flight else {"events"}
    for i, (a, b) in enumerate(zip(ours.steps, theirs.steps)):
        assert {k: v for k, v in a.items() if k not in loose} == {k: v for k, v in b.items() if k not in loose}, i
        assert abs(a["free"] - b["free"]) <= 1, i
    assert ours.finished == theirs.finished and ours.stats == theirs.stats
    assert sum(s[3] for s in ours.stats) > 0
    mine = stored_keys(ours)
    assert len(mine) == len(set(mine)) and set(mine) == set(stored_keys(theirs))


def pressure_numbers(run: Any) -> tuple[int, int, int, int]:
    """(steps, preemptions, tokens scheduled, hit tokens of first admissions) of a run."""
    return (len(run.steps), sum(len(s["preempted"]) for s in run.steps),
            sum(sum(s["scheduled"].values()) for s in run.steps), sum(s[3] for s in run.stats))


#: (num_blocks, seed, in_flight) -> (mambakv's, vLLM's) pressure_numbers: the table of
#: docs/engine-integration.md ("under pressure")
PRESSURE = {
    (40, 2, 0): ((127, 14, 3353, 224), (127, 14, 3353, 224)),
    (60, 0, 0): ((73, 13, 3602, 368), (75, 12, 3586, 448)),
    (60, 0, 1): ((83, 19, 3954, 192), (79, 14, 3442, 448)),
    (40, 2, 1): ((139, 26, 4480, 144), (137, 21, 3391, 224)),
}


@pytest.mark.parametrize(("num_blocks", "seed", "in_flight"), sorted(PRESSURE), ids=lambda v: str(v))
def test_hybrid_under_pressure_same_tokens_out(model: Path, num_blocks: int, seed: int, in_flight: int) -> None:
    """With a tight pool every request still finishes with the same tokens, the planned state
    copies match vLLM's worker every step, and the coordinator's invariants hold. A request's
    free publishes its settled states and frees its tables whole, in vLLM's order: 40 blocks,
    seed 2, synchronous, every step is then identical to vLLM's own manager (but for when a
    Mamba state's BlockStored comes). Elsewhere the runs differ by vLLM's same-step rule (a
    waiting request whose hit ends on a state written in the same step waits one step; mambakv
    admits it at once with the published, shallower hit) and, with async scheduling, by the
    states still in flight at a free: the numbers of the docs' table."""
    work = harness.random_workload(seed, max_output=30)
    ours, theirs = both(model, work, num_blocks, in_flight=in_flight, hybrid=True, reserve_full_isl=False)
    assert ours.finished == theirs.finished and len(ours.finished) == len(work)
    assert ours.end == theirs.end
    assert (pressure_numbers(ours), pressure_numbers(theirs)) == PRESSURE[num_blocks, seed, in_flight]
    if (num_blocks, seed, in_flight) == (40, 2, 0):
        for i, (a, b) in enumerate(zip(ours.steps, theirs.steps)):
            assert {k: v for k, v in a.items() if k != "events"} == {k: v for k, v in b.items() if k != "events"}, i


@pytest.mark.parametrize(("attribute", "value", "feature"), [
    ("is_encoder_decoder", True, "encoder-decoder models"),
    ("dcp_world_size", 2, "DCP / PCP"),
    ("pcp_world_size", 2, "DCP / PCP"),
    ("hash_block_size", 8, "partial-block prefix hits"),
    ("needs_kv_cache_zeroing", True, "KV-cache block zeroing"),
    ("num_prefill_lookahead", 2, "multi-module MTP"),
    ("connector", object(), "KV connectors"),
])
def test_refused_features_name_themselves(model: Path, attribute: str, value: Any, feature: str) -> None:
    """A vLLM scheduler with a refused feature (set on a constructed vLLM scheduler, as its
    constructor would) is refused by the manager swap with one line naming it, and keeps vLLM's
    own manager."""
    from mambakv import UnsupportedEngineError

    setup = importlib.import_module("mambakv.integrations.vllm.setup")
    sched = harness.make_scheduler(VllmScheduler, harness.make_vllm_config(model, async_scheduling=False), 64)
    assert setup.refused_feature(sched) is None
    own = sched.kv_cache_manager
    setattr(sched, attribute, value)
    with pytest.raises(UnsupportedEngineError, match=feature) as err:
        setup.install_mambakv(sched)
    assert "\n" not in str(err.value) and sched.kv_cache_manager is own


@pytest.mark.parametrize("as_ints", [True, False], ids=["int-keys", "bytes-keys"])
def test_event_keys_are_the_ones_vllm_publishes(monkeypatch: pytest.MonkeyPatch, as_ints: bool) -> None:
    """Event keys as vLLM publishes them, the setting read once per batch: with
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` the low 64 bits of the big-endian hash (by hand:
    bytes 0..31 end in 18 19 1a 1b 1c 1d 1e 1f, bytes 1..32 in 19 .. 20), else the bytes."""
    from mambakv import BlockRemoved, BlockStored

    envs = importlib.import_module("vllm.envs")
    convert = importlib.import_module("vllm.v1.core.kv_cache_utils").maybe_convert_block_hash
    events = importlib.import_module("mambakv.integrations.vllm.events")
    monkeypatch.setattr(envs, "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", as_ints)
    h0, h1 = bytes(range(32)), bytes(range(1, 33))
    out = events.to_vllm_events([BlockStored([h1], h0, list(range(16)), 16, None), BlockRemoved([h0])],
                                (("full_attention", None),))
    k0, k1 = (0x18191A1B1C1D1E1F, 0x191A1B1C1D1E1F20) if as_ints else (h0, h1)
    assert out[0].block_hashes == [k1] and out[0].parent_block_hash == k0 and out[1].block_hashes == [k0]
    assert [convert(h0), convert(h1)] == [k0, k1]  # vLLM's own conversion agrees
    assert out[0].token_ids == list(range(16)) and out[0].kv_cache_spec_kind == "full_attention"
