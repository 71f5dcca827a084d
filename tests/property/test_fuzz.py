"""Stateful fuzzing of the coordinator (rules in fuzz_machine.py, actions and checks in
fuzz_engine.py / fuzz_checks.py). ``MAMBAKV_FUZZ=deep`` selects the long profile."""

from __future__ import annotations

from hypothesis.stateful import run_state_machine_as_test

from tests.property.fuzz_machine import STATS, KVFuzzMachine, active_settings


def test_coordinator_state_machine() -> None:
    STATS.clear()
    run_state_machine_as_test(KVFuzzMachine, settings=active_settings())
    print(f"\nfuzzer exercised: {dict(STATS)}")
    # The run must have reached the interesting paths, or it proves little (a profile or a
    # rule change that starves them fails here instead of passing vacuously).
    for what in ("request steps", "draft steps", "mamba hits", "mamba publications", "failed allocates",
                 "preemptions", "stale hits refused"):
        assert STATS[what] > 0, f"the fuzzer never exercised {what}: {dict(STATS)}"
