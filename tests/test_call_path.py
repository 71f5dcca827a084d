"""How far one call reaches: following ``allocate`` of a new hybrid request with a prefix hit
(Qwen3-Next-80B-A3B's shape: 1 full-attention + 3 GDN groups, 2 draft tokens of scratch, the
unified layout's 544-token block) with ``sys.setprofile`` enters at most 8 library files in
the unified layout and 11 in the decoupled one (files with a called function; error classes do
not count). A newcomer following the step reads that many files, not the 17 of 0.1's mixins."""

from __future__ import annotations

import sys
from collections import Counter

import pytest

from mambakv import KVCacheCoordinator, Request
from mambakv.models import build_kv_cache_config


def files_entered(layout: str) -> Counter[str]:
    memory = 64 * 2**30 if layout == "unified" else 8 * 2**30
    cfg = build_kv_cache_config("qwen3-next-80b-a3b", memory, num_speculative_blocks=2, layout=layout)
    kv = KVCacheCoordinator(cfg, max_model_len=1 << 20)
    bs = kv.alignment_tokens
    prompt = list(range(5 * bs + 7))
    a = Request("a", prompt)
    done = 0
    for end in (2 * bs, 4 * bs, len(prompt)):
        assert kv.allocate(a, end - done, num_draft_tokens=0) is not None
        a.num_computed_tokens = done = end
        kv.retire("a", end)
    kv.free("a")
    b = Request("b", [*prompt, 1, 2, 3])
    blocks, n = kv.get_computed_blocks(b)
    assert n == 4 * bs
    files: Counter[str] = Counter()

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        name = frame.f_code.co_filename
        if event == "call" and "/mambakv/" in name and not name.endswith("/core/errors.py"):
            files[name.split("/mambakv/", 1)[1]] += 1

    sys.setprofile(profile)
    try:
        assert kv.allocate(b, 2 * bs, num_new_computed_tokens=n, new_computed_blocks=blocks,
                           num_draft_tokens=0) is not None
    finally:
        sys.setprofile(None)
    kv.check_invariants()
    return files


@pytest.mark.parametrize(("layout", "most"), [("unified", 8), ("decoupled", 11)])
def test_allocate_of_a_hit_enters_few_files(layout: str, most: int) -> None:
    files = files_entered(layout)
    assert {"coordinator.py", "groups/mamba.py", "core/block_pool.py"} <= set(files)
    assert len(files) <= most, sorted(files)
