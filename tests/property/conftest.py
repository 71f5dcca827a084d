"""Hypothesis profiles of the stateful fuzzer (tests/property/).

* ``mambakv-ci`` (default): derandomized (the same examples on every run, so CI is
  reproducible) and sized for the CI budget: 800 examples of up to 100 rules, about 40,000
  rule executions and 10,000 request steps, about 20 s on one core for the whole directory.
* ``mambakv-deep``: selected with ``MAMBAKV_FUZZ=deep``; random, up to 100,000 examples of up
  to 200 rules (about an hour; interrupt it when you like), failures kept in hypothesis's
  example database so that a rerun replays them first.

The profiles are registered here and applied explicitly by fuzz_machine.active_settings(), so
loading this conftest never changes the settings of other hypothesis tests.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])

settings.register_profile("mambakv-ci", max_examples=800, stateful_step_count=100, derandomize=True,
                          database=None, **_COMMON)
settings.register_profile("mambakv-deep", max_examples=100_000, stateful_step_count=200, **_COMMON)
