"""From a hybrid model to a :class:`~mambakv.core.spec.KVCacheConfig` with vLLM's exact layout.

The rules (DESIGN.md 7), as named steps:

1. ``group_size``: the smallest number of layers of any kind, or the largest when it is below
   1.5x the smallest (then a kind's groups may hold fewer layers).  Each kind gets
   ``cdiv(count, group_size)`` groups; the j-th layer of a kind goes to group ``j mod n``.
2. ``block_size``: the smallest multiple of 16 tokens whose attention page (one layer, one
   rank: ``block_size x 2 x kv_heads x head_dim x itemsize``) is at least the Mamba page; the
   Mamba page is padded up to it, so every group has one page size.  A model without attention
   uses ``mamba_block_size`` and the raw Mamba page.
3. ``num_blocks = memory_bytes // (group_size x page_size_bytes)``.

Qwen3-Next-80B-A3B, bf16: Mamba page 1,097,728 B, attention 2,048 B per token, so
``cdiv(1,097,728, 2,048) = 536 -> 544`` tokens; groups of 12 (12 attention, 36 GDN = 3 groups);
a block id costs ``12 x 544 x 2,048 = 13,369,344`` B.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mambakv.core.arena import SuperblockGeometry
from mambakv.core.errors import InvalidSpecError
from mambakv.core.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheSpec, MambaCacheMode, MambaSpec
from mambakv.models.hf import HybridModel
from mambakv.models.registry import load_model

__all__ = ["BLOCK_SIZE_MULTIPLE", "DEFAULT_PAGE_TOKENS", "LAYOUTS", "PagePlan", "build_kv_cache_config",
           "plan_pages", "plan_superblocks", "round_robin_groups"]

#: Attention block sizes are multiples of this many tokens (vLLM's kernel alignment).
BLOCK_SIZE_MULTIPLE = 16


def round_robin_groups(layers: tuple[int, ...], group_size: int) -> list[list[int]]:
    """Deal ``layers`` into ``cdiv(len, group_size)`` groups: the j-th goes to group j mod n.

    ``(3, 7, 11, 15, 19, 23)`` with group size 3 -> ``[[3, 11, 19], [7, 15, 23]]``.
    """
    if not layers:
        return []
    n = math.ceil(len(layers) / group_size)
    return [list(layers[g::n]) for g in range(n)]


def choose_group_size(counts: list[int]) -> int:
    """Smallest non-zero layer count, or the largest when it is < 1.5x the smallest."""
    counts = [c for c in counts if c > 0]
    lo, hi = min(counts), max(counts)
    return hi if hi < 1.5 * lo else lo


@dataclass(frozen=True)
class PagePlan:
    """The page geometry of a model (one rank).

    Attributes:
        block_size: tokens per block (attention; Mamba in align mode).
        page_size_bytes: bytes per block per layer, every group.
        mamba_page_bytes: the unpadded Mamba page.
        group_size: layers per group (= raw tensors of the layout).
        attention_groups / mamba_groups: layer indices of each group.
    """

    block_size: int
    page_size_bytes: int
    mamba_page_bytes: int
    group_size: int
    attention_groups: tuple[tuple[int, ...], ...]
    mamba_groups: tuple[tuple[int, ...], ...]

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id costs: ``group_size x page_size_bytes``."""
        return self.group_size * self.page_size_bytes


def plan_pages(model: HybridModel | str, *, tp_size: int = 1, ssm_dtype: Any = None,
               mamba_block_size: int = 2048) -> PagePlan:
    """Block size, page size and groups of ``model`` (see module doc)."""
    model = load_model(model)
    mamba_page = model.state_page_bytes(tp_size, ssm_dtype)
    if model.attention_layers:
        per_token = model.attention_bytes_per_token(tp_size)
        m = BLOCK_SIZE_MULTIPLE
        block_size = max(m, math.ceil(math.ceil(mamba_page / per_token) / m) * m)
        page = block_size * per_token
    else:
        if mamba_block_size <= 0:
            raise InvalidSpecError(f"mamba_block_size must be > 0, got {mamba_block_size}")
        block_size, page = mamba_block_size, mamba_page
    group_size = choose_group_size([len(model.attention_layers), len(model.mamba_layers)])
    return PagePlan(
        block_size, page, mamba_page, group_size,
        tuple(map(tuple, round_robin_groups(model.attention_layers, group_size))),
        tuple(map(tuple, round_robin_groups(model.mamba_layers, group_size))))


#: Layouts ``build_kv_cache_config`` builds: vLLM's one page size, or pages + state slots.
LAYOUTS = ("unified", "decoupled")

#: Default attention page of the decoupled layout, in tokens (CACHE.md: 16, 64 or 256 move the
#: hit rate by at most 0.005; 64 keeps tables short and the trace's 512-token grid on it).
DEFAULT_PAGE_TOKENS = 64


def plan_superblocks(model: HybridModel | str, memory_bytes: int, *, page_tokens: int = DEFAULT_PAGE_TOKENS,
                     tp_size: int = 1, ssm_dtype: Any = None) -> SuperblockGeometry:
    """The decoupled layout's geometry: pages of `page_tokens` tokens for every attention layer
    of a group (``group_size`` layers, as the unified layout's raw tensors), a state slot for
    every layer of one Mamba group, ``k = cdiv(slot, page)`` pages per superblock, and
    ``memory_bytes // (k x page)`` superblocks.

    Qwen3-Next-80B-A3B, bf16, 64-token pages: a page is ``12 x 64 x 2,048 = 1,572,864`` B, a
    state slot ``12 x 1,097,728 = 13,172,736`` B, ``k = 9``: a superblock is 14,155,776 B and a
    slot leaves 983,040 B of it idle (6.9%); 60 GiB holds 4,551 superblocks.

    Raises:
        InvalidSpecError: no attention layers (nothing to page: use ``unified``), `page_tokens`
            not a positive multiple of 16, or fewer than 2 superblocks fit.
    """
    model = load_model(model)
    if not model.attention_layers:
        raise InvalidSpecError("the decoupled layout pages attention KV; a model without attention layers "
                               "uses layout='unified'")
    if not isinstance(page_tokens, int) or page_tokens <= 0 or page_tokens % BLOCK_SIZE_MULTIPLE:
        raise InvalidSpecError(f"page_tokens must be a positive multiple of {BLOCK_SIZE_MULTIPLE}, got {page_tokens!r}")
    plan = plan_pages(model, tp_size=tp_size, ssm_dtype=ssm_dtype)
    page = plan.group_size * page_tokens * model.attention_bytes_per_token(tp_size)
    state = plan.group_size * plan.mamba_page_bytes
    k = max(1, math.ceil(state / page))
    n = memory_bytes // (k * page)
    if n < 2:
        raise InvalidSpecError(f"{memory_bytes} B holds {n} superblocks of {k * page} B; need at least 2")
    return SuperblockGeometry(n, k, page, state)


def build_kv_cache_config(model: HybridModel | str, memory_bytes: int, *,
                          mamba_mode: MambaCacheMode | str = MambaCacheMode.ALIGN,
                          num_speculative_blocks: int = 0, tp_size: int = 1,
                          ssm_dtype: Any = None, mamba_block_size: int = 2048,
                          max_model_len: int | None = None,
                          decode_checkpoints: str | None = None, layout: str = "unified",
                          page_tokens: int = DEFAULT_PAGE_TOKENS) -> KVCacheConfig:
    """The :class:`KVCacheConfig` of ``model`` over ``memory_bytes`` of cache memory (one rank).

    Args:
        model: a :class:`HybridModel`, a packaged name or a ``config.json`` path.
        memory_bytes: bytes for all groups together.
        mamba_mode: ``"align"`` (prefix caching of states) or ``"none"``.
        num_speculative_blocks: draft tokens of MTP / EAGLE (Mamba scratch blocks).
        tp_size: tensor-parallel size (divides KV and Mamba heads).
        ssm_dtype: override of the SSM state dtype (e.g. ``"float32"``).
        mamba_block_size: align block size of a model without attention (tokens).
        max_model_len: in mode NONE, the Mamba groups' block size (one block = one state);
            defaults to the attention block size (or ``mamba_block_size``).
        decode_checkpoints: the Mamba groups' ``MambaSpec.decode_checkpoints`` (every /
            latest / none); None: ``every`` unified (vLLM's), ``none`` decoupled (on the real
            trace decode-boundary states cost hit rate and are never hit: docs/replay.md).
        layout: ``"unified"`` (vLLM 0.33's layout, bit for bit: one page size for all groups)
            or ``"decoupled"`` (``page_tokens``-token attention pages and state slots on one
            byte budget, :func:`plan_superblocks`; every group's block size is ``page_tokens``,
            so states are keyed by position on the page grid).
        page_tokens: the decoupled layout's page size in tokens.

    Groups: attention groups (:class:`FullAttentionSpec`) first, then Mamba groups
    (:class:`MambaSpec` padded to the common page).  Layer names are
    ``model.layers.<i>.self_attn`` and ``model.layers.<i>.mamba``.

    Raises:
        ModelConfigError: unknown model or a TP size that does not divide its heads.
        InvalidSpecError: `memory_bytes` not a positive int, fewer than 2 blocks (superblocks)
            fit in it, an unknown
            `layout`, or a decoupled layout of a model without attention.
    """
    if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int) or memory_bytes <= 0:
        raise InvalidSpecError(f"memory_bytes must be a positive int (bytes), got {memory_bytes!r}")
    model = load_model(model)
    if layout not in LAYOUTS:
        raise InvalidSpecError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if isinstance(mamba_mode, str) and mamba_mode.lower() in ("align_lazy", "lazy"):
        decode_checkpoints = "latest"  # the removed 0.x lazy mode
    if decode_checkpoints is None:
        decode_checkpoints = "none" if layout == "decoupled" else "every"
    mode = MambaCacheMode(mamba_mode)
    plan = plan_pages(model, tp_size=tp_size, ssm_dtype=ssm_dtype,
                      mamba_block_size=mamba_block_size)
    superblocks = None
    if layout == "decoupled":
        superblocks = plan_superblocks(model, memory_bytes, page_tokens=page_tokens, tp_size=tp_size,
                                       ssm_dtype=ssm_dtype)
        num_blocks, block_size, padded = superblocks.num_pages, page_tokens, None
    else:
        num_blocks, block_size, padded = memory_bytes // plan.bytes_per_block, plan.block_size, plan.page_size_bytes
        if num_blocks < 2:
            raise InvalidSpecError(f"{memory_bytes} B holds {num_blocks} blocks of "
                                   f"{plan.bytes_per_block} B; need at least 2 (block 0 is null)")
    mamba_bs = block_size
    if mode is MambaCacheMode.NONE and max_model_len is not None:
        mamba_bs = max_model_len
    mamba_spec = MambaSpec(mamba_bs, model.state_shapes(tp_size), model.state_dtypes(ssm_dtype),
                           mode=mode, num_speculative_blocks=num_speculative_blocks,
                           page_size_padded=padded, decode_checkpoints=decode_checkpoints)
    groups: list[KVCacheGroupSpec] = []
    for layers in plan.attention_groups:
        spec: KVCacheSpec = FullAttentionSpec(block_size, model.kv_heads_per_rank(tp_size),
                                              model.head_dim, model.dtype)
        groups.append(KVCacheGroupSpec([f"model.layers.{i}.self_attn" for i in layers], spec))
    for layers in plan.mamba_groups:
        groups.append(KVCacheGroupSpec([f"model.layers.{i}.mamba" for i in layers], mamba_spec))
    return KVCacheConfig(num_blocks, groups, superblocks)
