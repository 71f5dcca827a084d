"""Decoupled memory layout: attention pages and Mamba state slots over one byte budget (issue 14).

The device side of :mod:`mambakv.core.arena`. A config with ``superblocks`` (a
:class:`~mambakv.core.arena.SuperblockGeometry`: ``num_superblocks`` superblocks of ``k`` pages)
gets ``group_size`` raw uint8 tensors of ``[num_superblocks, superblock_bytes_per_layer]``
(``superblock_bytes_per_layer = superblock_bytes // group_size``); raw tensor i is shared by the
i-th layer of every group, as in :class:`~mambakv.device.layout.HybridLayout`. One raw tensor,
superblock ``sb`` (``P = page_bytes_per_layer``, ``S = superblock_bytes_per_layer = k x P``)::

    byte sb x S                                                            byte (sb + 1) x S
    | page sb*k | page sb*k+1 | ...                          | page sb*k+k-1 |   kind PAGES
    | slot sb: conv state | SSM state                          | idle tail   |   kind SLOT

Views (all alias the raw bytes; a superblock is PAGES or SLOT, never both, so a live page and a
live slot never share a byte):

* attention layer: ``[num_pages, 2, page_tokens, num_kv_heads, head_size]``; page ``p`` is the
  dense run of bytes ``[p x P, (p + 1) x P)`` (block-major, K then V);
* Mamba layer: one view per state ``[num_superblocks, *shape]``, row stride ``S`` bytes; slot
  ``s`` starts at byte ``s x S`` (conv, then SSM, consecutive, reinterpreted to their dtypes).

Page 0 and slot 0 are null and never written. Slot 0's row covers pages ``0 .. k - 1`` of
superblock 0 (always PAGES), so only the null page's bytes stay zero: the state pools are built
with ``null_row_aliased=True`` (their ``check_invariants`` skips row 0) and
:meth:`DecoupledLayout.check_invariants` checks the null page instead.
"""

from __future__ import annotations

from typing import Any

import torch

from mambakv.core.errors import InvalidSpecError
from mambakv.core.spec import DTYPE_SIZES, AttentionSpec, KVCacheConfig, MambaSpec
from mambakv.device.layout_views import LayoutViews
from mambakv.device.state_pool import CopyBackend, MambaStatePool
from mambakv.device.views import carve_state_views, checked_device, default_device, torch_dtype

__all__ = ["DecoupledLayout"]


class DecoupledLayout(LayoutViews):
    """The raw tensors of a decoupled config and every layer's view into them (rows: page ids
    ``[num_pages, 2, page_tokens, heads, head_size]`` for attention layers, slot ids
    ``[num_superblocks, *shape]`` with a superblock's stride for Mamba layers).

    Args:
        kv_cache_config: a config with ``superblocks`` (``build_kv_cache_config(...,
            layout="decoupled")``).
        device: defaults to CUDA when present, else CPU.
        copy_backend: the state pools' :class:`CopyBackend` (default ``"torch"``).

    Memory: ``group_size x num_superblocks x superblock_bytes_per_layer`` bytes
    (``geometry.total_bytes``), zero-filled.

    Raises:
        InvalidSpecError: no superblocks, a layer named twice, a spec that is neither attention
            nor Mamba, an attention page other than ``page_bytes // group_size``, a state that
            does not fit ``state_bytes // group_size``, or a dtype the bytes cannot be
            reinterpreted to at its offset.
    """

    _null_row_aliased = True  # slot 0's row is superblock 0, which holds pages

    def __init__(self, kv_cache_config: KVCacheConfig, device: Any = None, *,
                 copy_backend: CopyBackend | str = CopyBackend.TORCH) -> None:
        geometry = kv_cache_config.superblocks
        if geometry is None:
            raise InvalidSpecError("DecoupledLayout needs a config with superblocks (layout='decoupled'); "
                                   "use HybridLayout for the unified layout")
        self.config = kv_cache_config
        self.geometry = geometry
        try:
            self.copy_backend = CopyBackend(copy_backend)
        except ValueError:
            raise InvalidSpecError(f"unknown copy_backend {copy_backend!r}") from None
        groups = kv_cache_config.kv_cache_groups
        names = [n for g in groups for n in g.layer_names]
        if len(set(names)) != len(names):
            raise InvalidSpecError("a layer name appears in more than one group")
        self.group_size = max(len(g.layer_names) for g in groups)
        if geometry.page_bytes % self.group_size:
            raise InvalidSpecError(f"page of {geometry.page_bytes} B does not split into {self.group_size} layers")
        #: bytes of one page id in one layer (``P``)
        self.page_bytes_per_layer = geometry.page_bytes // self.group_size
        #: bytes of one superblock in one raw tensor (``S = k x P``): the slot views' row stride
        self.superblock_bytes_per_layer = self.page_bytes_per_layer * geometry.pages_per_superblock
        self.num_pages = geometry.num_pages
        self.num_slots = geometry.num_superblocks
        for g in groups:
            spec = g.kv_cache_spec
            if isinstance(spec, AttentionSpec):
                if spec.page_size_bytes != self.page_bytes_per_layer:
                    raise InvalidSpecError(f"attention page {spec.page_size_bytes} B per layer != the geometry's "
                                           f"{self.page_bytes_per_layer} B")
                if self.page_bytes_per_layer % DTYPE_SIZES[spec.dtype]:
                    raise InvalidSpecError(f"page {self.page_bytes_per_layer} B is not a multiple of {spec.dtype}")
            elif isinstance(spec, MambaSpec):
                if spec.raw_page_size_bytes > geometry.state_bytes // self.group_size:
                    raise InvalidSpecError(f"a {spec.raw_page_size_bytes} B state per layer does not fit the "
                                           f"slot's {geometry.state_bytes // self.group_size} B")
            else:
                raise InvalidSpecError(f"no layout for spec {type(spec).__name__}")
        self.device = checked_device(device) if device is not None else default_device()
        self.raw: tuple[torch.Tensor, ...] = tuple(
            torch.zeros(self.num_slots, self.superblock_bytes_per_layer, dtype=torch.uint8, device=self.device)
            for _ in range(self.group_size))
        self._slot: dict[str, tuple[int, int]] = {
            name: (gid, i) for gid, g in enumerate(groups) for i, name in enumerate(g.layer_names)}
        self._views: dict[str, torch.Tensor | tuple[torch.Tensor, ...]] = {}
        self._pools: dict[int, MambaStatePool] = {}
        for name, (gid, i) in self._slot.items():
            spec = groups[gid].kv_cache_spec
            if isinstance(spec, MambaSpec):
                # rows of S bytes, one per superblock: slot s = row s (strided over the pages' bytes)
                self._views[name] = carve_state_views(self.raw[i], spec)
            else:
                assert isinstance(spec, AttentionSpec)
                self._views[name] = self.raw[i].view(-1).view(torch_dtype(spec.dtype)).view(
                    self.num_pages, 2, spec.block_size, spec.num_kv_heads, spec.head_size)

    # ------------------------------------------------------------------ queries
    @property
    def total_bytes(self) -> int:
        """Bytes of all raw tensors (``geometry.total_bytes``)."""
        return self.group_size * self.num_slots * self.superblock_bytes_per_layer

    def _spec(self, layer_name: str) -> Any:
        return self.config.kv_cache_groups[self.layer_slot(layer_name)[0]].kv_cache_spec

    def byte_range(self, layer_name: str, block_id: int) -> tuple[int, int, int]:
        """``(raw tensor index, byte offset, byte length)`` of page id `block_id` (attention
        layer) or slot id `block_id` (Mamba layer: the states' bytes, the idle tail excluded)
        in ``raw[index].view(-1)``."""
        _, i = self.layer_slot(layer_name)
        spec = self._spec(layer_name)
        if isinstance(spec, MambaSpec):
            n, stride, length = self.num_slots, self.superblock_bytes_per_layer, spec.raw_page_size_bytes
        else:
            n, stride, length = self.num_pages, self.page_bytes_per_layer, self.page_bytes_per_layer
        if isinstance(block_id, bool) or not isinstance(block_id, int) or not 0 <= block_id < n:
            raise InvalidSpecError(f"{layer_name!r}: id {block_id!r} out of range 0 .. {n - 1}")
        return i, block_id * stride, length

    def superblock_of(self, layer_name: str, block_id: int) -> int:
        """The superblock page id / slot id `block_id` of `layer_name` lies in."""
        return self.byte_range(layer_name, block_id)[1] // self.superblock_bytes_per_layer

    def check_invariants(self) -> None:
        """Assert the null page (page 0: bytes ``[0, P)`` of every raw tensor) is all zero."""
        for i, r in enumerate(self.raw):
            assert int(torch.count_nonzero(r.view(-1)[: self.page_bytes_per_layer])) == 0, \
                f"raw tensor {i}: the null page was written"

    def __repr__(self) -> str:
        g = self.geometry
        return (f"DecoupledLayout(groups={len(self.config.kv_cache_groups)}, group_size={self.group_size}, "
                f"superblocks={g.num_superblocks} x {g.pages_per_superblock} pages of "
                f"{self.page_bytes_per_layer} B per layer, device={self.device})")
