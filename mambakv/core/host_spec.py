"""The host tier's spec, its counts and the prefix-map lookups it shares with the coordinator
(:mod:`mambakv.core.host_tier`): plain records, no state."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from mambakv.core.arena_geometry import SuperblockGeometry
from mambakv.core.block import KVCacheBlock
from mambakv.core.block_pool import MapEntry
from mambakv.core.errors import InvalidSpecError, as_count

__all__ = ["MAX_HOST_BLOCKS", "HostStats", "HostTierSpec", "HostWrite", "copies_of", "first_copy"]

#: most page ids a host tier may track: each is a Python block object (about 200 B and 9 us to
#: build on the 2-core reference machine, so 2**24 is about 3 GiB and 2.5 minutes); 1 TiB of
#: Qwen3-Next's 1.5 MiB pages is 0.7 M
MAX_HOST_BLOCKS = 1 << 24


class HostWrite(str, Enum):
    """When units are written to the host tier (see the module docstring)."""

    THROUGH = "through"
    EVICT = "evict"


@dataclass(frozen=True)
class HostTierSpec:
    """A host tier for ``KVCacheCoordinator(host_tier=...)``.

    Attributes:
        memory_bytes: the host budget in bytes (pinned host memory on a real engine).
        write: ``"through"`` (default) or ``"evict"`` (:class:`HostWrite`).
        eviction: the host tier's policy (``"reuse"`` / ``"lru"``); None: ``"lru"`` (with a host
            tier the two score the same on the trace, CACHE.md).
        block_bytes: the unified layout only: bytes of one block id (``PagePlan.bytes_per_block``);
            the decoupled layout takes its page and state bytes from the config (giving it there
            raises).

    Raises:
        InvalidSpecError: a bad field (checked here; the geometry is checked by the coordinator).
    """

    memory_bytes: int
    write: HostWrite | str = HostWrite.THROUGH
    eviction: str | None = None
    block_bytes: int | None = None

    def __post_init__(self) -> None:
        as_count(self.memory_bytes, "memory_bytes", 1, error=InvalidSpecError)
        try:
            object.__setattr__(self, "write", HostWrite(self.write))
        except ValueError:
            raise InvalidSpecError(f"host write must be 'through' or 'evict', got {self.write!r}") from None
        if self.block_bytes is not None:
            as_count(self.block_bytes, "block_bytes", 1, error=InvalidSpecError)

    def geometry(self, device: SuperblockGeometry | None) -> SuperblockGeometry:
        """The host arena's geometry: `device`'s page / state sizes (decoupled), or one block id
        per page and per slot (unified, ``block_bytes``), with as many superblocks as fit.

        Raises:
            InvalidSpecError: unified without ``block_bytes`` (decoupled with it), fewer than 2
                superblocks fit, or more than ``MAX_HOST_BLOCKS`` page ids.
        """
        if device is not None:
            if self.block_bytes is not None:
                raise InvalidSpecError("block_bytes is for the unified layout: the decoupled one takes its page and "
                                       "state bytes from the config")
            k, page, state = device.pages_per_superblock, device.page_bytes, device.state_bytes
        elif self.block_bytes is None:
            raise InvalidSpecError("a host tier over the unified layout needs block_bytes (bytes of one block id)")
        else:
            k, page, state = 1, self.block_bytes, self.block_bytes
        n = self.memory_bytes // (k * page)
        if n < 2:
            raise InvalidSpecError(f"{self.memory_bytes} B of host memory hold {n} superblocks of {k * page} B; "
                                   f"need at least 2")
        if n * k > MAX_HOST_BLOCKS:
            raise InvalidSpecError(f"{self.memory_bytes} B of host memory hold {n * k:,} page ids of {page} B; the host "
                                   f"tier tracks at most {MAX_HOST_BLOCKS:,} (one Python block object each)")
        return SuperblockGeometry(n, k, page, state)


@dataclass
class HostStats:
    """Counts of the host tier (bytes are the transfers planned)."""

    stores: int = 0
    stored_pages: int = 0
    stored_states: int = 0
    bytes_d2h: int = 0
    skipped_stores: int = 0
    #: planned page / state stores dropped undone: the host reused their blocks first (their unit
    #: was evicted before the plan ran)
    dropped_stores: int = 0
    loads: int = 0
    bytes_h2d: int = 0
    loaded_tokens: int = 0
    aborted_loads: int = 0


def copies_of(m: dict[bytes, MapEntry] | None, keys: Sequence[bytes]) -> list[KVCacheBlock | None]:
    """``first_copy(m, k)`` for each of `keys` (the map lookups in one C-level pass)."""
    if m is None:
        return [None] * len(keys)
    return [e if type(e) is not dict else next(iter(e.values())) for e in map(m.get, keys)]  # type: ignore[misc]


def first_copy(m: dict[bytes, MapEntry] | None, key: bytes) -> KVCacheBlock | None:
    """One block cached under `key` in a group's map (a hash may have several copies), or None."""
    e = m.get(key) if m is not None else None
    if e is None or not isinstance(e, dict):
        return e
    return next(iter(e.values()))
