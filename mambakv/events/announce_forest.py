"""One node of :class:`~mambakv.events.announce.RouterAnnouncer`'s forest of block keys: which
groups cache the key, whether its chain is whole, and whether it is (below) a checkpoint."""

from __future__ import annotations

__all__ = ["ForestNode"]


class ForestNode:
    """One key of the announce forest. `attn`/`states`: groups caching it; `ok`: the whole
    chain root..self is cached by every attention group (then `depth` is exact); `need`:
    1 if it is a valid checkpoint, plus its children with ``need > 0`` (announced iff > 0)."""

    __slots__ = ("key", "parent", "children", "tokens", "lora_id", "lora_name", "attn", "states", "ok",
                 "depth", "valid", "need")

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.parent: ForestNode | None = None
        self.children: dict[bytes, ForestNode] = {}
        self.tokens: list[int] | None = None  # None: not yet told by an attention group
        self.lora_id: int | None = None
        self.lora_name: str | None = None
        self.attn = 0
        self.states = 0
        self.ok = False
        self.depth = 0
        self.valid = False
        self.need = 0
