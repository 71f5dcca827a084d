"""Hybrid model configs (Hugging Face ``config.json``) -> layer kinds, state shapes, KVCacheConfig.

Packaged models: ``list_models()``; load one with ``load_model(name_or_path)``.
"""

from mambakv.models.hf import (
                               GatedDeltaNetDims,
                               HybridModel,
                               LayerKind,
                               Mamba1Dims,
                               Mamba2Dims,
                               parse_config,
                               read_config,
)
from mambakv.models.info import ModelInfo, format_models_table, model_info
from mambakv.models.kv_config import PagePlan, build_kv_cache_config, plan_pages
from mambakv.models.registry import list_models, load_model

__all__ = [
    "GatedDeltaNetDims", "HybridModel", "LayerKind", "Mamba1Dims", "Mamba2Dims", "ModelInfo",
    "PagePlan", "build_kv_cache_config", "format_models_table", "list_models", "load_model",
    "model_info", "parse_config", "plan_pages", "read_config",
]
