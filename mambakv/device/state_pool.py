"""Device tensors that hold Mamba states, and batched copies between them (DESIGN.md 7).

One :class:`MambaStatePool` serves one Mamba KV-cache group.  Per layer it holds
``len(spec.shapes)`` state tensors (state 0 = conv, state 1 = SSM, for the usual two), each of
shape ``[num_blocks, *spec.shapes[i]]`` and dtype ``spec.dtypes[i]``.  Row = block id::

    conv_state(layer)   [num_blocks, d_conv - 1, conv_dim]        row 0 = null, all zero
    ssm_state(layer)    [num_blocks, heads, head_dim, d_state]    row b = the state in block b

Memory layout: when the pool owns its memory (built alone) or is built over raw byte rows
(:meth:`MambaStatePool.from_raw`, what :mod:`mambakv.device.layout` does), every layer has one uint8
tensor ``[num_blocks, page_size_bytes]`` and its states are dtype views at consecutive byte
offsets of each row, exactly vLLM's hybrid layout.  A state copy then moves one contiguous byte
row per layer: two torch calls per layer, whatever the number of pairs.  Views given with
``views=`` (arbitrary tensors) are copied state tensor by state tensor instead.

Copy backends (:class:`CopyBackend`, keyword ``copy_backend``): ``torch`` (the default) gathers
the source rows into a scratch buffer and scatters them, so every byte moves twice; ``triton``
runs :class:`~mambakv.device.fused_copy.FusedRowCopy`, one launch for all pairs and all layers
that reads each source row once and writes each destination once (needs ``pip install
'mambakv[triton]'``; on CPU tensors it runs under Triton's interpreter, for tests); ``auto``
picks ``triton`` when it is installed and the pool is on CUDA, else ``torch``.  The plan rules
are checked once, on the host, before either backend writes anything.

Row 0 is the null block: it is never written (``copy_`` refuses it as a destination, ``zero_``
refuses it) and exported to kernels as ``-1`` (:func:`~mambakv.device.export.export_block_table`).
The byte-row views and dtype/device helpers are in :mod:`mambakv.device.views`; the layout and
plan checks in :mod:`mambakv.device.state_checks`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mambakv.core.errors import InvalidSpecError
from mambakv.core.spec import MambaSpec
from mambakv.device.backend import CopyBackend, resolve_backend
from mambakv.device.export import export_block_table, export_block_tables
from mambakv.device.state_checks import check_copy_plan, check_state_layout, check_zero_plan
from mambakv.device.views import carve_state_views as carve_state_views  # re-exported (explicit)
from mambakv.device.views import checked_device as checked_device
from mambakv.device.views import default_device as default_device
from mambakv.device.views import torch_dtype
from mambakv.device.views import wide_rows as _wide_rows

# CopyBackend, export_block_table(s) and the view helpers live in mambakv.device.backend /
# .export / .views; they stay
# importable from here for code written before the split (``__all__`` is unchanged).
__all__ = ["CopyBackend", "MambaStatePool", "export_block_table", "export_block_tables", "torch_dtype"]


class MambaStatePool:
    """State tensors of ``num_layers`` layers of one Mamba group, ``num_blocks`` rows each.

    Args:
        kv_cache_spec: the group's :class:`MambaSpec` (shapes and dtypes of one layer).
        num_layers: layers in the group (> 0).
        num_blocks: rows, i.e. blocks of the shared pool including the null block 0 (>= 2).
        device: defaults to CUDA when present, else CPU (or the device of ``views``).
        views: optional ``views[layer][state]`` tensors of shape ``[num_blocks, *shape]`` (e.g.
            views into shared raw memory); the pool then allocates nothing.
        copy_backend: a :class:`CopyBackend` or its value (``"torch"``, ``"triton"``,
            ``"auto"``); default ``"torch"``.  :attr:`copy_backend` tells the one chosen.

    Raises:
        InvalidSpecError: a non-positive count, views of the wrong number, shape, dtype or
            device, an unknown backend, or ``"triton"`` where it cannot run (triton not
            installed, a device other than CUDA/CPU, views whose rows are not dense).
    """

    def __init__(self, kv_cache_spec: MambaSpec, num_layers: int, num_blocks: int,
                 device: Any = None, *, views: Sequence[Sequence[torch.Tensor]] | None = None,
                 copy_backend: CopyBackend | str = CopyBackend.TORCH, fused_tile_bytes: int | None = None) -> None:
        if not isinstance(kv_cache_spec, MambaSpec):
            raise InvalidSpecError(f"kv_cache_spec must be a MambaSpec, got {kv_cache_spec!r}")
        if num_layers <= 0 or num_blocks < 2:
            raise InvalidSpecError(f"need num_layers > 0 and num_blocks >= 2, got "
                                   f"{num_layers}, {num_blocks}")
        self.kv_cache_spec = kv_cache_spec
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        # per layer: the state bytes of each row, as [N, k] wide ints (None: copy per state)
        self._rows: list[torch.Tensor] | None = None
        self._scratch: torch.Tensor | None = None
        #: row 0 aliases live memory (the decoupled layout): check_invariants does not check it
        self.null_row_aliased = False
        if views is None:
            self.device = checked_device(device) if device is not None else default_device()
            self._states = self._allocate()
        else:
            first = views[0][0] if views and views[0] else None
            self.device = torch.device(device) if device is not None else (
                first.device if first is not None else default_device())
            self._states = [tuple(layer) for layer in views]
        self._check_layout()
        self._fused: Any = None  # a FusedRowCopy when the backend is TRITON
        self._backend = CopyBackend.TORCH
        self._init_backend(copy_backend, fused_tile_bytes)

    @classmethod
    def from_raw(cls, kv_cache_spec: MambaSpec, raw: Sequence[torch.Tensor], *,
                 copy_backend: CopyBackend | str = CopyBackend.TORCH,
                 fused_tile_bytes: int | None = None, null_row_aliased: bool = False) -> MambaStatePool:
        """A pool over per-layer raw byte tensors ``raw[layer]`` (uint8 ``[num_blocks, >= page]``),
        as laid out by :class:`mambakv.device.layout.HybridLayout`; copies move whole byte rows
        (bytes ``[0, raw_page_size_bytes)`` of a row: the padding after the states is never
        written).  ``copy_backend`` as in the constructor; raises InvalidSpecError likewise.
        Rows may be strided wider than the page (:class:`mambakv.device.decoupled.DecoupledLayout`:
        one row per superblock); `null_row_aliased`: row 0 overlaps memory others write (the
        decoupled layout's slot 0 covers live attention pages), so ``check_invariants`` skips it."""
        if not raw:
            raise InvalidSpecError("from_raw needs at least one raw tensor")
        views = [carve_state_views(r, kv_cache_spec) for r in raw]
        pool = cls(kv_cache_spec, len(raw), raw[0].shape[0], raw[0].device, views=views)
        pool._rows = [_wide_rows(r[:, : kv_cache_spec.raw_page_size_bytes]) for r in raw]
        pool.null_row_aliased = null_row_aliased
        pool._init_backend(copy_backend, fused_tile_bytes)
        return pool

    def _init_backend(self, copy_backend: CopyBackend | str, tile_bytes: int | None = None) -> None:
        """Resolve ``copy_backend`` (:func:`~mambakv.device.backend.resolve_backend`) over the
        per-layer byte rows (or, without them, over every state tensor)."""
        targets = self._rows if self._rows is not None else [t for s in self._states for t in s]
        self._backend, self._fused = resolve_backend(copy_backend, self.device, targets, tile_bytes=tile_bytes)

    @property
    def fused_copy(self) -> Any:
        """The :class:`~mambakv.device.fused_copy.FusedRowCopy` of the TRITON backend (its
        element width, entries, kernel), or None on TORCH; read-only."""
        return self._fused

    @property
    def copy_backend(self) -> CopyBackend:
        """The backend ``copy_`` and ``zero_`` run on: TORCH or TRITON (AUTO resolved)."""
        return self._backend

    def _allocate(self) -> list[tuple[torch.Tensor, ...]]:
        spec, n = self.kv_cache_spec, self.num_blocks
        try:  # the hybrid layout: one byte row per layer and block, states carved from it
            rows = [torch.zeros(n, spec.page_size_bytes, dtype=torch.uint8, device=self.device)
                    for _ in range(self.num_layers)]
            states = [carve_state_views(r, spec) for r in rows]
        except InvalidSpecError:  # misaligned dtypes: one plain tensor per state
            return [tuple(torch.zeros(n, *s, dtype=torch_dtype(d), device=self.device)
                          for s, d in zip(spec.shapes, spec.dtypes))
                    for _ in range(self.num_layers)]
        self._rows = [_wide_rows(r[:, : spec.raw_page_size_bytes]) for r in rows]
        return states

    def _check_layout(self) -> None:
        check_state_layout(self._states, self.kv_cache_spec, self.num_layers, self.num_blocks, self.device)

    # ----------------------------------------------------------------- views for kernels
    @property
    def num_states(self) -> int:
        """States per layer (2 for Mamba1/Mamba2/GDN: conv, SSM)."""
        return len(self.kv_cache_spec.shapes)

    def _layer(self, layer: int, i: int | None = None) -> tuple[torch.Tensor, ...]:
        """The states of ``layer``; InvalidSpecError unless ``0 <= layer < num_layers`` and
        ``0 <= i < num_states`` (ints; no negative indexing)."""
        for what, v, n in (("layer", layer, self.num_layers), ("state", i, self.num_states)):
            if v is not None and (isinstance(v, bool) or not hasattr(v, "__index__") or not 0 <= v < n):
                raise InvalidSpecError(f"{what} index {v!r} out of range 0 .. {n - 1}")
        return self._states[layer]

    def state(self, layer: int, i: int) -> torch.Tensor:
        """State ``i`` of ``layer``: ``[num_blocks, *spec.shapes[i]]``, row = block id.
        Raises InvalidSpecError for an index out of range (as the accessors below)."""
        return self._layer(layer, i)[i]

    def conv_state(self, layer: int) -> torch.Tensor:
        """Conv state (state 0) of ``layer``: ``[num_blocks, d_conv - 1, conv_dim]``."""
        return self._layer(layer, 0)[0]

    def ssm_state(self, layer: int) -> torch.Tensor:
        """SSM state (state 1) of ``layer``, e.g. ``[num_blocks, heads, head_dim, d_state]``."""
        return self._layer(layer, 1)[1]

    def layer_states(self, layer: int) -> tuple[torch.Tensor, ...]:
        """All states of ``layer``, in spec order."""
        return self._layer(layer)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id holds in this group: ``num_layers x spec.page_size_bytes``
        (the padded page when the spec is padded to the attention page)."""
        return self.num_layers * self.kv_cache_spec.page_size_bytes

    def block_table_tensor(self, tables: Sequence[Sequence[int]], *,
                           width: int | None = None) -> torch.Tensor:
        """:func:`export_block_tables` on this pool's device (null -> -1)."""
        return export_block_tables(tables, width=width, device=self.device)

    # ----------------------------------------------------------------- operations
    def _index(self, ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True)

    def copy_(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy the state of block ``src`` into block ``dst`` for every pair, in every layer.

        TORCH backend: the pairs run as one gather/scatter (``dst_rows = src_rows``): a constant
        number of torch calls per layer, none per pair.  TRITON backend: one launch for all pairs
        and layers, each source row read once and each destination written once.  Bytes moved:
        ``len(pairs) x num_layers x spec.raw_page_size_bytes`` (read and written once each by
        TRITON, twice by TORCH).  Empty ``pairs`` is a no-op.  A pair ``(b, b)`` is allowed and
        does nothing.

        Raises:
            InvalidCopyPlanError (before anything is written): a non-int or out-of-range id, a
                destination 0 (the null block), a destination listed twice, or a source that is
                another pair's destination (a chain ``a -> b -> c`` must be composed by the
                caller into ``a -> c``; DESIGN.md 5.1 says the library's plans never chain), or
                with ``null_row_aliased`` (the decoupled layout) a source 0: that row holds pages.
        """
        if not pairs:
            return
        src, dst = check_copy_plan(pairs, self.num_blocks, null_row_aliased=self.null_row_aliased)
        if self._fused is not None:  # the plan is valid: all pairs may run concurrently
            moved = [(s, d) for s, d in zip(src, dst) if s != d]
            self._fused.copy_rows([s for s, _ in moved], [d for _, d in moved])
            return
        src_t, dst_t = self._index(src), self._index(dst)
        if self._rows is not None:
            like = self._rows[0]
            if self._scratch is None or self._scratch.shape[0] < len(src):
                self._scratch = like.new_empty(len(src), like.shape[1])
            buf = self._scratch[: len(src)]
            for rows in self._rows:  # per layer: one gather into scratch, one scatter
                torch.index_select(rows, 0, src_t, out=buf)
                rows.index_copy_(0, dst_t, buf)
            return
        for states in self._states:
            for t in states:
                rows = _wide_rows(t)
                rows.index_copy_(0, dst_t, rows.index_select(0, src_t))

    def zero_(self, block_ids: Sequence[int]) -> None:
        """Zero every state of the given blocks (duplicates allowed).

        Raises:
            InvalidCopyPlanError (before anything is written): a non-int or out-of-range id, or
                the null block 0 (it is zero already and never written).
        """
        ids = list(block_ids)
        if not ids:
            return
        check_zero_plan(ids, self.num_blocks)
        if self._fused is not None:
            self._fused.zero_rows(sorted(set(ids)))
            return
        idx = self._index(ids)
        # as integers: torch has no index_fill_ for float8 tensors
        targets = self._rows if self._rows is not None else [_wide_rows(t) for s in self._states for t in s]
        for t in targets:
            t.index_fill_(0, idx, 0)

    def check_invariants(self) -> None:
        """Assert shapes, dtypes and devices match the spec and row 0 (null) is all zero bytes
        (compared as bytes: torch counts no non-zeros of float8 tensors, and -0.0 is a write;
        not checked when ``null_row_aliased``)."""
        self._check_layout()
        if self.null_row_aliased:
            return
        for layer, states in enumerate(self._states):
            for i, t in enumerate(states):
                row = t[0].reshape(-1).view(torch.uint8)
                assert int(torch.count_nonzero(row)) == 0, f"layer {layer} state {i}: row 0 written"

    def __repr__(self) -> str:
        return (f"MambaStatePool(layers={self.num_layers}, blocks={self.num_blocks}, "
                f"shapes={self.kv_cache_spec.shapes}, dtypes={self.kv_cache_spec.dtypes}, "
                f"device={self.device}, copy_backend={self._backend.value})")
