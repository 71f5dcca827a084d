"""Stateful fuzzing of the coordinator (rules in fuzz_machine.py, actions and checks in
fuzz_engine.py / fuzz_checks.py). ``MAMBAKV_FUZZ=deep`` selects the long profile."""

from __future__ import annotations

import os

from hypothesis.stateful import run_state_machine_as_test

from tests.property.fuzz_machine import STATS, KVFuzzMachine, active_settings

REACHED = ("request steps", "draft steps", "mamba hits", "mamba publications", "failed allocates",
           "preemptions", "stale hits refused")


class DecoupledFuzzMachine(KVFuzzMachine):
    """The decoupled layout (issue 14): every group on one page grid, attention pages and
    Mamba state slots from a few superblocks of 1-3 pages; every check of the unified run plus
    the arena's (withdrawn blocks never in a table, a table's block always in a superblock of
    its pool's kind, a failed allocate leaves the arena as it was, a hit's state always comes
    with attention pages covering it)."""

    force_mamba = True  # slots are what the arena converts to
    decoupled = True


def test_coordinator_state_machine() -> None:
    STATS.clear()
    run_state_machine_as_test(KVFuzzMachine, settings=active_settings())
    print(f"\nfuzzer exercised: {dict(STATS)}")
    # The run must have reached the interesting paths, or it proves little (a profile or a
    # rule change that starves them fails here instead of passing vacuously).
    for what in REACHED:
        assert STATS[what] > 0, f"the fuzzer never exercised {what}: {dict(STATS)}"


def test_coordinator_state_machine_decoupled() -> None:
    STATS.clear()
    deep = os.environ.get("MAMBAKV_FUZZ") == "deep"  # CI: half the unified budget (about 12 s)
    run_state_machine_as_test(DecoupledFuzzMachine, settings=active_settings() if deep else active_settings(max_examples=400))
    print(f"\nfuzzer exercised (decoupled): {dict(STATS)}")
    for what in (*REACHED, "arena conversions", "unit evictions", "unit cascades", "unit reuses"):
        assert STATS[what] > 0, f"the fuzzer never exercised {what}: {dict(STATS)}"
