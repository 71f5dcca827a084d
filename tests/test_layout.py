"""Hybrid memory layout: raw tensors shared by groups, per-layer views, block isolation."""

from __future__ import annotations

import pytest
import torch

from mambakv.core.errors import InvalidSpecError
from mambakv.core.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
from mambakv.device.layout import HybridLayout
from mambakv.models import build_kv_cache_config

# Attention page: 2 (K, V) x 4 tokens x 2 heads x 8 dims x 2 B = 256 B per block per layer.
ATTN = FullAttentionSpec(4, num_kv_heads=2, head_size=8, dtype="bfloat16")
# Mamba: conv 3 x 8 bf16 = 48 B + SSM 2 x 4 x 4 fp32 = 128 B = 176 B, padded to 256 B.
MAMBA = MambaSpec(4, ((3, 8), (2, 4, 4)), ("bfloat16", "float32"), page_size_padded=256)
NUM_BLOCKS = 6


def config() -> KVCacheConfig:
    return KVCacheConfig(NUM_BLOCKS, [
        KVCacheGroupSpec(["a0", "a1"], ATTN),
        KVCacheGroupSpec(["m0", "m1"], MAMBA),
        KVCacheGroupSpec(["m2", "m3"], MAMBA),
    ])


def test_raw_tensors_and_views():
    lay = HybridLayout(config(), "cpu")
    assert lay.group_size == 2 and lay.page_size_bytes == 256
    assert len(lay.raw) == 2 and all(r.shape == (NUM_BLOCKS, 256) for r in lay.raw)
    assert lay.bytes_per_block == 2 * 256  # a block id costs group_size x page
    assert lay.total_bytes == NUM_BLOCKS * 512
    kv = lay.kv_cache("a1")
    assert kv.shape == (NUM_BLOCKS, 2, 4, 2, 8) and kv.dtype == torch.bfloat16
    conv, ssm = lay.mamba_states("m3")
    assert conv.shape == (NUM_BLOCKS, 3, 8) and conv.dtype == torch.bfloat16
    assert ssm.shape == (NUM_BLOCKS, 2, 4, 4) and ssm.dtype == torch.float32
    assert lay.layer_slot("m3") == (2, 1) and lay.mamba_group_ids() == [1, 2]
    with pytest.raises(InvalidSpecError):
        lay.kv_cache("m0")
    with pytest.raises(InvalidSpecError):
        lay.mamba_states("a0")
    with pytest.raises(InvalidSpecError):
        lay.kv_cache("nope")


def test_i_th_layers_of_all_groups_alias_raw_tensor_i():
    lay = HybridLayout(config(), "cpu")
    for name, i in (("a0", 0), ("m0", 0), ("m2", 0), ("a1", 1), ("m1", 1), ("m3", 1)):
        views = [lay.kv_cache(name)] if name.startswith("a") else list(lay.mamba_states(name))
        for v in views:
            assert v.untyped_storage().data_ptr() == lay.raw[i].untyped_storage().data_ptr()
    # a write through Mamba layer m2 (group 2, index 0) shows in attention layer a0's bytes
    lay.mamba_states("m2")[0][3].fill_(1.0)  # bf16 1.0 = 0x3F80
    assert lay.kv_cache("a0")[3].flatten()[0].item() == 1.0
    assert lay.raw[1].count_nonzero() == 0  # the other raw tensor is untouched


@pytest.mark.parametrize("name", ["a0", "a1", "m0", "m1", "m2", "m3"])
def test_writing_one_block_touches_only_its_row(name):
    lay = HybridLayout(config(), "cpu")
    gid, i = lay.layer_slot(name)
    b = 4
    views = [lay.kv_cache(name)] if name.startswith("a") else list(lay.mamba_states(name))
    for v in views:
        v[b].fill_(-2.5)
    changed = lay.raw[i].any(dim=1).nonzero().flatten().tolist()
    assert changed == [b]
    row = lay.raw[i][b]
    if name.startswith("a"):
        assert row.all()  # KV fills the whole 256 B page
    else:  # states fill bytes [0, 176); padding [176, 256) stays zero
        assert row[:176].count_nonzero() > 0 and row[176:].count_nonzero() == 0
    assert lay.raw[1 - i].count_nonzero() == 0


def test_state_pool_over_layout():
    lay = HybridLayout(config(), "cpu")
    pool = lay.state_pool(2)
    assert pool is lay.state_pool(2)
    assert pool.num_layers == 2 and pool.num_blocks == NUM_BLOCKS
    assert pool.bytes_per_block == 2 * 256
    assert pool.ssm_state(1).data_ptr() == lay.mamba_states("m3")[1].data_ptr()
    lay.mamba_states("m2")[1][2].fill_(7.0)
    lay.mamba_states("m3")[0][2].fill_(3.0)
    lay.kv_cache("a0")[5].fill_(9.0)  # block 5 belongs to the attention group
    pool.copy_([(2, 4)])
    assert torch.equal(lay.mamba_states("m2")[1][4], lay.mamba_states("m2")[1][2])
    assert torch.equal(lay.mamba_states("m3")[0][4], lay.mamba_states("m3")[0][2])
    assert (lay.kv_cache("a0")[5] == 9.0).all()  # other blocks untouched
    pool.zero_([2])
    assert lay.raw[0][2].count_nonzero() == 0 and lay.raw[1][2].count_nonzero() == 0
    pool.check_invariants()
    with pytest.raises(InvalidSpecError):
        lay.state_pool(0)  # an attention group
    with pytest.raises(InvalidSpecError):
        lay.state_pool(7)


def test_page_sizes_must_agree():
    unpadded = MambaSpec(4, MAMBA.shapes, MAMBA.dtypes)  # 176 B != 256 B
    bad = KVCacheConfig(4, [KVCacheGroupSpec(["a0"], ATTN), KVCacheGroupSpec(["m0"], unpadded)])
    with pytest.raises(InvalidSpecError):
        HybridLayout(bad, "cpu")
    with pytest.raises(InvalidSpecError):  # a layer in two groups: refused by KVCacheConfig itself
        KVCacheConfig(4, [KVCacheGroupSpec(["x"], ATTN), KVCacheGroupSpec(["x"], MAMBA)])


def test_qwen3_next_layout_block_cost():
    # 13,369,344 B per block id (12 layers x 544 tokens x 2048 B); 3 blocks of memory.
    cfg = build_kv_cache_config("qwen3-next-80b-a3b", 3 * 13_369_344 + 5)
    lay = HybridLayout(cfg, "cpu")
    assert lay.num_blocks == 3 and lay.group_size == 12
    assert lay.bytes_per_block == 13_369_344
    assert lay.kv_cache("model.layers.3.self_attn").shape == (3, 2, 544, 2, 256)
    conv, ssm = lay.mamba_states("model.layers.0.mamba")
    assert conv.shape == (3, 3, 8192) and ssm.shape == (3, 32, 128, 128)
    pool = lay.state_pool(1)
    assert pool.num_layers == 12 and pool.bytes_per_block == 13_369_344
    pool.ssm_state(11)[1].fill_(1.0)
    pool.copy_([(1, 2)])
    assert bool((pool.ssm_state(11)[2] == 1.0).all())
    pool.check_invariants()
