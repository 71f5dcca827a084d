"""Host-side checks of :class:`~mambakv.device.state_pool.MambaStatePool`: its state tensors
against the spec, and the copy / zero plans, validated before anything is written."""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral

import torch

from mambakv.core.errors import InvalidCopyPlanError, InvalidSpecError
from mambakv.core.spec import KVCacheConfig, MambaSpec
from mambakv.device.views import torch_dtype

__all__ = ["check_block_ids", "check_copy_plan", "check_state_layout", "check_zero_plan", "mamba_group"]


def mamba_group(config: KVCacheConfig, group_id: int) -> tuple[MambaSpec, int]:
    """``(spec, number of layers)`` of Mamba group `group_id` of `config` (a layout's
    ``state_pool``). Raises InvalidSpecError for another id or a group of another kind."""
    groups = config.kv_cache_groups
    if not 0 <= group_id < len(groups):
        raise InvalidSpecError(f"no group {group_id}; config has {len(groups)}")
    spec = groups[group_id].kv_cache_spec
    if not isinstance(spec, MambaSpec):
        raise InvalidSpecError(f"group {group_id} is not a Mamba group")
    return spec, len(groups[group_id].layer_names)


def check_state_layout(states: Sequence[Sequence[torch.Tensor]], spec: MambaSpec, num_layers: int,
                       num_blocks: int, device: torch.device) -> None:
    """Raise InvalidSpecError unless ``states[layer][i]`` has shape ``[num_blocks, *spec.shapes[i]]``,
    dtype ``spec.dtypes[i]`` and `device`'s type, for `num_layers` layers."""
    if len(states) != num_layers:
        raise InvalidSpecError(f"{len(states)} layers of views, expected {num_layers}")
    for layer, layer_states in enumerate(states):
        if len(layer_states) != len(spec.shapes):
            raise InvalidSpecError(f"layer {layer}: {len(layer_states)} states, expected "
                                   f"{len(spec.shapes)}")
        for i, (t, shape, name) in enumerate(zip(layer_states, spec.shapes, spec.dtypes)):
            if tuple(t.shape) != (num_blocks, *shape) or t.dtype != torch_dtype(name):
                raise InvalidSpecError(
                    f"layer {layer} state {i}: {tuple(t.shape)} {t.dtype}, expected "
                    f"{(num_blocks, *shape)} {name}")
            if t.device.type != device.type:
                raise InvalidSpecError(f"layer {layer} state {i} on {t.device}, pool on "
                                       f"{device}")


def check_block_ids(ids: Sequence[int], num_blocks: int, what: str) -> None:
    """Raise InvalidCopyPlanError unless every id is an int in ``[0, num_blocks)``."""
    if not all(isinstance(b, Integral) and not isinstance(b, bool) for b in ids):
        raise InvalidCopyPlanError(f"{what}: block ids must be ints, got {list(ids)!r}")
    if ids and (min(ids) < 0 or max(ids) >= num_blocks):
        raise InvalidCopyPlanError(f"{what}: block id out of range [0, {num_blocks}): "
                                   f"{sorted(ids)}")


def check_copy_plan(pairs: Sequence[tuple[int, int]], num_blocks: int, *,
                    null_row_aliased: bool = False) -> tuple[list[int], list[int]]:
    """The sources and destinations of non-empty `pairs`; raises InvalidCopyPlanError for the
    plans ``MambaStatePool.copy_`` refuses (see there)."""
    try:
        src, dst = (list(x) for x in zip(*pairs, strict=True))
    except (TypeError, ValueError):
        raise InvalidCopyPlanError(f"pairs must be (src, dst) tuples, got {pairs!r}") from None
    if len(src) != len(pairs):
        raise InvalidCopyPlanError(f"pairs must be (src, dst) tuples, got {pairs!r}")
    check_block_ids(src + dst, num_blocks, "copy_")
    dst_set = set(dst)
    if 0 in dst_set:
        raise InvalidCopyPlanError(f"copy_ would write the null block 0: {list(pairs)}")
    if null_row_aliased and 0 in src:  # decoupled: slot 0's row is superblock 0's live pages
        raise InvalidCopyPlanError(f"copy_ would read the null slot 0 (its row holds attention pages): {list(pairs)}")
    if len(dst_set) != len(dst):
        raise InvalidCopyPlanError(f"copy_ writes a block twice: {list(pairs)}")
    if any(s != d and s in dst_set for s, d in zip(src, dst)):
        raise InvalidCopyPlanError(f"copy_ reads a block another pair writes: {list(pairs)}")
    return src, dst


def check_zero_plan(ids: Sequence[int], num_blocks: int) -> None:
    """Raise InvalidCopyPlanError for the non-empty `ids` ``MambaStatePool.zero_`` refuses."""
    check_block_ids(ids, num_blocks, "zero_")
    if 0 in ids:
        raise InvalidCopyPlanError("zero_ would write the null block 0")
