"""A real router indexes mambakv: three hybrid workers (full attention + 2 Mamba groups) publish
their announced events over ZMQ; a bridge decodes them, maps them to Dynamo's events
(mambakv.events.dynamo) and applies them to Dynamo's RadixTree, which also routes the traffic.
Through evictions, removals, preemptions and prefix-cache resets, for every prompt prefix
``tokens[:p + 1]`` queried as ``tokens[:p]``, each worker's overlap equals what its
``get_computed_blocks`` hits where it holds a state checkpoint at p, and bounds it elsewhere.

Needs ai-dynamo-runtime (CPU-only wheel; .ci/run installs it), pyzmq and msgspec; skipped
without them."""

from __future__ import annotations

import random
import time

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")
dynamo_llm = pytest.importorskip("dynamo.llm", reason="needs ai-dynamo-runtime")

from mambakv import Request  # noqa: E402
from mambakv.events import ZmqEventPublisher  # noqa: E402
from mambakv.events.dynamo import batch_to_dynamo  # noqa: E402
from mambakv.events.publisher import END_SEQ  # noqa: E402
from mambakv.events.wire import decode_batch  # noqa: E402
from tests.coord_helpers import coordinator, fa_spec  # noqa: E402
from tests.event_driver import MiniEngine  # noqa: E402
from tests.helpers import mamba_spec  # noqa: E402

BS = 4
LOOPBACK = "tcp://127.0.0.1:0"
local_hash = dynamo_llm.compute_block_hash_for_seq


class Bridge:
    """What a router's event listener does: subscribe to every worker, apply batches in
    sequence order, fill gaps (and the slow-join start) from the worker's replay socket."""

    def __init__(self, ctx, publishers: dict[int, ZmqEventPublisher]) -> None:
        self.ctx = ctx
        self.pubs = publishers
        self.tree = dynamo_llm.RadixTree()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        for pub in publishers.values():
            self.sub.connect(pub.endpoint)
        self.next_seq = dict.fromkeys(publishers, 0)
        self.next_event_id = dict.fromkeys(publishers, 0)
        self.num_replayed = 0
        self.num_events = 0
        self.kinds: dict[str, int] = {}

    def _apply(self, wid: int, seq: int, payload: bytes) -> None:
        if seq < self.next_seq[wid]:
            return  # already applied (a replay overlapped the live stream)
        if seq > self.next_seq[wid]:
            self._replay(wid, self.next_seq[wid])  # the gap, and maybe this batch and later ones
            if seq < self.next_seq[wid]:
                return
        assert seq == self.next_seq[wid], f"worker {wid}: batch {seq} lost"
        batch = decode_batch(payload)
        for ev in batch.events:
            self.kinds[type(ev).__name__] = self.kinds.get(type(ev).__name__, 0) + 1
        for ev in batch_to_dynamo(batch, self.next_event_id[wid], local_hash):
            self.tree.apply_event(wid, ev)  # raises if a store has no parent, for one
        self.next_event_id[wid] += len(batch.events)
        self.num_events += len(batch.events)
        self.next_seq[wid] = seq + 1

    def _replay(self, wid: int, start: int) -> None:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.pubs[wid].replay_endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if not dealer.poll(50):
                continue
            _, _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                break
            self.num_replayed += 1
            self._apply(wid, int.from_bytes(seq, "big"), payload)
        dealer.close(0)

    def sync(self) -> None:
        """Apply everything the workers have published."""
        for pub in self.pubs.values():
            assert pub.flush()
        deadline = time.monotonic() + 30
        while any(self.next_seq[w] < p.num_sent for w, p in self.pubs.items()):
            if self.sub.poll(300):
                topic, seq, payload = self.sub.recv_multipart()
                self._apply(int(topic.split(b"@")[1][1:]), int.from_bytes(seq, "big"), payload)
            else:  # quiet for 0.3 s: the rest was lost (the slow join): ask the replay sockets
                for w, p in self.pubs.items():
                    if self.next_seq[w] < p.num_sent:
                        self._replay(w, self.next_seq[w])
            assert time.monotonic() < deadline

    def overlap(self, wid: int, query: list[int]) -> int:
        return self.tree.find_matches(local_hash(query, BS)).scores.get((wid, 0), 0)


def holds_checkpoint(coord, keys: list[bytes], depth: int) -> bool:
    """States under key ``depth - 1`` in both Mamba groups and attention blocks 0..depth-1."""
    pool = coord.block_pool
    return (pool.get_cached_block(keys[depth - 1], [1, 2]) is not None
            and all(pool.get_cached_block(k, [0]) is not None for k in keys[:depth]))


def test_dynamo_radix_tree_overlap_matches_the_hits():
    rng = random.Random(7)
    ctx = zmq.Context()
    coords = {w: coordinator(n, fa_spec(BS), mamba_spec(BS), mamba_spec(BS, nspec=1), enable_kv_cache_events=True)
              for w, n in ((1, 18), (2, 24), (3, 40))}
    pubs = {w: ZmqEventPublisher.for_coordinator(c, LOOPBACK, replay_endpoint=LOOPBACK, topic=f"kv@w{w}@hybrid")
            for w, c in coords.items()}
    engines = {w: MiniEngine(c, BS, rng, chunk_blocks=rng.choice([1, 2, 3]), name=f"w{w}") for w, c in coords.items()}
    bridge = Bridge(ctx, pubs)
    families = [[rng.randrange(1, 50) for _ in range(40)] for _ in range(5)]
    num_equal = num_bound = num_strict = 0
    try:
        for t in range(300):
            for _ in range(rng.choice([0, 1, 1, 2])):
                fam = rng.choice(families)
                prompt = fam[: rng.randrange(6, 40)] + [rng.randrange(1, 50) for _ in range(rng.randrange(0, 6))]
                query = local_hash(prompt[:-1], BS)
                scores = bridge.tree.find_matches(query).scores
                best = max(coords, key=lambda w: (scores.get((w, 0), 0), rng.random()))  # cache-aware routing
                engines[best].submit(prompt, max_tokens=rng.randrange(0, 4))
            for w, e in engines.items():
                e.step()
                pubs[w].publish_from(coords[w])
            if t % 33 == 32:  # data lost on one worker: a few cached blocks dropped, any group
                w = rng.choice(list(coords))
                hashed = [b.block_id for b in coords[w].block_pool.blocks if b.block_hash is not None]
                coords[w].block_pool.evict_blocks(rng.sample(hashed, min(3, len(hashed))))
                pubs[w].publish_from(coords[w])
            if t % 70 == 69:  # a reset on one worker (preempting what runs there)
                w = rng.choice(list(coords))
                engines[w].preempt_all()
                assert coords[w].reset_prefix_cache()
                pubs[w].publish_from(coords[w])
            if t % 10 != 9:
                continue
            bridge.sync()
            for fam in families:
                prompt = fam[: rng.randrange(9, 40)]
                keys = Request("k", prompt, hash_block_size=BS).block_hashes
                for p in range(BS, len(prompt), BS):  # prompt[:p + 1], queried as prompt[:p]
                    for w, c in coords.items():
                        overlap = bridge.overlap(w, prompt[:p])
                        _, hit = c.get_computed_blocks(Request("q", prompt[: p + 1]))
                        assert hit <= overlap * BS, (w, p, hit, overlap)
                        num_bound += 1
                        if holds_checkpoint(c, keys, p // BS):
                            assert hit == overlap * BS == p, (w, p, hit, overlap)
                            num_equal += 1
                        elif hit < overlap * BS:
                            num_strict += 1
    finally:
        for pub in pubs.values():
            pub.close()
        ctx.destroy(linger=0)
    assert num_equal > 100 and num_strict > 0 and num_bound > 1000, (num_equal, num_strict, num_bound)
    assert sum(e.num_preemptions for e in engines.values()) > 0
    assert bridge.num_events > 500
    assert min(bridge.kinds.get(k, 0) for k in ("WireBlockStored", "WireBlockRemoved", "WireAllBlocksCleared")) > 0
