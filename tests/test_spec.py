"""KV-cache specs: validation, modes, dtypes, page sizes by hand (mambakv/spec.py)."""

from __future__ import annotations

import pytest

from mambakv import (
    FullAttentionSpec,
    InvalidSpecError,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaCacheMode,
    MambaKVError,
    MambaSpec,
    SlidingWindowSpec,
)

SHAPES = ((3, 8), (2, 4, 4))
DTYPES = ("bfloat16", "float32")


def mamba(**kw) -> MambaSpec:
    args = {"block_size": 16, "shapes": SHAPES, "dtypes": DTYPES}
    args.update(kw)
    return MambaSpec(**args)


# ---------------------------------------------------------------------- invalid constructions

INVALID = {
    "fa block 0": lambda: FullAttentionSpec(0, 8, 128, "bfloat16"),
    "fa block -1": lambda: FullAttentionSpec(-1, 8, 128, "bfloat16"),
    "fa block bool": lambda: FullAttentionSpec(True, 8, 128, "bfloat16"),
    "fa block float": lambda: FullAttentionSpec(16.0, 8, 128, "bfloat16"),
    "fa heads 0": lambda: FullAttentionSpec(16, 0, 128, "bfloat16"),
    "fa head size -1": lambda: FullAttentionSpec(16, 8, -1, "bfloat16"),
    "fa dtype": lambda: FullAttentionSpec(16, 8, 128, "bfloat17"),
    "sw block 0": lambda: SlidingWindowSpec(0, 8, 128, "bfloat16", 64),
    "sw window 0": lambda: SlidingWindowSpec(16, 8, 128, "bfloat16", 0),
    "sw window -4": lambda: SlidingWindowSpec(16, 8, 128, "bfloat16", -4),
    "mamba block 0": lambda: mamba(block_size=0),
    "mamba block -1": lambda: mamba(block_size=-1),
    "nspec -1": lambda: mamba(num_speculative_blocks=-1),
    "nspec float": lambda: mamba(num_speculative_blocks=1.5),
    "more shapes than dtypes": lambda: mamba(dtypes=("bfloat16",)),
    "more dtypes than shapes": lambda: mamba(shapes=((3, 8),)),
    "no shapes": lambda: mamba(shapes=(), dtypes=()),
    "empty shape": lambda: mamba(shapes=((), (2, 4)), dtypes=DTYPES),
    "zero dim": lambda: mamba(shapes=((3, 0), (2, 4, 4))),
    "negative dim": lambda: mamba(shapes=((3, 8), (2, -4, 4))),
    "unknown dtype": lambda: mamba(dtypes=("bfloat16", "float31")),
    "unknown mode": lambda: mamba(mode="hybrid"),
    "mode int": lambda: mamba(mode=3),
    "padded below raw": lambda: mamba(page_size_padded=175),  # raw page is 176 B (see below)
    "group without layers": lambda: KVCacheGroupSpec([], FullAttentionSpec(16, 8, 128, "bfloat16")),
    "group without spec": lambda: KVCacheGroupSpec(["l0"], "full"),
    "group names a str": lambda: KVCacheGroupSpec("abc", FullAttentionSpec(16, 8, 128, "bfloat16")),  # not 3 layers
    "group names not strs": lambda: KVCacheGroupSpec([0, 1], FullAttentionSpec(16, 8, 128, "bfloat16")),
    "group names a set": lambda: KVCacheGroupSpec({"l0"}, FullAttentionSpec(16, 8, 128, "bfloat16")),
    "group layer twice": lambda: KVCacheGroupSpec(["l0", "l0"], FullAttentionSpec(16, 8, 128, "bfloat16")),
    "config layer in two groups": lambda: KVCacheConfig(10, [
        KVCacheGroupSpec(["l0", "l1"], FullAttentionSpec(16, 1, 8, "float16")),
        KVCacheGroupSpec(["l2", "l1"], FullAttentionSpec(16, 1, 8, "float16"))]),
    "config group not a group": lambda: KVCacheConfig(10, [FullAttentionSpec(16, 1, 8, "float16")]),
    "config 1 block": lambda: KVCacheConfig(1, [KVCacheGroupSpec(["l0"], FullAttentionSpec(16, 1, 8, "float16"))]),
    "config no groups": lambda: KVCacheConfig(10, []),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_construction_raises(case):
    with pytest.raises(InvalidSpecError) as e:
        INVALID[case]()
    assert isinstance(e.value, MambaKVError)


# ---------------------------------------------------------------------- modes and dtypes


@pytest.mark.parametrize("given, expected", [
    ("align", MambaCacheMode.ALIGN), ("ALIGN", MambaCacheMode.ALIGN), ("Align", MambaCacheMode.ALIGN),
    ("none", MambaCacheMode.NONE), ("NONE", MambaCacheMode.NONE),
    (MambaCacheMode.ALIGN, MambaCacheMode.ALIGN),
])
def test_mode_strings(given, expected):
    assert MambaCacheMode(given) is expected
    assert mamba(mode=given).mode is expected


def test_default_mode_is_none():
    assert mamba().mode is MambaCacheMode.NONE


def test_torch_dtypes_accepted():
    torch = pytest.importorskip("torch")
    fa = FullAttentionSpec(16, 8, 128, torch.float32)
    assert fa.dtype == "float32"
    m = mamba(dtypes=(torch.bfloat16, torch.float32))
    assert m.dtypes == ("bfloat16", "float32")
    assert m == mamba()  # same spec whether given by name or by torch dtype


# ---------------------------------------------------------------------- page sizes by hand


def test_full_attention_page_size():
    # K and V x 16 tokens x 8 heads x 128 dims x 2 bytes = 2 * 16 * 8 * 128 * 2 = 65,536 B
    assert FullAttentionSpec(16, 8, 128, "bfloat16").page_size_bytes == 65_536
    # float32: 4 bytes -> 131,072 B; fp8: 1 byte -> 32,768 B
    assert FullAttentionSpec(16, 8, 128, "float32").page_size_bytes == 131_072
    assert FullAttentionSpec(16, 8, 128, "float8_e4m3fn").page_size_bytes == 32_768
    # Qwen3-Next (DESIGN.md 7): 2 KV heads x 256, bf16, block 544: 2 * 544 * 2 * 256 * 2 = 1,114,112 B
    assert FullAttentionSpec(544, 2, 256, "bfloat16").page_size_bytes == 1_114_112


def test_sliding_window_page_size():
    # 2 * 32 tokens * 4 heads * 64 dims * 4 bytes = 65,536 B; the window does not change the page
    sw = SlidingWindowSpec(32, 4, 64, "float32", 128)
    assert sw.page_size_bytes == 65_536
    assert sw.sliding_window == 128


def test_mamba_page_size():
    # conv (3, 8) bf16 = 24 * 2 = 48 B; ssm (2, 4, 4) float32 = 32 * 4 = 128 B; total 176 B
    m = mamba()
    assert m.raw_page_size_bytes == 176 and m.page_size_bytes == 176
    assert mamba(page_size_padded=176).page_size_bytes == 176  # padding to exactly raw is allowed
    assert mamba(page_size_padded=256).page_size_bytes == 256
    assert mamba(page_size_padded=256).raw_page_size_bytes == 176
    # a Mamba2-like layer: conv (3, 64 + 2*1*16) bf16 = 3 * 96 * 2 = 576 B; ssm (4, 16, 16) fp32 =
    # 1024 * 4 = 4096 B; total 4672 B
    m2 = MambaSpec(64, ((3, 64 + 2 * 1 * 16), (4, 16, 16)), ("bfloat16", "float32"))
    assert m2.page_size_bytes == 4_672
    # Qwen3-Next GDN layer with bf16 states (DESIGN.md 7): conv (3, 2*16*128 + 32*128) = (3, 8192)
    # -> 3 * 8192 * 2 = 49,152 B; ssm (32, 128, 128) -> 524,288 * 2 = 1,048,576 B; sum 1,097,728 B
    gdn = MambaSpec(544, ((3, 8192), (32, 128, 128)), ("bfloat16", "bfloat16"))
    assert gdn.page_size_bytes == 1_097_728


@pytest.mark.parametrize("mode, nspec, blocks", [
    ("align", 0, 2), ("align", 3, 5), ("align", 5, 7),  # last + running state + nspec scratch
    ("none", 0, 1), ("none", 3, 4), ("none", 5, 6),  # running state + nspec scratch
])
def test_blocks_per_running_request(mode, nspec, blocks):
    m = mamba(mode=mode, num_speculative_blocks=nspec)
    assert m.blocks_per_running_request == blocks
    assert m.max_memory_usage_bytes(100_000) == blocks * 176  # independent of the length


def test_attention_max_memory_usage():
    fa = FullAttentionSpec(16, 8, 128, "bfloat16")
    assert fa.max_memory_usage_bytes(100) == 7 * 65_536  # cdiv(100, 16) = 7 blocks
    assert fa.max_memory_usage_bytes(96) == 6 * 65_536


def test_specs_are_frozen_and_comparable():
    a, b = FullAttentionSpec(16, 8, 128, "bfloat16"), FullAttentionSpec(16, 8, 128, "bfloat16")
    assert a == b and hash(a) == hash(b)
    assert a != FullAttentionSpec(16, 8, 128, "float16")
    with pytest.raises(AttributeError):
        a.block_size = 32  # frozen dataclass (FrozenInstanceError is an AttributeError)


def test_valid_config():
    group = KVCacheGroupSpec(["l0", "l1"], FullAttentionSpec(16, 8, 128, "bfloat16"))
    cfg = KVCacheConfig(2, [group])
    assert cfg.num_blocks == 2 and cfg.kv_cache_groups[0].layer_names == ["l0", "l1"]
