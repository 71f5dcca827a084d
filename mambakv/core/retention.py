"""Retention hints: how long an engine wants a request's cached prefix kept.

A per-request hint in the spirit of vLLM RFC #55697 and of the soft retention of SGLang's
priority eviction (``retention_seconds``) and TensorRT-LLM's ``TokenRangeRetentionConfig``: it
moves the request's eviction units, it never locks memory (a retained unit is still evicted when
nothing else is left)::

    hint            tier    meaning
    "low"           0       evicted before any normal unit (e.g. a last turn, a one-off prompt)
    "normal"/None   1       the policy's own order
    "high"          2       evicted only when no low or normal unit is left
    ttl (seconds)   2 -> 1  high while idle for less than ttl seconds (idle = since last use), then normal

A unit shared by several requests keeps the strongest hint of any of them (higher tier; at equal
tier the longer ttl, no ttl counting as forever).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from mambakv.core.errors import InvalidClockError, InvalidRequestError, as_seconds

__all__ = ["HIGH", "LOW", "NORMAL", "RETENTION_NAMES", "Retention", "parse_retention"]

LOW, NORMAL, HIGH = 0, 1, 2
RETENTION_NAMES = {"low": LOW, "normal": NORMAL, "high": HIGH}


class Retention(NamedTuple):
    """A parsed hint: the tier (LOW / NORMAL / HIGH) and, for a ttl hint, its seconds."""

    tier: int
    ttl: float | None = None

    def tier_at(self, idle_s: float) -> int:
        """The tier after `idle_s` seconds without use (a ttl hint decays to NORMAL)."""
        if self.ttl is not None and idle_s >= self.ttl:
            return NORMAL
        return self.tier

    def stronger(self, other: Retention) -> Retention:
        """The hint a unit shared by both keeps."""
        if self.tier != other.tier:
            return self if self.tier > other.tier else other
        if self.ttl is None or other.ttl is None:
            return self if self.ttl is None else other
        return self if self.ttl >= other.ttl else other


NORMAL_RETENTION = Retention(NORMAL)


def parse_retention(value: object) -> Retention:
    """``None`` / ``"low"`` / ``"normal"`` / ``"high"`` / a ttl in seconds (a finite number > 0).

    Raises:
        InvalidRequestError: anything else (bool included).
    """
    if value is None:
        return NORMAL_RETENTION
    if isinstance(value, Retention):
        if value.tier not in (LOW, NORMAL, HIGH) or (value.ttl is not None and not (
                isinstance(value.ttl, float) and math.isfinite(value.ttl) and value.ttl > 0)):
            raise InvalidRequestError(f"a Retention needs a tier 0-2 and no ttl or a float ttl > 0, got {value!r}")
        return value
    if isinstance(value, str):
        tier = RETENTION_NAMES.get(value.lower())
        if tier is None:
            raise InvalidRequestError(f"retain must be low, normal, high or a ttl in seconds, got {value!r}")
        return Retention(tier)
    try:
        ttl = as_seconds(value, "retain")
    except InvalidClockError:
        ttl = -1.0
    if ttl <= 0:
        raise InvalidRequestError(f"retain must be low, normal, high or a ttl in seconds (> 0), got {value!r}")
    return Retention(HIGH, ttl)
