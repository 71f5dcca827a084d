"""Shared test helpers."""

from __future__ import annotations

from mambakv import BlockPool, MambaCacheMode, MambaManager, MambaSpec

STATE_SHAPES = ((3, 8), (2, 4, 4))
STATE_DTYPES = ("bfloat16", "float32")


def mamba_spec(block_size: int, nspec: int = 0, mode: MambaCacheMode | str = "align",
               decode_checkpoints: str = "every") -> MambaSpec:
    return MambaSpec(block_size, STATE_SHAPES, STATE_DTYPES, mode=mode, num_speculative_blocks=nspec,
                     decode_checkpoints=decode_checkpoints)


def mamba_manager(block_size: int, nspec: int = 0, num_blocks: int = 64, **kw) -> MambaManager:
    return MambaManager(mamba_spec(block_size, nspec), BlockPool(num_blocks), **kw)


def pattern(blocks) -> str:
    """'0' for null, '1' for a real block: the notation of DESIGN.md 5.1."""
    return " ".join("0" if b.is_null else "1" for b in blocks)


def held(blocks) -> int:
    return sum(1 for b in blocks if not b.is_null)


def replay_480k(manager: MambaManager, *, in_flight: int, total: int = 480_031, budget: int = 8192) -> int:
    """The long-prefill replay of DESIGN.md 5.1 at manager level; returns peak held blocks.

    Chunk = `budget` rounded down to a multiple of the block size; before each allocation the
    engine retires to ``max(0, computed - in_flight * chunk)``."""
    bs = manager.block_size
    chunk = budget // bs * bs
    computed, peak = 0, 0
    while computed < total:
        manager.remove_skipped_blocks("r", max(0, computed - in_flight * chunk))
        step = min(chunk, total - computed)
        manager.allocate_new_blocks("r", computed + step)
        manager.take_copy_plan()
        computed += step
        peak = max(peak, held(manager.req_to_blocks["r"]))
        manager.check_invariants()
    return peak


def retire_until_first_null(manager, table, num_slots: int) -> None:
    """vLLM's retirement before its fix, for teeth tests: walk down from the highest skipped
    slot, stop at the first null, no watermark (DESIGN.md 5.1, the null-gap leak). A drop-in
    for the documented override point ``SingleTypeKVCacheManager.retire_slots``."""
    blocks, null, freed = table.blocks, manager.null_block, []
    for i in range(min(num_slots, len(blocks)) - 1, -1, -1):
        if blocks[i] is null:
            break
        freed.append(blocks[i])
        blocks[i] = null
        table.positions.pop(i, None)
    if freed:
        manager.block_pool.free_blocks(freed)
