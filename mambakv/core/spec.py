"""KV-cache specs: what one KV-cache group stores per block, and the config of all groups.

Specs are frozen dataclasses validated at construction (an invalid one raises
:class:`~mambakv.core.errors.InvalidSpecError`).  This module does not import torch: dtypes are
kept as names (``"bfloat16"``); a ``torch.dtype`` is accepted and turned into its name. The dtype
table lives in :mod:`mambakv.core.dtypes`, the Mamba mode enums in :mod:`mambakv.core.modes`
(both re-exported here).

Page size (bytes per block per layer), the unit of DESIGN.md section 7's memory layout:

=================  ================================================================
spec               page_size_bytes
=================  ================================================================
full attention     ``2 (K and V) x block_size x num_kv_heads x head_size x itemsize``
sliding window     same as full attention
Mamba              ``sum(prod(shape) x itemsize)`` over the layer's states, or the
                   padded size when ``page_size_padded`` is given
=================  ================================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from mambakv.core.arena_geometry import SuperblockGeometry
from mambakv.core.dtypes import DTYPE_SIZES as DTYPE_SIZES  # re-exported: spec.py was their home
from mambakv.core.dtypes import dtype_name as dtype_name
from mambakv.core.dtypes import dtype_size as dtype_size
from mambakv.core.errors import InvalidSpecError
from mambakv.core.modes import LAZY_MODE_NAMES as LAZY_MODE_NAMES
from mambakv.core.modes import DecodeCheckpoints as DecodeCheckpoints
from mambakv.core.modes import MambaCacheMode as MambaCacheMode


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidSpecError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class KVCacheSpec:
    """Base of every spec: ``block_size`` tokens per block (> 0)."""

    block_size: int

    def __post_init__(self) -> None:
        _check_positive("block_size", self.block_size)

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block occupies in one layer."""
        raise NotImplementedError

    def max_memory_usage_bytes(self, max_model_len: int) -> int:
        """Most bytes one layer of this group needs for one running request."""
        raise NotImplementedError


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    """Common part of the attention specs (K and V of ``num_kv_heads x head_size`` per token)."""

    num_kv_heads: int = 1
    head_size: int = 1
    dtype: Any = "bfloat16"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive("num_kv_heads", self.num_kv_heads)
        _check_positive("head_size", self.head_size)
        object.__setattr__(self, "dtype", dtype_name(self.dtype))

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * DTYPE_SIZES[self.dtype]

    def max_memory_usage_bytes(self, max_model_len: int) -> int:
        return math.ceil(max_model_len / self.block_size) * self.page_size_bytes


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Full (causal) attention: every token's KV is kept for the request's lifetime."""


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """Sliding-window attention over the last ``sliding_window`` tokens (> 0)."""

    sliding_window: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive("sliding_window", self.sliding_window)

    def max_memory_usage_bytes(self, max_model_len: int) -> int:
        # The window, plus one partial block at each end (as vLLM counts it).
        tokens = min(self.sliding_window - 1 + self.block_size, max_model_len)
        return (math.ceil(tokens / self.block_size) + 1) * self.page_size_bytes


@dataclass(frozen=True, init=False)
class MambaSpec(KVCacheSpec):
    """A recurrent-state group: one block holds one whole state of one layer.

    Args:
        block_size: tokens between checkpoints (align mode); for mode NONE of a Mamba-only
            model, ``max_model_len``.
        shapes: the state shapes of one layer, e.g. ``((d_conv - 1, channels), (heads, head_dim,
            d_state))``: conv state first, kernel taps before channels (DESIGN.md 7).
        dtypes: one dtype per state (names or torch dtypes), same length as ``shapes``.
        mode: :class:`MambaCacheMode` or its string (``"align"``); the attribute ``spec.mode``
            is always the :class:`MambaCacheMode` (normalised at construction, and typed so).
        num_speculative_blocks: scratch blocks for draft positions (MTP/EAGLE), >= 0.
        page_size_padded: bytes per block if padded up to the attention page (DESIGN.md 7).
        decode_checkpoints: :class:`DecodeCheckpoints` or its string (``"every"``, the default,
            ``"latest"``, ``"none"``); used by mode ``ALIGN`` only. Part of the spec's equality.

    Raises:
        InvalidSpecError: empty or mismatched shapes/dtypes, a non-positive dimension, an
            unknown dtype or mode, a negative ``num_speculative_blocks``, or a padded page
            smaller than the raw one.
    """

    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[Any, ...] = ()
    mode: MambaCacheMode = MambaCacheMode.NONE
    num_speculative_blocks: int = 0
    page_size_padded: int | None = field(default=None, compare=True)
    decode_checkpoints: DecodeCheckpoints = DecodeCheckpoints.EVERY

    def __init__(self, block_size: int, shapes: tuple[tuple[int, ...], ...] = (), dtypes: tuple[Any, ...] = (),
                 mode: MambaCacheMode | str = MambaCacheMode.NONE, num_speculative_blocks: int = 0,
                 page_size_padded: int | None = None,
                 decode_checkpoints: DecodeCheckpoints | str = DecodeCheckpoints.EVERY) -> None:
        # Written out (``init=False``) only so that `mode` may be a string while the field is
        # typed as the enum: the dataclass would type both as the field's annotation.  Same
        # parameters, order and defaults as the generated one; __post_init__ validates.
        set_field = object.__setattr__
        set_field(self, "block_size", block_size)
        set_field(self, "shapes", shapes)
        set_field(self, "dtypes", dtypes)
        set_field(self, "mode", mode)
        set_field(self, "num_speculative_blocks", num_speculative_blocks)
        set_field(self, "page_size_padded", page_size_padded)
        set_field(self, "decode_checkpoints", decode_checkpoints)
        self.__post_init__()

    def __post_init__(self) -> None:
        super().__post_init__()
        shapes = tuple(tuple(int(d) for d in s) for s in self.shapes)
        if not shapes or len(shapes) != len(tuple(self.dtypes)):
            raise InvalidSpecError(
                f"shapes and dtypes must be non-empty and of equal length, got "
                f"{len(shapes)} shapes and {len(tuple(self.dtypes))} dtypes"
            )
        if any(not s or min(s) <= 0 for s in shapes):
            raise InvalidSpecError(f"every state dimension must be positive, got {shapes}")
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(self, "dtypes", tuple(dtype_name(d) for d in self.dtypes))
        if isinstance(self.mode, str) and self.mode.lower() in LAZY_MODE_NAMES:
            object.__setattr__(self, "decode_checkpoints", DecodeCheckpoints.LATEST)  # the 0.x lazy mode
        try:
            object.__setattr__(self, "mode", MambaCacheMode(self.mode))
        except ValueError:
            raise InvalidSpecError(f"unknown Mamba cache mode {self.mode!r}") from None
        try:
            object.__setattr__(self, "decode_checkpoints", DecodeCheckpoints(self.decode_checkpoints))
        except ValueError:
            raise InvalidSpecError(f"decode_checkpoints must be none, every or latest, "
                                   f"got {self.decode_checkpoints!r}") from None
        nspec = self.num_speculative_blocks
        if not isinstance(nspec, int) or isinstance(nspec, bool) or nspec < 0:
            raise InvalidSpecError(f"num_speculative_blocks must be an int >= 0, got {nspec!r}")
        if self.page_size_padded is not None and self.page_size_padded < self.raw_page_size_bytes:
            raise InvalidSpecError(
                f"page_size_padded {self.page_size_padded} < raw page {self.raw_page_size_bytes}"
            )

    @property
    def raw_page_size_bytes(self) -> int:
        """Bytes of one layer's states, unpadded."""
        return sum(math.prod(s) * DTYPE_SIZES[d] for s, d in zip(self.shapes, self.dtypes))

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.raw_page_size_bytes

    @property
    def blocks_per_running_request(self) -> int:
        """Most state blocks one running request pins with no step in flight:
        ``2 + nspec`` in align mode (last state, running state, scratch), ``1 + nspec`` in NONE.
        Each step in flight adds one in align mode (DESIGN.md 5.1, the bound). The same for
        every ``decode_checkpoints`` policy: ``latest``'s spare replaces, near a boundary, the
        last state that ``every`` holds there, and is never required."""
        base = 2 if self.mode is MambaCacheMode.ALIGN else 1
        return base + self.num_speculative_blocks

    def max_memory_usage_bytes(self, max_model_len: int) -> int:
        return self.blocks_per_running_request * self.page_size_bytes


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """A KV-cache group: layers that share one spec and one block table per request.

    Raises:
        InvalidSpecError: `layer_names` is not a non-empty list (or tuple) of distinct strs (a
            bare str is refused: ``"abc"`` is not three layers), or the spec is not a
            :class:`KVCacheSpec`.
    """

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec

    def __post_init__(self) -> None:
        if not isinstance(self.kv_cache_spec, KVCacheSpec):
            raise InvalidSpecError(f"kv_cache_spec must be a KVCacheSpec, got {self.kv_cache_spec!r}")
        names = self.layer_names
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise InvalidSpecError(f"layer_names must be a list of strs, got {names!r}")
        if not names:
            raise InvalidSpecError("a KV-cache group needs at least one layer")
        if len(set(names)) != len(names):
            raise InvalidSpecError(f"a layer is named twice in one group: {names!r}")


@dataclass(frozen=True)
class KVCacheConfig:
    """All groups of a model over one pool of ``num_blocks`` blocks (block 0 is the null block).

    With `superblocks` (the ``decoupled`` layout, :mod:`mambakv.core.arena`) attention groups
    take pages from a page pool of ``num_blocks == superblocks.num_pages`` ids and Mamba groups
    take state slots from a slot pool of ``superblocks.num_superblocks`` ids, both carved from
    one byte budget; without it (``unified``, vLLM's layout) every group shares one pool.

    Raises:
        InvalidSpecError: fewer than 2 blocks, no group, a layer name in two groups, or
            `num_blocks` other than ``superblocks.num_pages``.
    """

    num_blocks: int
    kv_cache_groups: list[KVCacheGroupSpec]
    superblocks: SuperblockGeometry | None = None

    @property
    def layout(self) -> str:
        """``"decoupled"`` with superblocks, else ``"unified"``."""
        return "unified" if self.superblocks is None else "decoupled"

    def __post_init__(self) -> None:
        if not isinstance(self.num_blocks, int) or isinstance(self.num_blocks, bool) or self.num_blocks < 2:
            raise InvalidSpecError(f"num_blocks must be an int >= 2 (block 0 is null), got {self.num_blocks!r}")
        if not isinstance(self.kv_cache_groups, (list, tuple)):
            raise InvalidSpecError(f"kv_cache_groups must be a list of KVCacheGroupSpecs, got "
                                   f"{type(self.kv_cache_groups).__name__}")
        if not self.kv_cache_groups:
            raise InvalidSpecError("a KVCacheConfig needs at least one KV-cache group")
        seen: set[str] = set()
        for g in self.kv_cache_groups:
            if not isinstance(g, KVCacheGroupSpec):
                raise InvalidSpecError(f"kv_cache_groups must hold KVCacheGroupSpecs, got {g!r}")
            dup = seen.intersection(g.layer_names)
            if dup:
                raise InvalidSpecError(f"layer {sorted(dup)[0]!r} is in more than one KV-cache group")
            seen.update(g.layer_names)
        if self.superblocks is not None:
            if not isinstance(self.superblocks, SuperblockGeometry):
                raise InvalidSpecError(f"superblocks must be a SuperblockGeometry, got {self.superblocks!r}")
            if self.num_blocks != self.superblocks.num_pages:
                raise InvalidSpecError(f"num_blocks {self.num_blocks} must equal the page ids of the superblocks "
                                       f"({self.superblocks.num_pages})")
