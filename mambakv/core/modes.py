"""How a Mamba group keeps states: :class:`MambaCacheMode` and :class:`DecodeCheckpoints`, and
the names of the removed 0.x lazy mode."""

from __future__ import annotations

import enum

#: the removed 0.x ALIGN_LAZY mode's names (read as align + decode_checkpoints "latest")
LAZY_MODE_NAMES = ("align_lazy", "lazy")


class MambaCacheMode(str, enum.Enum):
    """How a Mamba group keeps states.

    * ``NONE``: no prefix caching; a request holds ``1 + num_speculative_blocks`` blocks.
    * ``ALIGN``: states checkpointed at block boundaries (DESIGN.md 5.1); a running request
      holds at most ``2 + num_speculative_blocks`` (+ one per step in flight).
    Strings ``"none"`` / ``"align"`` are accepted wherever a mode is taken. The 0.x mode
    ``"align_lazy"`` (or ``"lazy"``) was removed in issue 16: ``MambaSpec`` reads it as
    ``mode="align", decode_checkpoints="latest"``; elsewhere it means ``ALIGN``.
    """

    NONE = "none"
    ALIGN = "align"

    @classmethod
    def _missing_(cls, value: object) -> MambaCacheMode | None:
        if isinstance(value, str):
            name = value.lower()
            if name in LAZY_MODE_NAMES:
                return cls.ALIGN
            for member in cls:
                if member.value == name:
                    return member
        return None


class DecodeCheckpoints(str, enum.Enum):
    """Which decode-boundary states an ``ALIGN`` Mamba group publishes (issue 16).

    * ``EVERY``: eager align: a new block per boundary, each settled boundary state published.
    * ``LATEST``: the running state advances in place; near a boundary a spare block (only if
      free without eviction) receives the boundary state, published once the crossing settled.
    * ``NONE``: the running state advances in place; no decode-boundary state is published.

    Prefill is the same in all three (``mambakv/groups/decode_checkpoints.py``).
    """

    NONE = "none"
    EVERY = "every"
    LATEST = "latest"
