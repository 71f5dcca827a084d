"""Read a Hugging Face ``config.json`` (plain json) into layer kinds and state shapes.

Supported ``model_type``s: ``qwen3_next`` and ``qwen3_5*`` (gated DeltaNet), ``nemotron_h``,
``granitemoehybrid``, ``falcon_h1``, ``mamba2`` (Mamba2), ``jamba``, ``mamba`` (Mamba1), and
``mamba_ssm``-style configs (``d_model`` / ``n_layer`` / ``ssm_cfg``, e.g. state-spaces/mamba2-*).

State shapes per layer and request (DESIGN.md 7), per tensor-parallel rank.  The conv state is
always ``(d_conv - 1, channels)``: the kernel's past inputs first, then the channels (``d_conv``
is the conv kernel size: ``conv_kernel``, ``mamba_d_conv``, ``linear_conv_kernel_dim``):

=========  ==================================================  ==========================
mixer      conv state ``(d_conv - 1, channels)``               SSM state
=========  ==================================================  ==========================
Mamba1     ``(d_conv - 1, d_inner / tp)``                      ``(d_inner / tp, d_state)``
Mamba2     ``(d_conv - 1, (d_inner + 2 g d_state) / tp)``      ``(heads / tp, head_dim,
           with ``g`` B/C groups; when ``g % tp != 0`` the      d_state)``
           groups are replicated: 1 group per rank
GDN        ``(d_conv - 1, (2 nk dk + nv dv) / tp)``            ``(nv / tp, dk, dv)``
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
from typing import Any, TypeVar, overload

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
# One rule for every family: every number is a real JSON int (not "48", 48.0 or true) of the
# right sign, a layer pattern names exactly ``num_hidden_layers`` layers, and every layer kind
# in it is known.  Anything else is a one-line ModelConfigError naming the key.
_MISSING = object()
_D = TypeVar("_D")

#: Layer kinds of each pattern key: kind -> (keeps attention KV, keeps a Mamba state).
_ATT, _MAM, _NONE = (True, False), (False, True), (False, False)
QWEN_LAYER_TYPES = {"full_attention": _ATT, "linear_attention": _MAM}
BLOCK_TYPES = {"attention": _ATT, "mamba": _MAM}
#: Nemotron-H ``hybrid_override_pattern``: M Mamba2, * attention, - MLP, E MoE (no cache).
NEMOTRON_LETTERS = {"M": _MAM, "*": _ATT, "-": _NONE, "E": _NONE}
#: Most layers a config may declare: public hybrid models have under 200; the bound stops a
#: typo such as ``num_hidden_layers: 4800000000`` from building per-layer tuples without end.
MAX_LAYERS = 10_000


def _get(cfg: Mapping[str, Any], *keys: str, default: Any = _MISSING) -> Any:
    """The first of `keys` present (not null) in `cfg`, else `default`; none and no default:
    ModelConfigError."""
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    if default is not _MISSING:
        return default
    raise ModelConfigError(f"config.json lacks {' / '.join(keys)}")


@overload
def _int(cfg: Mapping[str, Any], key: str, *, low: int = 1, high: int | None = None, within: str = "") -> int: ...


@overload
def _int(cfg: Mapping[str, Any], key: str, *, low: int = 1, high: int | None = None, default: _D,
         within: str = "") -> int | _D: ...


def _int(cfg: Mapping[str, Any], key: str, *, low: int = 1, high: int | None = None, default: object = _MISSING,
         within: str = "") -> object:
    """``cfg[key]`` as an int in ``[low, high]``: a JSON integer only (``"48"``, ``48.0`` and
    ``true`` are refused, so a typo cannot pass as a count).  A missing key is `default` (no
    check); `within` names the enclosing object in messages (``"ssm_cfg"``)."""
    if cfg.get(key) is None and default is not _MISSING:
        return default
    name = f"{within}.{key}" if within else key
    if cfg.get(key) is None:
        raise ModelConfigError(f"config.json lacks {name}")
    v = cfg[key]
    if type(v) is not int:
        raise ModelConfigError(f"config.json: {name} must be an integer, got {v!r}")
    if v < low:
        raise ModelConfigError(f"config.json: {name} must be >= {low}, got {v}")
    if high is not None and v > high:
        raise ModelConfigError(f"config.json: {name} must be <= {high:,}, got {v:,}")
    return v


def _mapping(cfg: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """``cfg[key]`` as a JSON object (``{}`` when missing or null)."""
    v = cfg.get(key)
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise ModelConfigError(f"config.json: {key} must be an object, got {v!r}")
    return v


def _pattern_layers(kinds: Any, key: str, n: int, known: Mapping[str, tuple[bool, bool]]
                    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Attention and Mamba layer indices of a per-layer pattern (a list of kinds).

    ``list("M-M*")`` with ``NEMOTRON_LETTERS`` and ``n = 4`` -> ``((3,), (0, 2))``.

    Raises:
        ModelConfigError: `kinds` is not a list, its length is not `n`, or it names a kind
            that is not in `known`.
    """
    if not isinstance(kinds, list):
        raise ModelConfigError(f"config.json: {key} must be a list, got {kinds!r}")
    if len(kinds) != n:
        raise ModelConfigError(f"config.json: {key} has {len(kinds)} layers, num_hidden_layers is {n}")
    for i, k in enumerate(kinds):
        if not isinstance(k, str) or k not in known:
            raise ModelConfigError(f"config.json: {key}[{i}] is {k!r}; known: {', '.join(map(repr, known))}")
    att = tuple(i for i, k in enumerate(kinds) if known[k][0])
    mam = tuple(i for i, k in enumerate(kinds) if known[k][1])
    return att, mam


def _attention_dims(cfg: Mapping[str, Any]) -> tuple[int, int]:
    heads = _int(cfg, "num_attention_heads")
    kv = _int(cfg, "num_key_value_heads", default=heads)
    key = "head_dim" if cfg.get("head_dim") is not None else "attention_head_dim"
    hd = _int(cfg, key, default=None)
    if hd is None:
        hidden = _int(cfg, "hidden_size")
        if hidden % heads:
            raise ModelConfigError(f"config.json: hidden_size {hidden} is not a multiple of "
                                   f"num_attention_heads {heads} (and there is no head_dim)")
        hd = hidden // heads
    return kv, hd


def _parse_layers_and_mixer(cfg: Mapping[str, Any], mt: str
                            ) -> tuple[int, tuple[int, ...], tuple[int, ...], MixerDims]:
    # conv kernels: a kernel of k taps keeps k - 1 past inputs, so k >= 2 for any state
    if mt.startswith("qwen3_next") or mt == "qwen3_5":
        n = _int(cfg, "num_hidden_layers", high=MAX_LAYERS)
        if cfg.get("layer_types") is not None:
            att, mam = _pattern_layers(cfg["layer_types"], "layer_types", n, QWEN_LAYER_TYPES)
        else:
            every = _int(cfg, "full_attention_interval")
            att = tuple(i for i in range(n) if (i + 1) % every == 0)
            mam = tuple(i for i in range(n) if (i + 1) % every)
        mixer: MixerDims = GatedDeltaNetDims(
            _int(cfg, "linear_num_key_heads"), _int(cfg, "linear_num_value_heads"),
            _int(cfg, "linear_key_head_dim"), _int(cfg, "linear_value_head_dim"),
            _int(cfg, "linear_conv_kernel_dim", low=2))
        return n, att, mam, mixer
    if mt == "nemotron_h":
        pattern = _get(cfg, "hybrid_override_pattern")
        if not isinstance(pattern, str):
            raise ModelConfigError(f"config.json: hybrid_override_pattern must be a string, got {pattern!r}")
        n = _int(cfg, "num_hidden_layers", high=MAX_LAYERS, default=len(pattern))
        att, mam = _pattern_layers(list(pattern), "hybrid_override_pattern", n, NEMOTRON_LETTERS)
        mixer = Mamba2Dims(_int(cfg, "mamba_num_heads"), _int(cfg, "mamba_head_dim"),
                           _int(cfg, "ssm_state_size"), _int(cfg, "n_groups"),
                           _int(cfg, "conv_kernel", low=2))
        return n, att, mam, mixer
    if mt in ("granitemoehybrid", "falcon_h1"):
        n = _int(cfg, "num_hidden_layers", high=MAX_LAYERS)
        if mt == "falcon_h1":  # attention and Mamba2 side by side in every layer
            att = mam = tuple(range(n))
        else:
            key = "layer_types" if cfg.get("layer_types") is not None else "layers_block_type"
            att, mam = _pattern_layers(_get(cfg, "layer_types", "layers_block_type"), key, n, BLOCK_TYPES)
        mixer = Mamba2Dims(_int(cfg, "mamba_n_heads"), _int(cfg, "mamba_d_head"),
                           _int(cfg, "mamba_d_state"), _int(cfg, "mamba_n_groups"),
                           _int(cfg, "mamba_d_conv", low=2))
        d_ssm = _int(cfg, "mamba_d_ssm", default=None)
        if d_ssm is not None and d_ssm != mixer.n_heads * mixer.head_dim:
            raise ModelConfigError(f"config.json: mamba_d_ssm {d_ssm} != mamba_n_heads x mamba_d_head "
                                   f"= {mixer.n_heads * mixer.head_dim}")
        return n, att, mam, mixer
    if mt == "mamba2":
        n = _int(cfg, "num_hidden_layers", high=MAX_LAYERS)
        mixer = Mamba2Dims(_int(cfg, "num_heads"), _int(cfg, "head_dim"), _int(cfg, "state_size"),
                           _int(cfg, "n_groups"), _int(cfg, "conv_kernel", low=2))
        return n, (), tuple(range(n)), mixer
    if mt == "mamba":
        n = _int(cfg, "num_hidden_layers", high=MAX_LAYERS)
        d_inner, d_state = _int(cfg, "intermediate_size"), _int(cfg, "state_size")
        return n, (), tuple(range(n)), Mamba1Dims(d_inner, d_state, _int(cfg, "conv_kernel", low=2))
    if mt == "jamba":
        n = _int(cfg, "num_hidden_layers", high=MAX_LAYERS)
        if cfg.get("layers_block_type") is not None:
            att, mam = _pattern_layers(cfg["layers_block_type"], "layers_block_type", n, BLOCK_TYPES)
        else:
            period, offset = _int(cfg, "attn_layer_period"), _int(cfg, "attn_layer_offset", low=0)
            if offset >= period:
                raise ModelConfigError(f"config.json: attn_layer_offset {offset} must be < "
                                       f"attn_layer_period {period}")
            att = tuple(i for i in range(n) if i % period == offset)
            mam = tuple(i for i in range(n) if i % period != offset)
        d_inner = _int(cfg, "mamba_expand") * _int(cfg, "hidden_size")
        mixer = Mamba1Dims(d_inner, _int(cfg, "mamba_d_state"), _int(cfg, "mamba_d_conv", low=2))
        return n, att, mam, mixer
    if mt == "mamba_ssm":  # state-spaces checkpoints; defaults of mamba_ssm's Mamba / Mamba2
        n, d_model = _int(cfg, "n_layer", high=MAX_LAYERS), _int(cfg, "d_model")
        ssm = _mapping(cfg, "ssm_cfg")
        idx = _get(cfg, "attn_layer_idx", default=[])
        if not isinstance(idx, list) or any(type(i) is not int or not 0 <= i < n for i in idx) \
                or len(set(idx)) != len(idx):
            raise ModelConfigError(f"config.json: attn_layer_idx must list distinct layer indices in "
                                   f"0 .. {n - 1}, got {idx!r}")
        att = tuple(sorted(idx))
        mam = tuple(i for i in range(n) if i not in set(att))

        def ssm_int(key: str, default: int, low: int = 1) -> int:
            return _int(ssm, key, low=low, default=default, within="ssm_cfg")

        expand, d_conv = ssm_int("expand", 2), ssm_int("d_conv", 4, low=2)
        layer = ssm.get("layer", "Mamba1")
        if layer == "Mamba2":
            head_dim = ssm_int("headdim", 64)
            if expand * d_model % head_dim:
                raise ModelConfigError(f"config.json: expand x d_model = {expand * d_model} is not a "
                                       f"multiple of ssm_cfg.headdim {head_dim}")
            mixer = Mamba2Dims(expand * d_model // head_dim, head_dim, ssm_int("d_state", 128),
                               ssm_int("ngroups", 1), d_conv)
        elif layer == "Mamba1":
            mixer = Mamba1Dims(expand * d_model, ssm_int("d_state", 16), d_conv)
        else:
            raise ModelConfigError(f"config.json: ssm_cfg.layer is {layer!r}; known: 'Mamba1', 'Mamba2'")
        return n, att, mam, mixer
    raise ModelConfigError(f"unsupported model_type {mt!r}")


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
    n, att, mam, mixer = _parse_layers_and_mixer(cfg, mt)
    if not mam:
        raise ModelConfigError("config.json: no Mamba / linear-attention layer; not a hybrid model")
    kv, hd = _attention_dims(cfg) if att and mt != "mamba_ssm" else (0, 0)
    if mt == "mamba_ssm" and att:
        acfg = _mapping(cfg, "attn_cfg")
        kv_key = "num_heads_kv" if acfg.get("num_heads_kv") is not None else "num_heads"
        kv, hd = _int(acfg, kv_key, within="attn_cfg"), _int(acfg, "head_dim", within="attn_cfg")
    try:
        dtype = dtype_name(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        ssm_dtype = dtype_name(cfg.get("mamba_ssm_dtype") or dtype)
    except Exception as e:  # InvalidSpecError from dtype_name
        raise ModelConfigError(f"config.json: {e}") from None
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
