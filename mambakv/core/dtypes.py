"""Dtype names a spec accepts and their sizes in bytes (no torch: a ``torch.dtype`` is turned
into its name)."""

from __future__ import annotations

from typing import Any

from mambakv.core.errors import InvalidSpecError

#: Bytes per element of every dtype name a spec accepts.
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
}


def dtype_name(dtype: Any) -> str:
    """Normalise a dtype (a name or a ``torch.dtype``) to its name; raise on unknown ones."""
    name = str(dtype)
    if name.startswith("torch."):
        name = name[len("torch.") :]
    if name not in DTYPE_SIZES:
        raise InvalidSpecError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_SIZES)}")
    return name


def dtype_size(dtype: Any) -> int:
    """Bytes per element of `dtype` (a name or a ``torch.dtype``)."""
    return DTYPE_SIZES[dtype_name(dtype)]
