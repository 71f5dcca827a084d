"""Block tables as tensors for kernels: the null block (id 0) becomes ``-1``.

Kernels index state rows by block id and skip ``-1``; padding of a ragged batch is ``-1`` too::

    tables [[0, 0, 7], [3]]  ->  [[-1, -1,  7],
                                  [ 3, -1, -1]]      (export_block_tables, width 3)

``MambaStatePool.block_table_tensor`` is :func:`export_block_tables` on the pool's device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["export_block_table", "export_block_tables"]


def export_block_table(block_ids: Sequence[int], *, device: Any = None,
                       dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """A block table as a 1-D tensor for kernels: the null block (0) becomes ``-1``.

    ``[0, 0, 7, 9]`` -> ``tensor([-1, -1, 7, 9])``.  ``device`` defaults to CPU.
    """
    t = torch.tensor(list(block_ids), dtype=torch.int64)
    t = torch.where(t == 0, torch.full_like(t, -1), t)
    return t.to(device=device or "cpu", dtype=dtype)


def export_block_tables(tables: Sequence[Sequence[int]], *, width: int | None = None,
                        device: Any = None, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Several block tables as a ``[len(tables), width]`` tensor, null and padding = ``-1``.

    ``width`` defaults to the longest table; a longer table raises ``ValueError``.
    """
    width = max((len(t) for t in tables), default=0) if width is None else width
    out = torch.full((len(tables), width), -1, dtype=torch.int64)
    for r, table in enumerate(tables):  # one row per request, not per pair
        if len(table) > width:
            raise ValueError(f"table {r} has {len(table)} entries > width {width}")
        if table:
            out[r, : len(table)] = torch.tensor(list(table), dtype=torch.int64)
    out = torch.where(out == 0, torch.full_like(out, -1), out)
    return out.to(device=device or "cpu", dtype=dtype)
