"""The Triton kernel behind :mod:`mambakv.device.fused_copy` (imported only when it is used).

This module imports triton at the top; nothing imports it unless a fused copy is asked for, so
mambakv works without triton installed.  The kernel is built twice from one body:

* ``COMPILED``: a ``JITFunction`` (compiled for the GPU), for CUDA tensors;
* ``INTERPRETED``: Triton's interpreter, for CPU tensors (the only way Triton runs on a CPU).

Both are built directly rather than through ``@triton.jit``, whose choice follows
``TRITON_INTERPRET`` at decoration time: the table of raw addresses the kernel follows holds
device addresses for CUDA tensors, which the interpreter (it copies tensor arguments to the host)
could not follow, and host addresses for CPU tensors, which compiled GPU code could not.
The body calls only core builtins (``tl.full``, not the ``@jit``-defined ``tl.zeros``): Triton
makes its own library functions interpretable only when ``TRITON_INTERPRET=1`` was set before
it was imported, and the interpreted kernel must run whether or not it was.
"""

from __future__ import annotations

from typing import Any

import triton.language as tl
from triton.runtime.jit import JITFunction

__all__ = ["COMPILED", "INTERPRETED", "copy_rows", "triton_dtype"]

_ELEM = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


def triton_dtype(elem_size: int) -> Any:
    """The Triton integer type of ``elem_size`` bytes (1, 2, 4 or 8)."""
    return _ELEM[elem_size]


# Triton reads a kernel's annotations as its own types, so the runtime arguments carry none.
def copy_rows(table_ptr, idx_ptr, dst_offset, num_tiles,  # type: ignore[no-untyped-def]
               BLOCK: tl.constexpr, ELEM: tl.constexpr, VEC: tl.constexpr,
               ALIGN_BYTES: tl.constexpr, ZERO: tl.constexpr):
    """Program ``(pair * num_tiles + tile, entry)`` moves elements ``[tile * BLOCK, +BLOCK)`` of
    row ``dst`` of table entry ``entry`` (from row ``src`` of the same entry, or zeros).

    ``table_ptr``: int64 ``[entries, 3]``: (address of row 0 in bytes, row stride in elements,
    row length in elements), elements of type ``ELEM``.  ``idx_ptr``: int64 block ids, sources
    at ``idx_ptr[pair]``, destinations at ``idx_ptr[dst_offset + pair]``.  ``VEC``: the row length
    is a multiple of it; ``ALIGN_BYTES``: every row start is a multiple of it (the host checks
    both; they let the compiler issue 16-byte loads and stores).
    """
    pid = tl.program_id(0)
    pair = pid // num_tiles
    tile = pid - pair * num_tiles
    entry = tl.program_id(1)
    length = tl.multiple_of(tl.load(table_ptr + entry * 3 + 2), VEC)
    start = tile.to(tl.int64) * BLOCK
    if start < length:  # entries of different row lengths share the grid of the longest
        rows = tl.load(table_ptr + entry * 3).to(tl.pointer_type(ELEM))
        stride = tl.load(table_ptr + entry * 3 + 1)
        cols = start + tl.arange(0, BLOCK)
        mask = cols < length
        dst = tl.load(idx_ptr + dst_offset + pair)
        dst_ptrs = tl.multiple_of(rows + dst * stride + cols, [ALIGN_BYTES])
        if ZERO:
            tl.store(dst_ptrs, tl.full((BLOCK,), 0, ELEM), mask=mask)
        else:
            src = tl.load(idx_ptr + pair)
            src_ptrs = tl.multiple_of(rows + src * stride + cols, [ALIGN_BYTES])
            tl.store(dst_ptrs, tl.load(src_ptrs, mask=mask), mask=mask)


COMPILED: Any = JITFunction(copy_rows, do_not_specialize=["dst_offset", "num_tiles"])

try:  # the interpreter's class is not public API; without it CPU tensors cannot be fused
    from triton.runtime.interpreter import InterpretedFunction

    INTERPRETED: Any = InterpretedFunction(copy_rows)
except ImportError:  # pragma: no cover - depends on the triton version
    INTERPRETED = None
