"""Read a Hugging Face ``config.json`` (plain json) into layer kinds and state shapes.

Supported ``model_type``s: ``qwen3_next`` and ``qwen3_5*`` (gated DeltaNet), ``nemotron_h``,
``granitemoehybrid``, ``falcon_h1``, ``mamba2`` (Mamba2), ``jamba``, ``mamba`` (Mamba1), and
``mamba_ssm``-style configs (``d_model`` / ``n_layer`` / ``ssm_cfg``, e.g. state-spaces/mamba2-*).

Parsing is split by concern: the mixers' dimensions and state shapes live in
:mod:`mambakv.models.mixers`, the per-family field readers in :mod:`mambakv.models.families`;
every name this module exported before is still importable from here.

State shapes per layer and request (DESIGN.md 7): the table in :mod:`mambakv.models.mixers`.

The conv state is in the model dtype; the SSM state in ``mamba_ssm_dtype`` when the config has
one (Qwen3.5: float32), else the model dtype.  Attention KV heads are divided by ``tp`` (one
replicated head per rank when ``tp > num_kv_heads``).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mambakv.core.errors import ModelConfigError
from mambakv.core.spec import DTYPE_SIZES, dtype_name
from mambakv.models.families import (
    BLOCK_TYPES,
    MAX_LAYERS,
    NEMOTRON_LETTERS,
    QWEN_LAYER_TYPES,
    attention_dims,
    context_length,
    parse_layers_and_mixer,
)
from mambakv.models.mixers import GatedDeltaNetDims, Mamba1Dims, Mamba2Dims, MixerDims, split_per_rank

__all__ = ["BLOCK_TYPES", "MAX_LAYERS", "NEMOTRON_LETTERS", "QWEN_LAYER_TYPES", "GatedDeltaNetDims", "HybridModel",
           "LayerKind", "Mamba1Dims", "Mamba2Dims", "MixerDims", "parse_config", "read_config"]


class LayerKind(str, enum.Enum):
    """What a layer keeps in the cache."""

    ATTENTION = "attention"
    MAMBA = "mamba"



@dataclass(frozen=True)
class HybridModel:
    """What the cache needs to know about a model (all counts at TP = 1).

    ``attention_layers`` / ``mamba_layers`` are layer indices; Falcon-H1 has both in every
    layer, Nemotron-H has MLP-only layers in neither.  ``num_kv_heads`` / ``head_dim`` are 0
    for a model without attention.  ``max_position_embeddings``: the model's own context length
    in tokens (the config's key of that name, :data:`~mambakv.models.families.CONTEXT_LENGTH_KEYS`),
    None when the config has none (``mamba_ssm`` checkpoints).
    """

    name: str
    model_type: str
    num_hidden_layers: int
    attention_layers: tuple[int, ...]
    mamba_layers: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    dtype: str
    ssm_dtype: str
    mixer: MixerDims
    max_position_embeddings: int | None = None

    @property
    def layer_kinds(self) -> tuple[tuple[LayerKind, ...], ...]:
        """Per layer, the kinds of cache it keeps (``()`` for an MLP-only layer)."""
        att, mam = set(self.attention_layers), set(self.mamba_layers)
        return tuple(tuple(k for k, s in ((LayerKind.ATTENTION, att), (LayerKind.MAMBA, mam))
                           if i in s) for i in range(self.num_hidden_layers))

    def kv_heads_per_rank(self, tp_size: int = 1) -> int:
        if self.num_kv_heads >= tp_size:
            return split_per_rank(self.num_kv_heads, tp_size, "num_key_value_heads")
        if tp_size % self.num_kv_heads:
            raise ModelConfigError(f"tp_size {tp_size} is not a multiple of "
                                   f"{self.num_kv_heads} KV heads")
        return 1

    def attention_bytes_per_token(self, tp_size: int = 1) -> int:
        """K and V bytes of one token in one attention layer on one rank."""
        return 2 * self.kv_heads_per_rank(tp_size) * self.head_dim * DTYPE_SIZES[self.dtype]

    def state_shapes(self, tp_size: int = 1) -> tuple[tuple[int, ...], ...]:
        """``(conv shape, SSM shape)`` of one Mamba layer on one rank."""
        return self.mixer.shapes(tp_size)

    def state_dtypes(self, ssm_dtype: Any = None) -> tuple[str, str]:
        """``(conv dtype, SSM dtype)``; ``ssm_dtype`` overrides the config's."""
        return self.dtype, dtype_name(ssm_dtype) if ssm_dtype is not None else self.ssm_dtype

    def state_page_bytes(self, tp_size: int = 1, ssm_dtype: Any = None) -> int:
        """Bytes of one Mamba layer's states for one request (unpadded)."""
        total = 0
        for shape, dt in zip(self.state_shapes(tp_size), self.state_dtypes(ssm_dtype)):
            n = DTYPE_SIZES[dt]
            for d in shape:
                n *= d
            total += n
        return total

    def state_bytes_per_request(self, tp_size: int = 1, ssm_dtype: Any = None) -> int:
        """Bytes of one request's states over all Mamba layers (one rank, unpadded)."""
        return len(self.mamba_layers) * self.state_page_bytes(tp_size, ssm_dtype)



def parse_config(cfg: Mapping[str, Any], name: str = "model") -> HybridModel:
    """A :class:`HybridModel` from a parsed ``config.json`` (a ``text_config`` is merged in).

    Every count must be a JSON integer of the right sign, every layer pattern
    (``layer_types``, ``layers_block_type``, ``hybrid_override_pattern``) must name exactly
    ``num_hidden_layers`` layers of known kinds.  The checks run before anything is built.

    Raises:
        ModelConfigError: not a JSON object, unknown ``model_type``, a missing field, a number
            that is not an int of the right sign, a pattern of the wrong length or with an
            unknown kind, or inconsistent values (one line naming the key).
    """
    if not isinstance(cfg, Mapping):
        raise ModelConfigError(f"config.json must be a JSON object, got {type(cfg).__name__}")
    if isinstance(cfg.get("text_config"), Mapping):
        cfg = {**cfg, **cfg["text_config"]}
    mt = cfg.get("model_type") or ("mamba_ssm" if "ssm_cfg" in cfg or "n_layer" in cfg else "")
    if not isinstance(mt, str):
        raise ModelConfigError(f"config.json: model_type must be a string, got {mt!r}")
    mt = "qwen3_5" if mt.startswith("qwen3_5") else mt
    n, att, mam, mixer = parse_layers_and_mixer(cfg, mt)
    if not mam:
        raise ModelConfigError("config.json: no Mamba / linear-attention layer; not a hybrid model")
    kv, hd = attention_dims(cfg, mt) if att else (0, 0)
    try:
        dtype = dtype_name(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        ssm_dtype = dtype_name(cfg.get("mamba_ssm_dtype") or dtype)
    except Exception as e:  # InvalidSpecError from dtype_name
        raise ModelConfigError(f"config.json: {e}") from None
    return HybridModel(name, mt, n, att, mam, kv, hd, dtype, ssm_dtype, mixer, context_length(cfg, mt))


def read_config(path: str | Path, name: str | None = None) -> HybridModel:
    """Parse a ``config.json`` file, or the ``config.json`` inside a directory.

    The file is UTF-8, with or without a byte-order mark (an editor's "UTF-8 with BOM").
    Messages name the file read (``nolayers.json lacks layer_types / layers_block_type``), not
    ``config.json``.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        cfg = json.loads(p.read_text(encoding="utf-8-sig"))
    except (OSError, ValueError) as e:
        raise ModelConfigError(f"cannot read {p}: {e}") from None
    try:
        return parse_config(cfg, name or p.parent.name or p.stem)
    except ModelConfigError as e:
        msg = str(e)
        if msg.startswith("config.json"):  # parse_config's messages name the file generically
            raise ModelConfigError(f"{p}{msg[len('config.json'):]}") from None
        raise
