"""Bad input on the decoupled layout's and the placement's entry points: a MambaKVError
subclass, raised before anything changes (found by trying the documented calls as a new user)."""

from __future__ import annotations

import pytest
import torch

from mambakv import InvalidRequestError, InvalidSpecError, InvalidTokenCountError, KVCacheCoordinator, Request
from mambakv.core.errors import InvalidCopyPlanError
from mambakv.device.decoupled import DecoupledLayout
from mambakv.device.layout import HybridLayout
from mambakv.models import build_kv_cache_config

QWEN = "qwen3-next-80b-a3b"


def coordinator(**kw) -> KVCacheCoordinator:
    return KVCacheCoordinator(build_kv_cache_config(QWEN, 1 << 30, layout="decoupled"), max_model_len=8192, **kw)


@pytest.mark.parametrize("call", [
    lambda kv: kv.next_chunk_end("r", 100),
    lambda kv: kv.next_chunk_end(None, 100),
    lambda kv: kv.can_allocate("r", 10),
    lambda kv: kv.get_shared_prefix_length("r"),
])
def test_a_non_request_is_an_invalid_request(call):
    kv = coordinator()
    with pytest.raises(InvalidRequestError):
        call(kv)
    kv.check_invariants()


def test_can_allocate_refuses_more_than_max_model_len_as_allocate_does():
    kv = coordinator()
    req = Request("r", list(range(100)))
    for ask in (kv.can_allocate, kv.allocate):
        with pytest.raises(InvalidTokenCountError, match="max_model_len"):
            ask(req, 9000)
    assert kv.can_allocate(req, 100) and kv.num_running_requests == 0


def test_placement_names_given_as_one_string_or_not_names():
    assert coordinator(checkpoint_placement="junction,replay_boundary").checkpoint_placement.names == (
        "junction", "replay_boundary")
    assert coordinator(checkpoint_placement="junction").checkpoint_placement.names == ("junction",)
    for bad in (5, ["junction", "junction"]):
        with pytest.raises(InvalidSpecError):
            coordinator(checkpoint_placement=bad)


@pytest.mark.parametrize("memory", ["4G", 1.5e9, -1, 0, True])
def test_memory_bytes_must_be_a_positive_int(memory):
    with pytest.raises(InvalidSpecError, match="memory_bytes"):
        build_kv_cache_config(QWEN, memory, layout="decoupled")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch build or machine without CUDA")
@pytest.mark.parametrize("layout", ["unified", "decoupled"])
def test_cuda_without_cuda_is_an_invalid_spec(layout):
    cfg = build_kv_cache_config(QWEN, 1 << 30, layout=layout)
    with pytest.raises(InvalidSpecError, match="no CUDA"):
        (DecoupledLayout if layout == "decoupled" else HybridLayout)(cfg, device="cuda")


def test_the_null_slot_is_never_a_copy_source_in_the_decoupled_layout():
    # Slot 0's row is superblock 0, which holds attention pages (page 1 .. k - 1 are live memory):
    # copying from it would hand a request page bytes as a state. The unified null row stays a
    # valid (all-zero) source, as before.
    cfg = build_kv_cache_config(QWEN, 1 << 30, layout="decoupled")
    pool = DecoupledLayout(cfg, device="cpu").state_pool(1)
    with pytest.raises(InvalidCopyPlanError, match="null slot 0"):
        pool.copy_([(0, 3)])
    pool.copy_([(2, 3)])
