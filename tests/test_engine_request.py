"""An engine's own request (the EngineRequest protocol): the coordinator reads the engine's
token ids and block hashes as they are, never hashes a token itself, and its KV events carry
the engine's hashes. The engine here hashes with SHA-256 (not mambakv's xxh3), so a hash the
library computed could never match one of the engine's."""

from __future__ import annotations

import hashlib
import random

import pytest

from mambakv import (
    BlockStored,
    EngineRequest,
    FullAttentionSpec,
    HashBlockSizeMismatchError,
    InvalidRequestError,
    KVCacheConfig,
    KVCacheCoordinator,
    KVCacheGroupSpec,
    MambaSpec,
    Request,
)
from mambakv.core.retention import Retention, parse_retention
from tests.helpers import STATE_DTYPES, STATE_SHAPES

HBS = 4  # the engine's hash block size


class EngineHasher:
    """The engine's hash function: SHA-256 of the parent key and the block's ids; counts calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.blocks_hashed: list[tuple[int, ...]] = []

    def __call__(self, parent: bytes | None, ids: list[int]) -> bytes:
        self.calls += 1
        self.blocks_hashed.append(tuple(ids))
        return hashlib.sha256((parent or b"seed") + repr(ids).encode()).digest()[:16]


class EngineOwnRequest:
    """A request as an engine keeps it: a plain list of ids, its own hashes kept current as
    tokens arrive (each full block hashed once, when it fills)."""

    def __init__(self, request_id: str, prompt: list[int], hasher: EngineHasher) -> None:
        self.request_id = request_id
        self._ids = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.num_computed_tokens = 0
        self.num_admissions = 0
        self.lora_id: int | None = None
        self.lora_name: str | None = None
        self._hasher = hasher
        self._hashes: list[bytes] = []
        self._extend()

    def _extend(self) -> None:
        while (len(self._hashes) + 1) * HBS <= len(self._ids):
            j = len(self._hashes)
            parent = self._hashes[-1] if self._hashes else None
            self._hashes.append(self._hasher(parent, self._ids[j * HBS:(j + 1) * HBS]))

    def append(self, token: int) -> None:
        self._ids.append(token)
        self._extend()

    @property
    def num_tokens(self) -> int:
        return len(self._ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self._ids

    @property
    def block_hashes(self) -> list[bytes]:
        return self._hashes

    @property
    def hash_block_size(self) -> int:
        return HBS

    def set_hash_block_size(self, hash_block_size: int) -> None:
        if hash_block_size != HBS:
            raise HashBlockSizeMismatchError(f"the engine hashes blocks of {HBS}, not {hash_block_size}")

    @property
    def retain(self) -> Retention:
        return parse_retention(None)


def attention(num_blocks: int = 64, block_size: int = 8) -> KVCacheCoordinator:
    spec = FullAttentionSpec(block_size, num_kv_heads=1, head_size=8, dtype="bfloat16")
    return KVCacheCoordinator(KVCacheConfig(num_blocks, [KVCacheGroupSpec(["a"], spec)]), max_model_len=256,
                              hash_block_size=HBS, enable_kv_cache_events=True)


def serve(coord: KVCacheCoordinator, req: EngineOwnRequest, num_outputs: int, rng: random.Random) -> int:
    """Admit `req` with its hit, prefill it in chunks of at most 16 tokens, decode `num_outputs` tokens (synchronously), free it."""
    blocks, hit = coord.get_computed_blocks(req)
    end = coord.next_chunk_end(req, 16, num_computed_tokens=hit)  # chunks of at most 16 (the placement's ends)
    assert coord.allocate(req, end - hit, num_new_computed_tokens=hit, new_computed_blocks=blocks) is not None
    req.num_computed_tokens = end
    coord.retire(req.request_id, end)
    while req.num_computed_tokens < req.num_tokens:
        end = coord.next_chunk_end(req, 16)
        assert coord.allocate(req, end - req.num_computed_tokens) is not None
        req.num_computed_tokens = end
        coord.retire(req.request_id, end)
    for _ in range(num_outputs):
        req.append(rng.randrange(1000))
        assert coord.allocate(req, 1) is not None
        req.num_computed_tokens += 1
        coord.retire(req.request_id, req.num_computed_tokens)
        coord.check_invariants()
    coord.free(req.request_id)
    return hit


def test_an_engine_request_satisfies_the_protocol() -> None:
    req = EngineOwnRequest("r", list(range(10)), EngineHasher())
    assert isinstance(req, EngineRequest)
    assert isinstance(Request("q", [1, 2, 3]), EngineRequest)
    with pytest.raises(InvalidRequestError):
        attention().get_computed_blocks(object())  # type: ignore[arg-type]


def test_each_block_is_hashed_once_and_events_carry_the_engine_hashes() -> None:
    rng = random.Random(7)
    hasher = EngineHasher()
    coord = attention()
    shared = [rng.randrange(1000) for _ in range(24)]
    served = []
    hits = []
    for i in range(6):
        prompt = shared + [rng.randrange(1000) for _ in range(rng.randrange(1, 20))]
        req = EngineOwnRequest(f"r{i}", prompt, hasher)
        hits.append(serve(coord, req, rng.randrange(1, 12), rng))
        served.append(req)
    # every full hash block of every request was hashed exactly once, by the engine
    assert hasher.calls == sum(r.num_tokens // HBS for r in served)
    assert hits[0] == 0 and all(h >= 24 for h in hits[1:])  # the shared prefix hits (blocks of 8)
    engine_keys = {h for r in served for h in r.block_hashes}
    stored = [e for e in coord.take_events() if isinstance(e, BlockStored)]
    assert stored
    for ev in stored:
        assert set(ev.block_hashes) <= engine_keys  # the engine's keys, never mambakv's
        assert ev.parent_block_hash is None or ev.parent_block_hash in engine_keys
        assert all(type(t) is int for t in ev.token_ids) and len(ev.token_ids) == 8 * len(ev.block_hashes)
    coord.check_invariants()


def test_a_coarse_group_reads_the_fine_engine_keys() -> None:
    """A group of 8-token blocks over the engine's 4-token hash blocks keys each block by the
    engine key that ends it (every second one)."""
    hasher = EngineHasher()
    coord = attention(block_size=8)
    req = EngineOwnRequest("a", list(range(33)), hasher)
    serve(coord, req, 0, random.Random(0))
    stored = [h for e in coord.take_events() if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored == req.block_hashes[1::2]  # blocks end at 8, 16, 24, 32


def test_a_hybrid_model_takes_an_engine_request() -> None:
    """Mamba groups (align mode) publish their states under the engine's keys too."""
    hasher = EngineHasher()
    mamba = MambaSpec(8, STATE_SHAPES, STATE_DTYPES, mode="align")
    attn = FullAttentionSpec(8, num_kv_heads=1, head_size=8, dtype="bfloat16")
    coord = KVCacheCoordinator(KVCacheConfig(64, [KVCacheGroupSpec(["a"], attn), KVCacheGroupSpec(["m"], mamba)]),
                               max_model_len=256, hash_block_size=HBS, enable_kv_cache_events=True)
    prompt = list(range(40))
    first = EngineOwnRequest("a", prompt, hasher)
    serve(coord, first, 3, random.Random(1))
    second = EngineOwnRequest("b", prompt, hasher)
    assert serve(coord, second, 0, random.Random(2)) == 32  # a chunk ended at 32 (the replay boundary, (40 - 1) // 8 * 8)
    assert hasher.calls == first.num_tokens // HBS + second.num_tokens // HBS
    keys = set(first.block_hashes)
    assert all(set(e.block_hashes) <= keys for e in coord.take_events() if isinstance(e, BlockStored))
    coord.check_invariants()
