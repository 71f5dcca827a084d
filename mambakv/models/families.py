"""Per-family readers of a Hugging Face ``config.json``: which layers keep attention KV, which
keep a Mamba state, and the mixer's dimensions.

Families (``model_type``): ``qwen3_next`` and ``qwen3_5*`` (gated DeltaNet), ``nemotron_h``,
``granitemoehybrid``, ``falcon_h1``, ``mamba2`` (Mamba2), ``jamba``, ``mamba`` (Mamba1), and
``mamba_ssm`` (state-spaces checkpoints: ``d_model`` / ``n_layer`` / ``ssm_cfg``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar, overload

from mambakv.core.errors import ModelConfigError
from mambakv.models.mixers import GatedDeltaNetDims, Mamba1Dims, Mamba2Dims, MixerDims

__all__ = ["BLOCK_TYPES", "CONTEXT_LENGTH_KEYS", "MAX_LAYERS", "NEMOTRON_LETTERS", "QWEN_LAYER_TYPES",
           "attention_dims", "context_length", "parse_layers_and_mixer"]

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
#: The key of the model's own context length (tokens) per family: every transformers family
#: above spells it ``max_position_embeddings`` (Qwen3.5 inside ``text_config``, merged first);
#: a ``mamba_ssm`` checkpoint (state-spaces/*) has none: an SSM has no position limit.
CONTEXT_LENGTH_KEYS: dict[str, str | None] = {
    "qwen3_next": "max_position_embeddings", "qwen3_5": "max_position_embeddings",
    "nemotron_h": "max_position_embeddings", "granitemoehybrid": "max_position_embeddings",
    "falcon_h1": "max_position_embeddings", "mamba2": "max_position_embeddings",
    "mamba": "max_position_embeddings", "jamba": "max_position_embeddings", "mamba_ssm": None,
}


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


def attention_dims(cfg: Mapping[str, Any], mt: str) -> tuple[int, int]:
    """``(num_kv_heads, head_dim)`` of the attention layers of a config of model type `mt`
    (``mamba_ssm`` configs keep them in ``attn_cfg``)."""
    if mt == "mamba_ssm":
        acfg = _mapping(cfg, "attn_cfg")
        kv_key = "num_heads_kv" if acfg.get("num_heads_kv") is not None else "num_heads"
        return _int(acfg, kv_key, within="attn_cfg"), _int(acfg, "head_dim", within="attn_cfg")
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


def context_length(cfg: Mapping[str, Any], mt: str) -> int | None:
    """The model's own context length (tokens) from its family's key (CONTEXT_LENGTH_KEYS), or
    None when the config has none (``mambakv trace`` then uses its default max_model_len).

    Raises:
        ModelConfigError: the key is there but not a JSON integer >= 1.
    """
    key = CONTEXT_LENGTH_KEYS.get("qwen3_next" if mt.startswith("qwen3_next") else mt, "max_position_embeddings")
    return None if key is None else _int(cfg, key, default=None)


def parse_layers_and_mixer(cfg: Mapping[str, Any], mt: str
                           ) -> tuple[int, tuple[int, ...], tuple[int, ...], MixerDims]:
    """``(num_hidden_layers, attention layer indices, Mamba layer indices, mixer dims)`` of a
    config of model type `mt` (``qwen3_5*`` already folded into ``qwen3_5``).

    Raises:
        ModelConfigError: an unsupported `mt`, or a field of its family missing or malformed.
    """
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
