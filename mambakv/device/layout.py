"""Hybrid memory layout: one pool of raw bytes shared by every KV-cache group (DESIGN.md 7).

All groups of a :class:`~mambakv.core.spec.KVCacheConfig` have the same page size (bytes per block
per layer) and at most ``group_size`` layers.  The layout allocates ``group_size`` raw uint8
tensors of ``[num_blocks, page_size_bytes]``; raw tensor i is shared by the i-th layer of every
group, each layer viewing it with its own shape.  Block b of any layer is row b of its raw
tensor, so a block id costs ``group_size x page_size_bytes`` whichever group owns it::

    raw[0]  row b: | group 0 layer 0 (attention KV of block b) |  <- when group 0 owns b
                   | group 1 layer 0 (conv | SSM | pad)         |  <- when group 1 owns b
    raw[1]  row b:   ... the 2nd layer of whichever group owns b ...

Views:

* attention layer (full or sliding window): ``[num_blocks, 2, block_size, num_kv_heads,
  head_size]`` (block-major, K then V, so one block's KV is one contiguous row);
* Mamba layer: one view per state ``[num_blocks, *shape]`` at consecutive byte offsets of the
  row (conv, then SSM, then padding up to the attention page), reinterpreted to the state dtype.

A group with fewer layers than ``group_size`` (vLLM's rule when layer counts differ by less than
1.5x) uses raw tensors ``0 .. len(layers) - 1``.
"""

from __future__ import annotations

from typing import Any

import torch

from mambakv.core.errors import InvalidSpecError
from mambakv.core.spec import DTYPE_SIZES, AttentionSpec, KVCacheConfig, MambaSpec
from mambakv.device.layout_views import LayoutViews
from mambakv.device.state_pool import CopyBackend, MambaStatePool
from mambakv.device.views import carve_state_views, checked_device, default_device, torch_dtype

__all__ = ["HybridLayout", "check_uniform_page_size"]


def check_uniform_page_size(config: KVCacheConfig) -> tuple[int, int]:
    """``(group_size, page_size_bytes)`` of ``config``.

    Raises:
        InvalidSpecError: groups with different page sizes, a layer named twice, or a spec
            that is neither attention nor Mamba.
    """
    pages = {g.kv_cache_spec.page_size_bytes for g in config.kv_cache_groups}
    if len(pages) != 1:
        raise InvalidSpecError(f"groups must share one page size for the hybrid layout, got "
                               f"{sorted(pages)} bytes")
    names = [n for g in config.kv_cache_groups for n in g.layer_names]
    if len(set(names)) != len(names):
        raise InvalidSpecError("a layer name appears in more than one group")
    for g in config.kv_cache_groups:
        if not isinstance(g.kv_cache_spec, (AttentionSpec, MambaSpec)):
            raise InvalidSpecError(f"no layout for spec {type(g.kv_cache_spec).__name__}")
    return max(len(g.layer_names) for g in config.kv_cache_groups), pages.pop()


class HybridLayout(LayoutViews):
    """The raw tensors of a hybrid config and every layer's view into them.

    Args:
        kv_cache_config: groups with one common page size (see :func:`check_uniform_page_size`).
        device: defaults to CUDA when present, else CPU.
        copy_backend: the :class:`~mambakv.device.state_pool.CopyBackend` of the Mamba groups'
            state pools (default ``"torch"``; ``"auto"`` = Triton when installed and on CUDA).

    Memory: ``group_size x num_blocks x page_size_bytes`` bytes, zero-filled (so the null
    block's row reads as zero in every view).

    Attributes:
        config, device, copy_backend: what the layout was built with.
        group_size: raw tensors (the most layers of any group); page_size_bytes: bytes of one
            row (a block of one layer); num_blocks: rows (``config.num_blocks``).
        raw: the ``group_size`` raw uint8 tensors, ``[num_blocks, page_size_bytes]``.
        bytes_per_block: bytes one block id costs, ``group_size x page_size_bytes``
            (13,369,344 on Qwen3-Next; ``PagePlan.bytes_per_block``, ``HostTierSpec(block_bytes=)``).
        total_bytes: ``num_blocks x bytes_per_block``.

    Methods (:class:`~mambakv.device.layout_views.LayoutViews`): ``layer_slot(name)`` ->
    ``(group id, raw tensor index)``; ``kv_cache(name)`` -> an attention layer's ``[num_blocks,
    2, block_size, num_kv_heads, head_size]`` view (K then V); ``mamba_states(name)`` -> a Mamba
    layer's views, one per state, ``[num_blocks, *shape]``; ``state_pool(gid)`` -> the
    :class:`MambaStatePool` of Mamba group ``gid`` over these rows; ``mamba_group_ids()``.
    An unknown layer name, or the wrong view for a layer's kind, raises InvalidSpecError.
    """

    def __init__(self, kv_cache_config: KVCacheConfig, device: Any = None, *,
                 copy_backend: CopyBackend | str = CopyBackend.TORCH) -> None:
        self.config = kv_cache_config
        try:
            self.copy_backend = CopyBackend(copy_backend)
        except ValueError:
            raise InvalidSpecError(f"unknown copy_backend {copy_backend!r}") from None
        self.group_size, self.page_size_bytes = check_uniform_page_size(kv_cache_config)
        self.num_blocks = kv_cache_config.num_blocks
        self.device = checked_device(device) if device is not None else default_device()
        self.raw: tuple[torch.Tensor, ...] = tuple(
            torch.zeros(self.num_blocks, self.page_size_bytes, dtype=torch.uint8,
                        device=self.device)
            for _ in range(self.group_size))
        self._slot: dict[str, tuple[int, int]] = {
            name: (gid, i)
            for gid, g in enumerate(kv_cache_config.kv_cache_groups)
            for i, name in enumerate(g.layer_names)}
        self._views: dict[str, torch.Tensor | tuple[torch.Tensor, ...]] = {}
        self._pools: dict[int, MambaStatePool] = {}
        for name, (gid, i) in self._slot.items():
            spec = kv_cache_config.kv_cache_groups[gid].kv_cache_spec
            if isinstance(spec, MambaSpec):
                self._views[name] = carve_state_views(self.raw[i], spec)
            else:
                assert isinstance(spec, AttentionSpec)
                self._views[name] = self._kv_view(self.raw[i], spec)

    def _kv_view(self, rows: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
        if self.page_size_bytes % DTYPE_SIZES[spec.dtype]:
            raise InvalidSpecError(f"page {self.page_size_bytes} B is not a multiple of "
                                   f"{spec.dtype}")
        return rows.view(torch_dtype(spec.dtype)).view(
            self.num_blocks, 2, spec.block_size, spec.num_kv_heads, spec.head_size)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id costs: ``group_size x page_size_bytes``."""
        return self.group_size * self.page_size_bytes

    @property
    def total_bytes(self) -> int:
        """Bytes of all raw tensors: ``num_blocks x bytes_per_block``."""
        return self.num_blocks * self.bytes_per_block

    def __repr__(self) -> str:
        return (f"HybridLayout(groups={len(self.config.kv_cache_groups)}, "
                f"group_size={self.group_size}, page={self.page_size_bytes} B, "
                f"blocks={self.num_blocks}, device={self.device})")
