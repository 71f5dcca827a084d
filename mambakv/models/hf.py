"""Read a Hugging Face ``config.json`` (plain json) into layer kinds and state shapes.

Supported ``model_type``s: ``qwen3_next`` and ``qwen3_5*`` (gated DeltaNet), ``nemotron_h``,
``granitemoehybrid``, ``falcon_h1``, ``mamba2`` (Mamba2), ``jamba``, ``mamba`` (Mamba1), and
``mamba_ssm``-style configs (``d_model`` / ``n_layer`` / ``ssm_cfg``, e.g. state-spaces/mamba2-*).

State shapes per layer and request (DESIGN.md 7), per tensor-parallel rank:

=========  ==================================================  ==========================
mixer      conv state                                          SSM state
=========  ==================================================  ==========================
Mamba1     ``(d_conv - 1, d_inner / tp)``                      ``(d_inner / tp, d_state)``
Mamba2     ``(d_conv - 1, (d_inner + 2 g d_state) / tp)``      ``(heads / tp, head_dim,
           with ``g`` B/C groups; when ``g % tp != 0`` the      d_state)``
           groups are replicated: 1 group per rank
GDN        ``(k - 1, (2 nk dk + nv dv) / tp)``                 ``(nv / tp, dk, dv)``
=========  ==================================================  ==========================

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

__all__ = ["GatedDeltaNetDims", "HybridModel", "LayerKind", "Mamba1Dims", "Mamba2Dims",
           "parse_config", "read_config"]


class LayerKind(str, enum.Enum):
    """What a layer keeps in the cache."""

    ATTENTION = "attention"
    MAMBA = "mamba"


def _split(value: int, tp: int, what: str) -> int:
    if tp <= 0 or value % tp:
        raise ModelConfigError(f"{what} = {value} is not divisible by tp_size {tp}")
    return value // tp


@dataclass(frozen=True)
class Mamba1Dims:
    """Mamba1 mixer: ``d_inner`` channels, ``d_state`` per channel, conv kernel ``d_conv``."""

    d_inner: int
    d_state: int
    d_conv: int
    kind = "mamba1"

    def shapes(self, tp: int = 1) -> tuple[tuple[int, ...], tuple[int, ...]]:
        d = _split(self.d_inner, tp, "d_inner")
        return (self.d_conv - 1, d), (d, self.d_state)


@dataclass(frozen=True)
class Mamba2Dims:
    """Mamba2 mixer: ``n_heads x head_dim`` channels, ``n_groups`` B/C groups of ``d_state``."""

    n_heads: int
    head_dim: int
    d_state: int
    n_groups: int
    d_conv: int
    kind = "mamba2"

    def groups_per_rank(self, tp: int) -> int:
        if self.n_groups % tp == 0:
            return self.n_groups // tp
        if tp % self.n_groups == 0:  # replicated: each rank keeps the one group its heads use
            return 1
        raise ModelConfigError(f"n_groups {self.n_groups} and tp_size {tp} do not divide")

    def shapes(self, tp: int = 1) -> tuple[tuple[int, ...], tuple[int, ...]]:
        heads = _split(self.n_heads, tp, "Mamba2 heads")
        conv_dim = heads * self.head_dim + 2 * self.groups_per_rank(tp) * self.d_state
        return (self.d_conv - 1, conv_dim), (heads, self.head_dim, self.d_state)


@dataclass(frozen=True)
class GatedDeltaNetDims:
    """Gated DeltaNet (Qwen3-Next linear attention): ``nk`` key heads of ``dk``, ``nv`` value
    heads of ``dv``, conv kernel ``conv_kernel``."""

    n_k_heads: int
    n_v_heads: int
    d_k: int
    d_v: int
    conv_kernel: int
    kind = "gdn"

    def shapes(self, tp: int = 1) -> tuple[tuple[int, ...], tuple[int, ...]]:
        nk = _split(self.n_k_heads, tp, "GDN key heads")
        nv = _split(self.n_v_heads, tp, "GDN value heads")
        return (self.conv_kernel - 1, 2 * nk * self.d_k + nv * self.d_v), (nv, self.d_k, self.d_v)


MixerDims = Mamba1Dims | Mamba2Dims | GatedDeltaNetDims


@dataclass(frozen=True)
class HybridModel:
    """What the cache needs to know about a model (all counts at TP = 1).

    ``attention_layers`` / ``mamba_layers`` are layer indices; Falcon-H1 has both in every
    layer, Nemotron-H has MLP-only layers in neither.  ``num_kv_heads`` / ``head_dim`` are 0
    for a model without attention.
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

    @property
    def layer_kinds(self) -> tuple[tuple[LayerKind, ...], ...]:
        """Per layer, the kinds of cache it keeps (``()`` for an MLP-only layer)."""
        att, mam = set(self.attention_layers), set(self.mamba_layers)
        return tuple(tuple(k for k, s in ((LayerKind.ATTENTION, att), (LayerKind.MAMBA, mam))
                           if i in s) for i in range(self.num_hidden_layers))

    def kv_heads_per_rank(self, tp_size: int = 1) -> int:
        if self.num_kv_heads >= tp_size:
            return _split(self.num_kv_heads, tp_size, "num_key_value_heads")
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


# --------------------------------------------------------------------------- parsing
def _get(cfg: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    if default is not None:
        return default
    raise ModelConfigError(f"config.json lacks {' / '.join(keys)}")


def _pattern_layers(kinds: list[str], attention: set[str], mamba: set[str]
                    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    att = tuple(i for i, k in enumerate(kinds) if k in attention)
    mam = tuple(i for i, k in enumerate(kinds) if k in mamba)
    return att, mam


def _attention_dims(cfg: Mapping[str, Any]) -> tuple[int, int]:
    heads = int(_get(cfg, "num_attention_heads"))
    kv = int(_get(cfg, "num_key_value_heads", default=heads))
    hd = cfg.get("head_dim") or cfg.get("attention_head_dim")
    return kv, int(hd) if hd else int(_get(cfg, "hidden_size")) // heads


def _parse_layers_and_mixer(cfg: Mapping[str, Any], mt: str
                            ) -> tuple[int, tuple[int, ...], tuple[int, ...], MixerDims]:
    if mt.startswith("qwen3_next") or mt.startswith("qwen3_5"):
        n = int(_get(cfg, "num_hidden_layers"))
        kinds = cfg.get("layer_types") or [
            "full_attention" if (i + 1) % int(_get(cfg, "full_attention_interval")) == 0
            else "linear_attention" for i in range(n)]
        att, mam = _pattern_layers(list(kinds), {"full_attention"}, {"linear_attention"})
        mixer: MixerDims = GatedDeltaNetDims(
            int(_get(cfg, "linear_num_key_heads")), int(_get(cfg, "linear_num_value_heads")),
            int(_get(cfg, "linear_key_head_dim")), int(_get(cfg, "linear_value_head_dim")),
            int(_get(cfg, "linear_conv_kernel_dim")))
        return n, att, mam, mixer
    if mt == "nemotron_h":
        pattern = str(_get(cfg, "hybrid_override_pattern"))
        att, mam = _pattern_layers(list(pattern), {"*"}, {"M"})
        mixer = Mamba2Dims(int(_get(cfg, "mamba_num_heads")), int(_get(cfg, "mamba_head_dim")),
                           int(_get(cfg, "ssm_state_size")), int(_get(cfg, "n_groups")),
                           int(_get(cfg, "conv_kernel")))
        return len(pattern), att, mam, mixer
    if mt in ("granitemoehybrid", "falcon_h1"):
        n = int(_get(cfg, "num_hidden_layers"))
        if mt == "falcon_h1":  # attention and Mamba2 side by side in every layer
            att = mam = tuple(range(n))
        else:
            kinds = _get(cfg, "layer_types", "layers_block_type")
            att, mam = _pattern_layers(list(kinds), {"attention"}, {"mamba"})
        mixer = Mamba2Dims(int(_get(cfg, "mamba_n_heads")), int(_get(cfg, "mamba_d_head")),
                           int(_get(cfg, "mamba_d_state")), int(_get(cfg, "mamba_n_groups")),
                           int(_get(cfg, "mamba_d_conv")))
        d_ssm = cfg.get("mamba_d_ssm")
        if d_ssm is not None and int(d_ssm) != mixer.n_heads * mixer.head_dim:
            raise ModelConfigError(f"mamba_d_ssm {d_ssm} != mamba_n_heads x mamba_d_head")
        return n, att, mam, mixer
    if mt == "mamba2":
        n = int(_get(cfg, "num_hidden_layers"))
        mixer = Mamba2Dims(int(_get(cfg, "num_heads")), int(_get(cfg, "head_dim")),
                           int(_get(cfg, "state_size")), int(_get(cfg, "n_groups")),
                           int(_get(cfg, "conv_kernel")))
        return n, (), tuple(range(n)), mixer
    if mt in ("jamba", "mamba"):
        n = int(_get(cfg, "num_hidden_layers"))
        if mt == "mamba":
            att, mam = (), tuple(range(n))
            d_inner = int(_get(cfg, "intermediate_size"))
            d_state, d_conv = int(_get(cfg, "state_size")), int(_get(cfg, "conv_kernel"))
        else:
            kinds = cfg.get("layers_block_type") or [
                "attention" if i % int(_get(cfg, "attn_layer_period"))
                == int(_get(cfg, "attn_layer_offset")) else "mamba" for i in range(n)]
            att, mam = _pattern_layers(list(kinds), {"attention"}, {"mamba"})
            d_inner = int(_get(cfg, "mamba_expand")) * int(_get(cfg, "hidden_size"))
            d_state, d_conv = int(_get(cfg, "mamba_d_state")), int(_get(cfg, "mamba_d_conv"))
        return n, att, mam, Mamba1Dims(d_inner, d_state, d_conv)
    if mt == "mamba_ssm":  # state-spaces checkpoints; defaults of mamba_ssm's Mamba / Mamba2
        n, d_model = int(_get(cfg, "n_layer")), int(_get(cfg, "d_model"))
        ssm = dict(cfg.get("ssm_cfg") or {})
        att = tuple(int(i) for i in cfg.get("attn_layer_idx") or ())
        mam = tuple(i for i in range(n) if i not in set(att))
        expand, d_conv = int(ssm.get("expand", 2)), int(ssm.get("d_conv", 4))
        if ssm.get("layer", "Mamba1") == "Mamba2":
            head_dim = int(ssm.get("headdim", 64))
            mixer = Mamba2Dims(expand * d_model // head_dim, head_dim,
                               int(ssm.get("d_state", 128)), int(ssm.get("ngroups", 1)), d_conv)
        else:
            mixer = Mamba1Dims(expand * d_model, int(ssm.get("d_state", 16)), d_conv)
        return n, att, mam, mixer
    raise ModelConfigError(f"unsupported model_type {mt!r}")


def parse_config(cfg: Mapping[str, Any], name: str = "model") -> HybridModel:
    """A :class:`HybridModel` from a parsed ``config.json`` (a ``text_config`` is merged in).

    Raises:
        ModelConfigError: unknown ``model_type``, a missing field, or inconsistent values.
    """
    if isinstance(cfg.get("text_config"), Mapping):
        cfg = {**cfg, **cfg["text_config"]}
    mt = cfg.get("model_type") or ("mamba_ssm" if "ssm_cfg" in cfg or "n_layer" in cfg else "")
    mt = "qwen3_5" if mt.startswith("qwen3_5") else mt
    n, att, mam, mixer = _parse_layers_and_mixer(cfg, mt)
    if not mam:
        raise ModelConfigError(f"{name}: no Mamba / linear-attention layer; not a hybrid model")
    if len(att) + len(mam) > 2 * n or (att and max(att) >= n) or max(mam) >= n:
        raise ModelConfigError(f"{name}: layer pattern does not match {n} layers")
    kv, hd = _attention_dims(cfg) if att else (0, 0)
    if mt == "mamba_ssm" and att:
        acfg = cfg.get("attn_cfg") or {}
        kv, hd = int(_get(acfg, "num_heads_kv", "num_heads")), int(_get(acfg, "head_dim"))
    try:
        dtype = dtype_name(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        ssm_dtype = dtype_name(cfg.get("mamba_ssm_dtype") or dtype)
    except Exception as e:  # InvalidSpecError from dtype_name
        raise ModelConfigError(f"{name}: {e}") from None
    return HybridModel(name, mt, n, att, mam, kv, hd, dtype, ssm_dtype, mixer)


def read_config(path: str | Path, name: str | None = None) -> HybridModel:
    """Parse a ``config.json`` file, or the ``config.json`` inside a directory."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        cfg = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ModelConfigError(f"cannot read {p}: {e}") from None
    return parse_config(cfg, name or p.parent.name or p.stem)
