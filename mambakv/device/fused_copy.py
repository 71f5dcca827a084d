"""Fused state copies: one Triton launch moves every (src, dst) row of every layer of a group.

The torch path of :meth:`MambaStatePool.copy_ <mambakv.device.state_pool.MambaStatePool.copy_>`
is, per layer, a gather of the source rows into a scratch buffer and a scatter of the buffer into
the destination rows: every byte is read and written twice, and there are ``2 x layers`` kernel
launches.  :class:`FusedRowCopy` reads each source row once and writes each destination row once,
in one launch for all pairs and all layers::

    table (one entry per tensor, e.g. per layer's raw byte rows):
        entry 0: base 0x7f..000, stride 1,114,112 B, length 1,097,728 B   <- layer 0
        entry 1: base 0x7f..400, stride 1,114,112 B, length 1,097,728 B   <- layer 1
    grid: (pairs x tiles of the longest row, entries)
        program (p * tiles + t, e): bytes [t * tile, (t + 1) * tile) of row dst[p] of entry e
                                    <- the same bytes of row src[p]

The table holds raw addresses, so the tensors may be separate allocations (one raw tensor per
layer, as :class:`~mambakv.device.layout.HybridLayout` has) and only rows of the listed block
ids are touched: in the hybrid layout's shared raw tensors, a copy in one group never writes a
row another group owns, nor the padding after a state page.

Element type: the widest integer type (up to 8 bytes) that divides every row start, row stride
and row length in bytes; when all of them are multiples of 16 bytes the kernel is told so
(``VEC``/``ALIGN_BYTES``), which lets the compiler issue 16-byte loads and stores.

Triton is an optional extra (``pip install 'mambakv[triton]'``): this module imports it only when
a :class:`FusedRowCopy` is built.  CUDA tensors run the compiled kernel; CPU tensors run the same
kernel under Triton's interpreter (correct, but a Python loop over programs: for tests, not for
speed).  ``TRITON_INTERPRET`` does not change this choice (see ``_fused_copy_kernel``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Sequence
from typing import Any

import torch

from mambakv.core.errors import InvalidSpecError

__all__ = ["MAX_GRID_X", "TILE_BYTES", "FusedRowCopy", "triton_available"]

TILE_BYTES = 16384
"""Bytes one program moves at most (a power of two); with 4 warps, 128 B per thread."""

NUM_WARPS = 4

MAX_GRID_X = 2**31 - 1
"""CUDA's limit on grid dimension x (the default ``FusedRowCopy.max_grid_x``)."""


@functools.cache
def triton_available() -> bool:
    """Whether the ``triton`` package can be imported (checked once, without importing it)."""
    return importlib.util.find_spec("triton") is not None


def _kernel_module() -> Any:
    if not triton_available():
        raise InvalidSpecError("the fused copy needs triton: pip install 'mambakv[triton]'")
    from mambakv.device import _fused_copy_kernel

    return _fused_copy_kernel


def _alignment(*values: int) -> int:
    """The largest power of two <= 16 that divides every value (0 divides nothing away)."""
    a = 16
    for v in values:
        while v % a:
            a //= 2
    return a


class FusedRowCopy:
    """Copies or zeroes whole rows of several tensors with one Triton launch per call.

    Args:
        tensors: ``[num_rows, ...]`` tensors on one device (CUDA, or CPU for the interpreter)
            whose rows are each one dense run of bytes (``t[0]`` contiguous, rows apart by
            ``t.stride(0)`` elements, not overlapping).  Row ``b`` of every tensor is block
            ``b``.  The tensors must not share bytes with each other (layers of a pool never do).
        tile_bytes: bytes one program moves (a power of two >= 16; default :data:`TILE_BYTES`).
        num_warps: warps per program on the GPU, at most (fewer for short rows, so that every
            thread moves at least one 16-byte vector; ignored by the interpreter).

    Raises:
        InvalidSpecError: triton is not installed, no tensors, tensors on different devices or
            of different row counts, rows that are not dense or overlap, a device other than
            CUDA or CPU, or CPU tensors without Triton's interpreter.

    The address table is built once here: the tensors must stay alive and in place (views into
    them may be used freely).
    """

    def __init__(self, tensors: Sequence[torch.Tensor], *, tile_bytes: int = TILE_BYTES,
                 num_warps: int = NUM_WARPS) -> None:
        if not tensors:
            raise InvalidSpecError("FusedRowCopy needs at least one tensor")
        if tile_bytes < 16 or tile_bytes & (tile_bytes - 1):
            raise InvalidSpecError(f"tile_bytes must be a power of two >= 16, got {tile_bytes}")
        device = tensors[0].device
        num_rows = tensors[0].shape[0] if tensors[0].dim() else 0
        entries: list[tuple[int, int, int]] = []  # (address, stride, length) in bytes
        for i, t in enumerate(tensors):
            if t.device != device or t.dim() < 1 or t.shape[0] != num_rows:
                raise InvalidSpecError(f"tensor {i}: {tuple(t.shape)} on {t.device}; expected "
                                       f"{num_rows} rows on {device}")
            size = t.element_size()
            row = t[0].numel() * size
            stride = t.stride(0) * size
            if not t[0].is_contiguous() or (num_rows > 1 and stride < row):
                raise InvalidSpecError(f"tensor {i}: rows are not dense, non-overlapping byte "
                                       f"runs (strides {t.stride()})")
            entries.append((t.data_ptr(), stride, row))
        if device.type not in ("cuda", "cpu"):
            raise InvalidSpecError(f"the fused copy runs on CUDA (or CPU, interpreted), not {device}")
        mod = _kernel_module()
        #: the launch target, ``kernel[grid](...)``: Triton's compiled kernel on CUDA, the
        #: interpreter on CPU; replaceable (e.g. by a compile-only stand-in for offline checks)
        self.kernel: Any = mod.COMPILED if device.type == "cuda" else mod.INTERPRETED
        if self.kernel is None:
            raise InvalidSpecError("this triton has no interpreter: the fused copy cannot run "
                                   "on CPU tensors")
        align = _alignment(*(v for e in entries for v in e))
        self.elem_size = min(align, 8)
        """Bytes per element the kernel moves (1, 2, 4 or 8)."""
        self.vec = align // self.elem_size  # 2 when everything is 16-byte aligned, else 1
        self.device = device
        #: programs one launch may have along x; a larger plan launches in chunks of pairs
        self.max_grid_x = MAX_GRID_X
        self._tensors = tuple(tensors)  # the table holds their addresses: keep them alive
        self.num_rows = num_rows
        self.row_lengths = tuple(e[2] for e in entries)
        """Bytes per row of each tensor, in table order."""
        self._elem = mod.triton_dtype(self.elem_size)
        self._align_bytes = align if self.vec > 1 else self.elem_size
        e = self.elem_size
        self._table = torch.tensor([(a, s // e, n // e) for a, s, n in entries],
                                   dtype=torch.int64).to(device)
        longest = max(self.row_lengths) // e
        block = min(tile_bytes // e, 1 << max(longest - 1, 0).bit_length())
        # at least one 16-byte access (or one element) per thread of a warp: a masked tail is
        # cheaper than idle threads, and a thread with under VEC elements cannot vectorise
        self._block = max(block, 32 * self.vec)
        self._num_warps = max(1, min(num_warps, self._block // (32 * self.vec)))
        self._num_tiles = -(-longest // self._block) if longest else 0

    @property
    def num_warps(self) -> int:
        """Warps per program of every launch."""
        return self._num_warps

    @property
    def num_entries(self) -> int:
        """Tensors in the table (one program column each)."""
        return len(self.row_lengths)

    @property
    def bytes_per_row_set(self) -> int:
        """Bytes one block id has across all tensors: ``sum(row_lengths)``."""
        return sum(self.row_lengths)

    def _launch(self, ids: list[int], num_pairs: int, zero: bool) -> None:
        if not num_pairs or not self._num_tiles:
            return
        idx = torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True)
        chunk = max(1, self.max_grid_x // self._num_tiles)  # pairs per launch (one launch in practice)
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            for start in range(0, num_pairs, chunk):  # Triton launches on the current device
                grid = (min(chunk, num_pairs - start) * self._num_tiles, self.num_entries)
                self.kernel[grid](self._table, idx[start:],
                                   0 if zero else num_pairs, self._num_tiles,
                                   BLOCK=self._block, ELEM=self._elem, VEC=self.vec,
                                   ALIGN_BYTES=self._align_bytes, ZERO=zero,
                                   num_warps=self._num_warps)

    def copy_rows(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Row ``dst[k]`` <- row ``src[k]`` in every tensor, one launch.

        Unchecked (the caller validates, as :meth:`MambaStatePool.copy_` does): ids must lie in
        ``[0, num_rows)``, destinations must be distinct, and no source may be another pair's
        destination; all pairs run concurrently, so any order-dependent plan is undefined.
        """
        self._launch([*src, *dst], len(dst), zero=False)

    def zero_rows(self, dst: Sequence[int]) -> None:
        """Zero rows ``dst`` (distinct ids in ``[0, num_rows)``, unchecked) of every tensor."""
        self._launch(list(dst), len(dst), zero=True)

    def __repr__(self) -> str:
        return (f"FusedRowCopy(entries={self.num_entries}, rows={self.num_rows}, "
                f"elem={self.elem_size} B x {self.vec}, block={self._block}, "
                f"tiles={self._num_tiles}, warps={self._num_warps}, device={self.device})")
