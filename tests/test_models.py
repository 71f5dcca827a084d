"""Model configs -> state shapes, per-request bytes, block sizes and KV-cache configs.

Every expected number is worked out by hand in a comment from DESIGN.md 7's formulas and the
packaged config values, not copied from the code's output.
"""

from __future__ import annotations

import json

import pytest

from mambakv.core.errors import InvalidSpecError, ModelConfigError
from mambakv.core.spec import FullAttentionSpec, MambaCacheMode, MambaSpec
from mambakv.models import (
    LayerKind,
    build_kv_cache_config,
    format_models_table,
    list_models,
    load_model,
    model_info,
    parse_config,
    plan_pages,
)
from mambakv.models.registry import packaged_config

MIB = 1 << 20
PACKAGED = ["falcon-h1-7b", "granite-4.0-h-small", "jamba-v0.1", "mamba2-2.7b",
            "nemotron-h-8b", "qwen3-next-80b-a3b", "qwen3.5-4b"]


def test_packaged_names_and_sources():
    assert list_models() == PACKAGED
    for name in PACKAGED:
        cfg = packaged_config(name)
        assert cfg["_sources"] and all(isinstance(v, str) and v for v in cfg["_sources"].values())


def test_unknown_model_lists_known_names():
    with pytest.raises(ModelConfigError, match="qwen3-next-80b-a3b"):
        load_model("no-such-model")


def test_load_from_path(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(packaged_config("jamba-v0.1")))
    by_dir, by_file = load_model(tmp_path), load_model(str(tmp_path / "config.json"))
    assert by_dir.mamba_layers == by_file.mamba_layers == load_model("Jamba-v0.1").mamba_layers


def test_qwen3_next_states_and_layout():
    m = load_model("qwen3-next-80b-a3b")
    # full attention when (i + 1) % 4 == 0: layers 3, 7, ..., 47 -> 12 attention, 36 GDN.
    assert m.attention_layers == tuple(range(3, 48, 4))
    assert len(m.mamba_layers) == 36 and m.layer_kinds[3] == (LayerKind.ATTENTION,)
    # conv: (4 - 1, 2*16*128 + 32*128 = 8192); SSM: (32 value heads, 128, 128).
    assert m.state_shapes() == ((3, 8192), (32, 128, 128))
    # bf16: 3*8192*2 = 49,152 + 32*128*128*2 = 1,048,576 -> 1,097,728 B per layer.
    assert m.state_page_bytes() == 1_097_728
    # x 36 layers = 39,518,208 B = 37.69 MiB.
    assert m.state_bytes_per_request() == 36 * 1_097_728
    assert round(m.state_bytes_per_request() / MIB, 1) == 37.7
    # float32 SSM: 49,152 + 2,097,152 = 2,146,304 B per layer x 36 = 73.69 MiB.
    assert m.state_page_bytes(ssm_dtype="float32") == 2_146_304
    assert round(m.state_bytes_per_request(ssm_dtype="float32") / MIB, 1) == 73.7
    # attention: 2 (K, V) x 2 KV heads x 256 x 2 B = 2048 B per token per layer.
    assert m.attention_bytes_per_token() == 2048
    plan = plan_pages(m)
    # 1,097,728 / 2048 = 536 tokens -> next multiple of 16 = 544; page 544 x 2048 = 1,114,112.
    assert (plan.block_size, plan.page_size_bytes) == (544, 1_114_112)
    # groups of 12: 1 attention + 3 GDN; 12 x 1,114,112 = 13,369,344 B per block id.
    assert plan.group_size == 12 and plan.bytes_per_block == 13_369_344
    # float32 SSM: 2,146,304 / 2048 = 1048 -> 1056.
    assert plan_pages(m, ssm_dtype="float32").block_size == 1056


def test_qwen3_next_kv_cache_config():
    gib = 1 << 30
    cfg = build_kv_cache_config("qwen3-next-80b-a3b", 10 * gib, num_speculative_blocks=2)
    # 10 GiB // 13,369,344 B = 10,737,418,240 // 13,369,344 = 803 blocks.
    assert cfg.num_blocks == 803
    assert len(cfg.kv_cache_groups) == 4
    attn, *mamba = cfg.kv_cache_groups
    assert isinstance(attn.kv_cache_spec, FullAttentionSpec)
    assert attn.kv_cache_spec.block_size == 544 and attn.kv_cache_spec.page_size_bytes == 1_114_112
    assert len(attn.layer_names) == 12
    for g, group in enumerate(mamba):
        spec = group.kv_cache_spec
        assert isinstance(spec, MambaSpec)
        assert (spec.block_size, spec.mode, spec.num_speculative_blocks) == \
            (544, MambaCacheMode.ALIGN, 2)
        assert spec.page_size_bytes == 1_114_112 and spec.raw_page_size_bytes == 1_097_728
        # round robin: GDN layer j of the 36 goes to group j mod 3; GDN layers are 0,1,2,4,5,6,..
        gdn = [i for i in range(48) if (i + 1) % 4]
        assert group.layer_names == [f"model.layers.{i}.mamba" for i in gdn[g::3]]
    # group 0 takes GDN indices 0, 3, 6 = layers 0, 4, 8 (layer 3 and 7 are attention).
    assert mamba[0].layer_names[:3] == ["model.layers.0.mamba", "model.layers.4.mamba",
                                        "model.layers.8.mamba"]


def test_qwen3_5_4b_float32_ssm_block():
    m = load_model("qwen3.5-4b")
    # text_config: 32 layers, 8 x (3 linear + 1 full) -> 8 attention, 24 GDN; ssm float32.
    assert (len(m.attention_layers), len(m.mamba_layers)) == (8, 24)
    assert m.state_dtypes() == ("bfloat16", "float32")
    # page: 3*8192*2 + 32*128*128*4 = 49,152 + 2,097,152 = 2,146,304 B.
    assert m.state_page_bytes() == 2_146_304
    # attention 2 x 4 KV heads x 256 x 2 B = 4096 B/token: 2,146,304 / 4096 = 524 -> 528.
    assert m.attention_bytes_per_token() == 4096
    assert plan_pages(m).block_size == 528


@pytest.mark.parametrize("name,mamba_layers,bf16_mib,fp32_mib", [
    # Nemotron-H-8B: 128 heads x 64, d_state 128, 8 groups: conv (3, 8192 + 2*8*128 = 10240)
    # = 61,440 B; SSM 128*64*128*2 = 2,097,152 B; x 24 = 51,806,208 B = 49.41 MiB.
    # fp32: 61,440 + 4,194,304 = 4,255,744 x 24 = 102,137,856 B = 97.41 MiB.
    ("nemotron-h-8b", 24, 49.4, 97.4),
    # Falcon-H1-7B: 24 heads x 128, d_state 256, 1 group: conv (3, 3072 + 512 = 3584) =
    # 21,504 B; SSM 24*128*256*2 = 1,572,864 B; x 44 = 70,152,192 B = 66.90 MiB.
    # fp32: 21,504 + 3,145,728 = 3,167,232 x 44 = 139,358,208 B = 132.90 MiB.
    ("falcon-h1-7b", 44, 66.9, 132.9),
    # Granite-4.0-H-Small: 128 heads x 64 = 8192, d_state 128, 1 group: conv (3, 8448) =
    # 50,688 B; SSM 2,097,152 B; x 36 = 77,322,240 B = 73.74 MiB.
    # fp32: 50,688 + 4,194,304 = 4,244,992 x 36 = 152,819,712 B = 145.74 MiB.
    ("granite-4.0-h-small", 36, 73.7, 145.7),
    # Jamba v0.1: Mamba1 d_inner 2 x 4096 = 8192, d_state 16: conv (3, 8192) = 49,152 B;
    # SSM 8192*16*2 = 262,144 B; x 28 = 8,716,288 B = 8.31 MiB.
    # fp32: 49,152 + 524,288 = 573,440 x 28 = 16,056,320 B = 15.31 MiB.
    ("jamba-v0.1", 28, 8.3, 15.3),
    # Mamba2-2.7B: 2 x 2560 = 5120 = 80 heads x 64, d_state 128, 1 group: conv (3, 5376) =
    # 32,256 B; SSM 80*64*128*2 = 1,310,720 B; x 64 = 85,950,464 B = 81.97 MiB.
    # fp32: 32,256 + 2,621,440 = 2,653,696 x 64 = 169,836,544 B = 161.97 MiB.
    ("mamba2-2.7b", 64, 82.0, 162.0),
])
def test_per_request_state_bytes(name, mamba_layers, bf16_mib, fp32_mib):
    m = load_model(name)
    assert len(m.mamba_layers) == mamba_layers
    assert round(m.state_bytes_per_request() / MIB, 1) == bf16_mib
    assert round(m.state_bytes_per_request(ssm_dtype="float32") / MIB, 1) == fp32_mib


def test_layer_patterns():
    nem = load_model("nemotron-h-8b")
    # "M-M-M-M*-..." : attention at the '*' positions 7, 18, 29, 40; 24 M; 24 MLP-only.
    assert nem.attention_layers == (7, 18, 29, 40) and nem.num_hidden_layers == 52
    assert sum(1 for k in nem.layer_kinds if k == ()) == 24
    jam = load_model("jamba-v0.1")
    assert jam.attention_layers == (4, 12, 20, 28)  # i % 8 == 4
    assert jam.state_shapes() == ((3, 8192), (8192, 16))
    fal = load_model("falcon-h1-7b")
    assert fal.layer_kinds[0] == (LayerKind.ATTENTION, LayerKind.MAMBA)
    assert load_model("mamba2-2.7b").attention_layers == ()


def test_groups_and_blocks_of_other_models():
    # Nemotron-H: 4 attention / 24 Mamba -> group size 4: 1 + 6 groups.  Attention
    # 2 x 8 x 128 x 2 = 4096 B/token; page 2,158,592 / 4096 = 527.0 -> 528 tokens.
    cfg = build_kv_cache_config("nemotron-h-8b", 1 << 30)
    assert len(cfg.kv_cache_groups) == 7
    assert {len(g.layer_names) for g in cfg.kv_cache_groups} == {4}
    assert cfg.kv_cache_groups[1].kv_cache_spec.block_size == 528
    # 1 GiB // (4 x 528 x 4096 = 8,650,752) = 124.
    assert cfg.num_blocks == 124
    # Falcon-H1: 44 and 44 -> one attention group and one Mamba group of 44.  Attention
    # 2 x 2 x 128 x 2 = 1024 B/token; 1,594,368 / 1024 = 1557 -> 1568 tokens.
    fal = build_kv_cache_config("falcon-h1-7b", 1 << 30)
    assert [len(g.layer_names) for g in fal.kv_cache_groups] == [44, 44]
    assert fal.kv_cache_groups[0].kv_cache_spec.block_size == 1568
    # Pure Mamba2-2.7B: no attention page; block = mamba_block_size, page = raw 1,342,976 B;
    # one group of 64 layers; 1 GiB // (64 x 1,342,976) = 12.
    mam = build_kv_cache_config("mamba2-2.7b", 1 << 30, mamba_block_size=4096)
    (g,) = mam.kv_cache_groups
    assert g.kv_cache_spec.block_size == 4096 and g.kv_cache_spec.page_size_bytes == 1_342_976
    assert mam.num_blocks == 12


def test_group_size_rule_largest_below_1_5x():
    # 10 attention / 14 Mamba layers: 14 < 1.5 x 10 -> group size 14; attention group of 10.
    cfg = dict(packaged_config("qwen3-next-80b-a3b"), num_hidden_layers=24,
               layer_types=["full_attention"] * 10 + ["linear_attention"] * 14)
    plan = plan_pages(parse_config(cfg))
    assert plan.group_size == 14
    assert [len(g) for g in plan.attention_groups + plan.mamba_groups] == [10, 14]


def test_tensor_parallel_shapes():
    q = load_model("qwen3-next-80b-a3b")
    # TP 2: 8 key / 16 value heads: conv (3, 2*8*128 + 16*128 = 4096), SSM (16, 128, 128).
    assert q.state_shapes(2) == ((3, 4096), (16, 128, 128))
    # 2 KV heads at TP 4: replicated, 1 head per rank.
    assert q.kv_heads_per_rank(4) == 1 and q.kv_heads_per_rank(2) == 1
    nem = load_model("nemotron-h-8b")
    # TP 4: 32 heads x 64 = 2048 + 2 x (8 / 4 = 2 groups) x 128 = 2560.
    assert nem.state_shapes(4) == ((3, 2560), (32, 64, 128))
    # TP 16: 8 groups not divisible -> replicated, 1 group per rank: 8 x 64 + 2 x 128 = 768.
    assert nem.state_shapes(16) == ((3, 768), (8, 64, 128))
    # Mamba2-2.7B TP 4: 20 heads x 64 = 1280 + 2 x 1 x 128 = 1536 (the one group replicated).
    assert load_model("mamba2-2.7b").state_shapes(4) == ((3, 1536), (20, 64, 128))
    # Jamba TP 2: d_inner 4096 per rank.
    assert load_model("jamba-v0.1").state_shapes(2) == ((3, 4096), (4096, 16))
    with pytest.raises(ModelConfigError):
        q.state_shapes(3)  # 16 key heads / 3
    cfg = build_kv_cache_config(q, 1 << 30, tp_size=2)
    # TP 2 page: 3*4096*2 + 16*128*128*2 = 24,576 + 524,288 = 548,864 B; attention 1 KV head:
    # 2 x 1 x 256 x 2 = 1024 B/token -> 536 -> 544 tokens, page 557,056 B.
    assert cfg.kv_cache_groups[0].kv_cache_spec.block_size == 544
    assert cfg.kv_cache_groups[1].kv_cache_spec.page_size_bytes == 557_056


def test_modes_and_errors():
    cfg = build_kv_cache_config("jamba-v0.1", 1 << 30, mamba_mode="none", max_model_len=8192)
    spec = cfg.kv_cache_groups[-1].kv_cache_spec
    assert spec.mode is MambaCacheMode.NONE and spec.block_size == 8192
    with pytest.raises(InvalidSpecError):  # fewer than 2 blocks fit
        build_kv_cache_config("qwen3-next-80b-a3b", 13_369_344)
    with pytest.raises(ModelConfigError):
        parse_config({"model_type": "llama", "num_hidden_layers": 2})
    with pytest.raises(ModelConfigError):
        parse_config({"model_type": "jamba", "num_hidden_layers": 4})  # missing fields


def test_model_info_and_table():
    info = model_info("qwen3-next-80b-a3b")
    assert (info.block_size, info.page_size_bytes, info.group_size, info.num_groups) == \
        (544, 1_114_112, 12, 4)
    # 1 GiB // 13,369,344 = 80 blocks.
    assert info.bytes_per_block == 13_369_344 and info.blocks_per_gib == 80
    assert info.state_bytes_per_request == 39_518_208 and info.mixer == "gdn"
    table = format_models_table()
    assert len(table.splitlines()) == 2 + len(PACKAGED)
    assert "qwen3-next-80b-a3b" in table and "37.7" in table


def test_pattern_must_cover_every_layer():
    # "M-M*": Mamba at 0 and 2, an MLP-only layer at 1, attention at 3.
    cfg = dict(packaged_config("nemotron-h-8b"), hybrid_override_pattern="M-M*", num_hidden_layers=4)
    m = parse_config(cfg)
    assert (m.num_hidden_layers, m.attention_layers, m.mamba_layers) == (4, (3,), (0, 2))
    del cfg["num_hidden_layers"]  # absent: the pattern's length
    assert parse_config(cfg).num_hidden_layers == 4
    with pytest.raises(ModelConfigError, match="hybrid_override_pattern has 4 layers, num_hidden_layers is 52"):
        parse_config(dict(cfg, num_hidden_layers=52))
    # the packaged 52-layer model at 60 GiB: block 528 x 4096 B/token = 2,162,688 B pages,
    # groups of 4 -> 8,650,752 B (8.25 MiB) per block, 64,424,509,440 // that = 7,447 blocks
    assert build_kv_cache_config("nemotron-h-8b", 60 << 30).num_blocks == 7_447


# --------------------------------------------------------------------------- context length (issue 31)
@pytest.mark.parametrize("name, tokens", [
    # max_position_embeddings of each public config.json (the packaged file's _sources say where)
    ("qwen3-next-80b-a3b", 262_144), ("qwen3.5-4b", 262_144), ("falcon-h1-7b", 262_144),
    ("jamba-v0.1", 262_144), ("granite-4.0-h-small", 131_072), ("nemotron-h-8b", 8_192),
    ("mamba2-2.7b", None),  # a mamba_ssm checkpoint has no position limit
])
def test_packaged_context_lengths(name, tokens):
    from mambakv.sim.runner import DEFAULT_MAX_MODEL_LEN, model_max_len

    assert load_model(name).max_position_embeddings == tokens
    assert model_max_len(name) == (tokens or DEFAULT_MAX_MODEL_LEN)
    if tokens is not None:
        cfg = packaged_config(name)
        inner = cfg.get("text_config", cfg)  # Qwen3.5 keeps it in text_config
        assert inner["max_position_embeddings"] == tokens
        key = "text_config.max_position_embeddings" if "text_config" in cfg else "max_position_embeddings"
        assert cfg["_sources"][key]


@pytest.mark.parametrize("value", ["8k", 8192.0, 0, True])
def test_bad_context_length_is_refused(value):
    cfg = packaged_config("qwen3-next-80b-a3b")
    cfg["max_position_embeddings"] = value
    with pytest.raises(ModelConfigError, match="max_position_embeddings"):
        parse_config(cfg)
