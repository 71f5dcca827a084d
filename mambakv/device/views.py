"""Dtype views over Mamba state memory, and the device and dtype helpers the pools share.

A layer's states live in one uint8 row per block (the hybrid layout, DESIGN.md 7); state ``i``
is a dtype view at byte ``sum(bytes of states < i)`` of every row::

    row b:  | conv state (d_conv - 1) x conv_dim | ssm state heads x head_dim x d_state | pad |
            ^ byte 0                              ^ byte conv bytes

:func:`carve_state_views` makes those views, :func:`wide_rows` reinterprets rows as the widest
integer type that fits (copies cost per element), and :func:`torch_dtype`,
:func:`checked_device` and :func:`default_device` turn spec names and device arguments into torch
objects. Used by :mod:`mambakv.device.state_pool` and :mod:`mambakv.device.layout`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mambakv.core.errors import InvalidSpecError
from mambakv.core.spec import DTYPE_SIZES, MambaSpec

__all__ = ["carve_state_views", "checked_device", "default_device", "torch_dtype", "wide_rows"]


def torch_dtype(dtype: Any) -> torch.dtype:
    """The ``torch.dtype`` of a spec dtype name (``"bfloat16"`` -> ``torch.bfloat16``)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPE_SIZES:
        raise InvalidSpecError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_SIZES)}")
    found: torch.dtype = getattr(torch, dtype)  # every DTYPE_SIZES name is a torch dtype
    return found


def checked_device(device: Any) -> torch.device:
    """``torch.device(device)``, refusing one this torch build cannot allocate on.

    Raises:
        InvalidSpecError: not a device name, or CUDA on a build / machine without it."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidSpecError(f"bad device {device!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidSpecError(f"device {device!r}: this torch build has no CUDA device available")
    return dev


def default_device() -> torch.device:
    """CUDA when present, CPU otherwise."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def carve_state_views(rows: torch.Tensor, spec: MambaSpec) -> tuple[torch.Tensor, ...]:
    """Dtype views of one layer's states over its byte rows ``rows`` (uint8 ``[N, >= page]``).

    State i starts at byte ``sum(bytes of states < i)`` of every row.  Raises
    :class:`InvalidSpecError` when a state's offset or the row stride is not a multiple of its
    element size (the bytes could not be reinterpreted in place).
    """
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.stride(1) != 1:
        raise InvalidSpecError("raw rows must be a uint8 [num_blocks, bytes] tensor, rows dense")
    if rows.shape[1] < spec.raw_page_size_bytes:
        raise InvalidSpecError(f"row of {rows.shape[1]} B < state page {spec.raw_page_size_bytes} B")
    views, offset = [], 0
    for shape, name in zip(spec.shapes, spec.dtypes):
        size = DTYPE_SIZES[name]
        nbytes = math.prod(shape) * size
        if offset % size or rows.stride(0) % size or rows.storage_offset() % size:
            raise InvalidSpecError(f"state of dtype {name} at byte {offset} is misaligned")
        flat = rows[:, offset : offset + nbytes].view(torch_dtype(name))
        views.append(flat.view(rows.shape[0], *shape))
        offset += nbytes
    return tuple(views)


def wide_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, k]`` of the widest integer type its row layout allows (int64 when row
    bytes, row stride and offset are multiples of 8), else ``t`` itself.  Gather/scatter cost
    per element, so a copy of 8-byte elements runs several times faster than one of bytes."""
    try:
        flat = t.view(t.shape[0], -1).view(torch.uint8)
    except RuntimeError:
        return t
    for wide in (torch.int64, torch.int32, torch.int16):
        try:
            return flat.view(wide)
        except RuntimeError:
            continue
    return flat
