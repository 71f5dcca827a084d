"""The byte geometry of the decoupled layout (:mod:`mambakv.core.arena`), and where its budget
is: plain frozen records, imported by the spec (``KVCacheConfig.superblocks``) and the arena."""

from __future__ import annotations

from dataclasses import dataclass

from mambakv.core.errors import InvalidSpecError

__all__ = ["ArenaBytes", "SuperblockGeometry"]


@dataclass(frozen=True)
class SuperblockGeometry:
    """Byte geometry of the decoupled layout (one rank).

    Attributes:
        num_superblocks: superblocks in the budget (>= 2; superblock 0 holds the null page).
        pages_per_superblock: ``k = cdiv(state_bytes, page_bytes)`` attention pages.
        page_bytes: bytes of one page id (every attention layer of a group, all raw tensors).
        state_bytes: bytes one state slot uses (every layer of one Mamba group), <= ``k x page_bytes``.

    Raises:
        InvalidSpecError: a non-positive field, fewer than 2 superblocks, or a state that does not
            fit in ``k`` pages.
    """

    num_superblocks: int
    pages_per_superblock: int
    page_bytes: int
    state_bytes: int

    def __post_init__(self) -> None:
        for name in ("pages_per_superblock", "page_bytes", "state_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidSpecError(f"{name} must be an int >= 1, got {v!r}")
        if not isinstance(self.num_superblocks, int) or self.num_superblocks < 2:
            raise InvalidSpecError(f"num_superblocks must be an int >= 2 (superblock 0 holds the null page), "
                                   f"got {self.num_superblocks!r}")
        if self.state_bytes > self.superblock_bytes:
            raise InvalidSpecError(f"a {self.state_bytes} B state does not fit in {self.pages_per_superblock} pages "
                                   f"of {self.page_bytes} B")

    @property
    def superblock_bytes(self) -> int:
        """``k x page_bytes``: what one superblock costs."""
        return self.pages_per_superblock * self.page_bytes

    @property
    def num_pages(self) -> int:
        """Page ids, null page included: ``num_superblocks x k``."""
        return self.num_superblocks * self.pages_per_superblock

    @property
    def total_bytes(self) -> int:
        return self.num_superblocks * self.superblock_bytes

    @property
    def slot_idle_bytes(self) -> int:
        """Bytes of a SLOT superblock that hold nothing (fragmentation per state slot)."""
        return self.superblock_bytes - self.state_bytes


@dataclass(frozen=True)
class ArenaBytes:
    """Where the budget is, in bytes (``SuperblockArena.bytes``): ``pages + states + idle + free
    == total``. `idle` is the fragmentation: the unused tail of every SLOT superblock."""

    pages: int
    states: int
    idle: int
    free: int
    total: int
