"""The hybrid announce rule (mambakv.events.announce): routers are told the attention chains
of hittable state checkpoints only, parents first, withdrawn deepest first."""

from __future__ import annotations

import random

import pytest

from mambakv import AllBlocksCleared, BlockRemoved, BlockStored
from mambakv.core.errors import InvalidSpecError
from mambakv.events.announce import RouterAnnouncer
from tests.coord_helpers import coordinator, fa_spec, sw_spec
from tests.event_driver import MiniEngine
from tests.helpers import mamba_spec


def h(i: int) -> bytes:
    return bytes([i]) * 16


TOK = list(range(100, 116))  # 4 blocks of 4


def attn(keys, parent, first_block, gid=0):
    return BlockStored([h(k) for k in keys], parent, TOK[first_block * 4 : (first_block + len(keys)) * 4], 4, None,
                       group_id=gid)


def state(k, gid=1):
    return BlockStored([h(k)], h(k - 1) if k else None, TOK[k * 4 : k * 4 + 4], 4, None, group_id=gid)


def test_docstring_example():
    """a0-a1-a2-a3, states at a1 and a3, then the state at a3 and attention a0 evicted."""
    ann = RouterAnnouncer([0], [1], block_size=4)
    assert ann.feed([attn([0, 1, 2, 3], None, 0)]) == []  # no state yet: nothing can be hit
    assert ann.feed([state(1)]) == [BlockStored([h(0), h(1)], None, TOK[0:8], 4, None, group_id=0)]
    assert ann.feed([state(3)]) == [BlockStored([h(2), h(3)], h(1), TOK[8:16], 4, None, group_id=0)]
    assert ann.feed([BlockRemoved([h(3)], group_id=1)]) == [BlockRemoved([h(3), h(2)], group_id=0)]
    assert ann.feed([BlockRemoved([h(0)], group_id=0)]) == [BlockRemoved([h(1), h(0)], group_id=0)]
    ann.check_invariants()
    # a0 comes back (recomputed): the chain a0-a1 is whole again and a1 still has its state
    assert ann.feed([attn([0], None, 0)]) == [BlockStored([h(0), h(1)], None, TOK[0:8], 4, None, group_id=0)]
    assert ann.num_announced == 2
    ann.check_invariants()


def test_removing_attention_of_a_state_withdraws_and_forgets():
    ann = RouterAnnouncer([0], [1], block_size=4)
    ann.feed([attn([0, 1], None, 0), state(1)])
    assert ann.feed([BlockRemoved([h(1)], group_id=0)]) == [BlockRemoved([h(1), h(0)], group_id=0)]
    assert ann.feed([BlockRemoved([h(1)], group_id=1), BlockRemoved([h(0)], group_id=0)]) == []
    assert ann.num_tracked == 0  # nothing cached, nothing remembered


def test_states_must_be_in_every_mamba_group_and_attention_in_every_attention_group():
    ann = RouterAnnouncer([0, 2], [1, 3], block_size=4)
    out = ann.feed([attn([0], None, 0, gid=0), state(0, gid=1), state(0, gid=3)])
    assert out == []  # group 2 lacks the attention block
    out = ann.feed([attn([0], None, 0, gid=2)])
    assert out == [BlockStored([h(0)], None, TOK[0:4], 4, None, group_id=0)]
    assert ann.feed([BlockRemoved([h(0)], group_id=3)]) == [BlockRemoved([h(0)], group_id=0)]


def test_alignment():
    """Attention block 4, hits aligned to 8: a state at 4 (depth 1) can never be hit."""
    ann = RouterAnnouncer([0], [1], block_size=4, alignment_tokens=8)
    assert ann.feed([attn([0, 1], None, 0), state(0)]) == []
    assert ann.feed([state(1)]) == [BlockStored([h(0), h(1)], None, TOK[0:8], 4, None, group_id=0)]


def test_attention_only_every_whole_chain_is_announced():
    ann = RouterAnnouncer([0], [], block_size=4)
    assert ann.feed([attn([0, 1], None, 0)]) == [BlockStored([h(0)], None, TOK[0:4], 4, None, group_id=0),
                                                 BlockStored([h(1)], h(0), TOK[4:8], 4, None, group_id=0)]
    assert ann.feed([BlockRemoved([h(0)], group_id=0)]) == [BlockRemoved([h(1)], group_id=0),
                                                            BlockRemoved([h(0)], group_id=0)]


def test_cleared_and_snapshot():
    ann = RouterAnnouncer([0], [1], block_size=4)
    ann.feed([attn([0, 1, 2], None, 0), state(2)])
    assert ann.snapshot() == [AllBlocksCleared(),
                              BlockStored([h(0)], None, TOK[0:4], 4, None, group_id=0),
                              BlockStored([h(1)], h(0), TOK[4:8], 4, None, group_id=0),
                              BlockStored([h(2)], h(1), TOK[8:12], 4, None, group_id=0)]
    assert ann.feed([AllBlocksCleared()]) == [AllBlocksCleared()]
    assert ann.num_announced == 0 and ann.snapshot() == [AllBlocksCleared()]


def test_blocks_stored_without_their_tokens_are_never_announced():
    ann = RouterAnnouncer([0], [], block_size=4)
    assert ann.feed([BlockStored([h(0), h(1)], None, [], 4, None)]) == []
    assert ann.feed([BlockStored([h(2)], h(1), TOK[8:12], 4, None)]) == []  # its chain is unknown
    ann.check_invariants()


def test_needs_a_full_attention_group():
    with pytest.raises(InvalidSpecError):
        RouterAnnouncer([], [0], block_size=4)
    with pytest.raises(InvalidSpecError):
        RouterAnnouncer.for_coordinator(coordinator(8, mamba_spec(4)))
    ann = RouterAnnouncer.for_coordinator(coordinator(8, fa_spec(4), sw_spec(4, 8), mamba_spec(4)))
    assert (ann.attention_groups, ann.state_groups, ann.block_size) == ({0}, {2}, 4)


class RouterMirror:
    """Replays announced events; checks that every store extends an announced chain and that a
    block is withdrawn only after its announced children."""

    def __init__(self) -> None:
        self.parent: dict[bytes, bytes | None] = {}
        self.num_withdrawn = 0

    def apply(self, events) -> None:
        for ev in events:
            if isinstance(ev, BlockStored):
                p = ev.parent_block_hash
                assert p is None or p in self.parent, "store below a block the router does not hold"
                for k in ev.block_hashes:
                    assert k not in self.parent
                    self.parent[k] = p
                    p = k
            elif isinstance(ev, BlockRemoved):
                for k in ev.block_hashes:
                    assert k in self.parent
                    assert k not in self.parent.values(), "withdrawn before its children"
                    del self.parent[k]
                    self.num_withdrawn += 1
            else:
                self.parent.clear()


def expected_view(coord, parent_of: dict[bytes, bytes | None]) -> set[bytes]:
    """Brute force from the pool: chains root..k of every key k with a state in every Mamba
    group and its whole chain in every attention group, at an aligned depth."""
    pool = coord.block_pool
    mamba_groups = [i for i, m in enumerate(coord.managers) if hasattr(m, "num_speculative_blocks")]
    cached = {g: set(pool.cached_block_hash_to_block.get(g, {})) for g in range(len(coord.managers))}
    out: set[bytes] = set()
    for k in set.intersection(*(cached[g] for g in mamba_groups)):
        chain = [k]
        while parent_of.get(chain[-1]) is not None:
            chain.append(parent_of[chain[-1]])
        if all(c in cached[0] for c in chain) and (len(chain) * 4) % coord.alignment_tokens == 0:
            out.update(chain)
    return out


LAYOUTS = {
    "fa+mamba+mamba": (fa_spec(4), mamba_spec(4), mamba_spec(4, nspec=1)),
    "fa+sw+mamba": (fa_spec(4), sw_spec(4, 8), mamba_spec(4)),
    "fa+lazy": (fa_spec(4), mamba_spec(4, mode="align_lazy")),
    "fa(4)+mamba(8)": (fa_spec(4), mamba_spec(8)),
}


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_router_view_matches_brute_force_under_random_traffic(seed, layout):
    rng = random.Random(seed)
    # 23 blocks: small enough that every layout preempts (latest pins no spare before a crossing)
    coord = coordinator(23, *LAYOUTS[layout], enable_kv_cache_events=True, max_num_seqs=4)
    ann = RouterAnnouncer.for_coordinator(coord)
    engine = MiniEngine(coord, 4, rng, chunk_blocks=rng.choice([1, 2, 3]))
    router = RouterMirror()
    parent_of: dict[bytes, bytes | None] = {}
    prefixes = [[rng.randrange(1, 30) for _ in range(28)] for _ in range(3)]
    announced_max = 0
    for t in range(500):
        if rng.random() < 0.35:
            p = rng.choice(prefixes)
            engine.submit(p[: rng.randrange(4, 28)] + [rng.randrange(1, 30) for _ in range(rng.randrange(0, 7))],
                          max_tokens=rng.randrange(0, 5))
        engine.step()
        if t % 150 == 149:
            engine.preempt_all()
            assert coord.reset_prefix_cache()
        raw = coord.block_pool.take_events()
        for ev in raw:
            if isinstance(ev, BlockStored) and ev.group_id == 0:
                p = ev.parent_block_hash
                for k in ev.block_hashes:
                    parent_of[k] = p
                    p = k
        router.apply(ann.feed(raw))
        ann.check_invariants()
        assert set(router.parent) == expected_view(coord, parent_of)
        announced_max = max(announced_max, len(router.parent))
    assert announced_max >= 5 and engine.num_preemptions > 0 and router.num_withdrawn > 20
