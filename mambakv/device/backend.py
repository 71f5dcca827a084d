"""Which backend runs ``MambaStatePool.copy_`` and ``zero_``, and the fused copier it needs.

``torch`` is always there; ``triton`` (:class:`~mambakv.device.fused_copy.FusedRowCopy`) runs
every pair of every layer in one launch; ``auto`` takes ``triton`` only where it pays and can
run: triton installed, the pool on CUDA, rows fusable. :func:`resolve_backend` decides once, when
the pool is built (``MambaStatePool`` and ``MambaStatePool.from_raw``)::

    copy_backend   resolves to   when
    "torch"        TORCH         always (fused copier: None)
    "triton"       TRITON        CUDA, or CPU under Triton's interpreter; anything else raises
    "auto"         TRITON        triton installed, pool on CUDA, rows dense byte runs
    "auto"         TORCH         otherwise
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import torch

from mambakv.core.errors import InvalidSpecError

__all__ = ["CopyBackend", "resolve_backend"]


class CopyBackend(str, enum.Enum):
    """How :class:`MambaStatePool` runs ``copy_`` and ``zero_``.

    * ``TORCH``: per layer, ``index_select`` into a scratch buffer then ``index_copy_`` (or
      ``index_fill_``); always available.
    * ``TRITON``: one fused Triton launch for all pairs and layers (:mod:`mambakv.device.fused_copy`);
      CUDA, or CPU under Triton's interpreter.
    * ``AUTO``: ``TRITON`` when triton is installed, the pool is on CUDA and its rows can be
      fused (dense byte rows: always for pools mambakv allocates), else ``TORCH``.
    """

    TORCH = "torch"
    TRITON = "triton"
    AUTO = "auto"


def resolve_backend(copy_backend: CopyBackend | str, device: torch.device,
                    targets: Sequence[torch.Tensor], *, tile_bytes: int | None = None) -> tuple[CopyBackend, Any]:
    """``(backend, fused)``: the backend ``copy_backend`` resolves to on `device` (TORCH or
    TRITON, AUTO resolved) and, for TRITON, a ``FusedRowCopy`` whose address table covers
    `targets` (per-layer byte rows, or every state tensor), else None.

    Raises:
        InvalidSpecError: an unknown backend, or ``"triton"`` where it cannot run (triton not
            installed, a device other than CUDA/CPU, rows that are not dense).
    """
    from mambakv.device import fused_copy

    try:
        backend = CopyBackend(copy_backend)
    except ValueError:
        raise InvalidSpecError(f"copy_backend must be one of "
                               f"{[b.value for b in CopyBackend]}, got {copy_backend!r}") from None
    kw = {} if tile_bytes is None else {"tile_bytes": tile_bytes}
    if backend is CopyBackend.TRITON:
        return backend, fused_copy.FusedRowCopy(targets, **kw)
    if backend is CopyBackend.AUTO and device.type == "cuda" and fused_copy.triton_available():
        try:  # views whose rows are not dense byte runs stay on torch
            return CopyBackend.TRITON, fused_copy.FusedRowCopy(targets, **kw)
        except InvalidSpecError:
            pass
    return CopyBackend.TORCH, None
