"""One-line summaries of models for ``mambakv models``: state bytes, block size, page size."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mambakv.models.hf import HybridModel
from mambakv.models.kv_config import plan_pages
from mambakv.models.registry import list_models, load_model

__all__ = ["GIB", "MIB", "ModelInfo", "format_models_table", "model_info"]

GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True)
class ModelInfo:
    """Cache geometry of one model on one rank.

    Attributes:
        name, mixer: model name and Mamba mixer kind (``"gdn"``, ``"mamba1"``, ``"mamba2"``).
        num_layers, num_attention_layers, num_mamba_layers: layer counts.
        state_bytes_per_request: one request's states over all Mamba layers (unpadded).
        block_size: tokens per block; page_size_bytes: bytes per block per layer (padded).
        group_size, num_groups: layers per KV-cache group, and groups of all kinds.
        bytes_per_block: ``group_size x page_size_bytes``; blocks_per_gib: ``GiB // that``.
    """

    name: str
    mixer: str
    num_layers: int
    num_attention_layers: int
    num_mamba_layers: int
    state_bytes_per_request: int
    block_size: int
    page_size_bytes: int
    group_size: int
    num_groups: int
    bytes_per_block: int
    blocks_per_gib: int

    @property
    def state_mib_per_request(self) -> float:
        return self.state_bytes_per_request / MIB


def model_info(model: HybridModel | str, *, tp_size: int = 1, ssm_dtype: Any = None,
               mamba_block_size: int = 2048) -> ModelInfo:
    """The :class:`ModelInfo` of a model (a :class:`HybridModel`, a packaged name or a path)."""
    m = load_model(model)
    plan = plan_pages(m, tp_size=tp_size, ssm_dtype=ssm_dtype, mamba_block_size=mamba_block_size)
    return ModelInfo(
        name=m.name, mixer=m.mixer.kind, num_layers=m.num_hidden_layers,
        num_attention_layers=len(m.attention_layers), num_mamba_layers=len(m.mamba_layers),
        state_bytes_per_request=m.state_bytes_per_request(tp_size, ssm_dtype),
        block_size=plan.block_size, page_size_bytes=plan.page_size_bytes,
        group_size=plan.group_size,
        num_groups=len(plan.attention_groups) + len(plan.mamba_groups),
        bytes_per_block=plan.bytes_per_block, blocks_per_gib=GIB // plan.bytes_per_block)


def format_models_table(models: list[str] | None = None, *, tp_size: int = 1,
                        ssm_dtype: Any = None) -> str:
    """A plain-text table of ``models`` (default: every packaged model), one row each."""
    header = ("model", "mixer", "attn/mamba/all", "state MiB/req", "block", "page B",
              "groups x size", "blocks/GiB")
    rows = [header]
    for name in models if models is not None else list_models():
        i = model_info(name, tp_size=tp_size, ssm_dtype=ssm_dtype)
        rows.append((i.name, i.mixer,
                     f"{i.num_attention_layers}/{i.num_mamba_layers}/{i.num_layers}",
                     f"{i.state_mib_per_request:.1f}", str(i.block_size),
                     f"{i.page_size_bytes:,}", f"{i.num_groups} x {i.group_size}",
                     str(i.blocks_per_gib)))
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if c < 2 else cell.rjust(w)
                       for c, (cell, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
