"""What the two device layouts (:class:`~mambakv.device.layout.HybridLayout`, unified, and
:class:`~mambakv.device.decoupled.DecoupledLayout`) hand a kernel in the same way: a layer's
place, its KV or state views, and a Mamba group's :class:`MambaStatePool` over them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mambakv.core.errors import InvalidSpecError
from mambakv.core.spec import KVCacheConfig, MambaSpec
from mambakv.device.state_checks import mamba_group
from mambakv.device.state_pool import MambaStatePool

__all__ = ["LayoutViews"]


class LayoutViews:
    """Mixed into both layouts, which set every attribute declared here (``_views``: layer name
    -> its KV tensor or its tuple of state views; rows are block ids unified, page ids / slot
    ids decoupled)."""

    config: KVCacheConfig
    raw: Sequence[torch.Tensor]
    copy_backend: Any
    _slot: dict[str, tuple[int, int]]
    _views: dict[str, torch.Tensor | tuple[torch.Tensor, ...]]
    _pools: dict[int, MambaStatePool]
    #: the slot pool's row 0 covers live memory (decoupled: superblock 0's pages); never check it
    _null_row_aliased = False

    def layer_slot(self, layer_name: str) -> tuple[int, int]:
        """``(group id, index of the layer in its group = index of its raw tensor)``."""
        try:
            return self._slot[layer_name]
        except KeyError:
            raise InvalidSpecError(f"unknown layer {layer_name!r}") from None

    def kv_cache(self, layer_name: str) -> torch.Tensor:
        """KV view of an attention layer: ``[rows, 2, tokens per row, num_kv_heads, head_size]``
        in the spec dtype; ``[:, 0]`` is K, ``[:, 1]`` is V (the layout's docstring gives rows)."""
        self.layer_slot(layer_name)  # raises on an unknown name
        view = self._views[layer_name]
        if not isinstance(view, torch.Tensor):
            raise InvalidSpecError(f"{layer_name!r} is a Mamba layer; use mamba_states")
        return view

    def mamba_states(self, layer_name: str) -> tuple[torch.Tensor, ...]:
        """State views of a Mamba layer: ``[rows, *shape]`` per state (conv, SSM)."""
        self.layer_slot(layer_name)  # raises on an unknown name
        view = self._views[layer_name]
        if isinstance(view, torch.Tensor):
            raise InvalidSpecError(f"{layer_name!r} is an attention layer; use kv_cache")
        return view

    def state_pool(self, group_id: int) -> MambaStatePool:
        """The :class:`MambaStatePool` of Mamba group `group_id` over this layout's memory (built
        once, with the layout's ``copy_backend``; its copies move a state's bytes of one row and
        never touch other rows, other groups' bytes or padding).

        Raises:
            InvalidSpecError: no such group, or not a Mamba group.
        """
        if group_id not in self._pools:
            spec, n = mamba_group(self.config, group_id)
            self._pools[group_id] = MambaStatePool.from_raw(spec, self.raw[:n], copy_backend=self.copy_backend,
                                                            null_row_aliased=self._null_row_aliased)
        return self._pools[group_id]

    def mamba_group_ids(self) -> list[int]:
        """Ids of the Mamba groups, in config order."""
        return [gid for gid, g in enumerate(self.config.kv_cache_groups) if isinstance(g.kv_cache_spec, MambaSpec)]
