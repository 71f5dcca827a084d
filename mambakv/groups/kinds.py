"""The kinds of KV-cache group, as an enum: the coordinator, the hit finder and the metrics
dispatch on it, never on class names."""

from __future__ import annotations

import enum

from mambakv.core.errors import InvalidSpecError
from mambakv.core.spec import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec


class GroupKind(str, enum.Enum):
    """What one KV-cache group keeps per block.

    ================  ==================================================================
    kind              block holds / published when / retired
    ================  ==================================================================
    FULL_ATTENTION    KV of ``block_size`` tokens / full (at allocation) / never
    SLIDING_WINDOW    KV of ``block_size`` tokens / full (at allocation) / outside window
    MAMBA             one whole recurrent state / settled boundary state / older states
    ================  ==================================================================
    """

    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    MAMBA = "mamba"

    @property
    def is_attention(self) -> bool:
        return self is not GroupKind.MAMBA

    @classmethod
    def of(cls, spec: KVCacheSpec) -> GroupKind:
        """The kind of `spec`. Raises InvalidSpecError for a spec type with no kind."""
        if isinstance(spec, SlidingWindowSpec):
            return cls.SLIDING_WINDOW
        if isinstance(spec, FullAttentionSpec):
            return cls.FULL_ATTENTION
        if isinstance(spec, MambaSpec):
            return cls.MAMBA
        raise InvalidSpecError(f"no KV-cache group kind for spec type {type(spec).__name__}")
