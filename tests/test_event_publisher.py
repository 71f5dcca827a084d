"""ZmqEventPublisher on loopback: every batch decodes with the wire schema, sequence numbers are
gap-free, replay returns missed batches, a slow subscriber never blocks allocate, and a dropped
batch is followed by a resync that restores the router's view."""

from __future__ import annotations

import threading
import time

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from mambakv import BlockStored, Request  # noqa: E402
from mambakv.core.errors import MambaKVError  # noqa: E402
from mambakv.events import ZmqEventPublisher  # noqa: E402
from mambakv.events.publisher import END_SEQ, PublisherClosedError  # noqa: E402
from mambakv.events.wire import WireBlockRemoved, WireBlockStored, decode_batch, external_hash  # noqa: E402
from tests.coord_helpers import coordinator, fa_spec, tokens  # noqa: E402

LOOPBACK = "tcp://127.0.0.1:0"


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def stored(i: int) -> BlockStored:
    return BlockStored([h(i)], None, [i], 1, None)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def subscribe(ctx, endpoint: str, *, rcvhwm: int = 1000):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, rcvhwm)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    time.sleep(0.3)  # let the subscription reach the publisher (ZMQ's slow joiner)
    return sub


def recv_until(sub, last_seq: int, timeout: float = 5.0) -> list[tuple[bytes, int, bytes]]:
    """(topic, seq, payload) until `last_seq` arrives or `timeout` passes."""
    out: list[tuple[bytes, int, bytes]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not sub.poll(50):
            continue
        topic, seq, payload = sub.recv_multipart()
        out.append((topic, int.from_bytes(seq, "big"), payload))
        if out[-1][1] >= last_seq:
            break
    return out


def replay(ctx, endpoint: str, start: int, timeout: float = 5.0) -> list[tuple[int, bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not dealer.poll(50):
            continue
        _, topic, seq, payload = dealer.recv_multipart()
        if seq == END_SEQ:
            dealer.close(0)
            return out
        out.append((int.from_bytes(seq, "big"), payload))
    raise AssertionError("no replay end marker")


def test_subscriber_decodes_every_batch_in_order_without_gaps(ctx):
    with ZmqEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, topic="kv@w1@m") as pub:
        sub = subscribe(ctx, pub.endpoint)
        for i in range(100):
            assert pub.publish([stored(i), stored(1000 + i)], ts=float(i))
        assert pub.flush()
        got = recv_until(sub, 99)
        seqs = [s for _, s, _ in got]
        first = seqs[0] if seqs else 100
        assert seqs == list(range(first, 100))  # live messages: no gap
        missed = replay(ctx, pub.replay_endpoint, 0)[:first]  # what the slow join lost, if anything
        payloads = dict((s, p) for s, p in missed) | {s: p for _, s, p in got}
        assert sorted(payloads) == list(range(100))
        for seq, payload in payloads.items():
            batch = decode_batch(payload)
            assert batch.ts == float(seq) and batch.data_parallel_rank == 0
            assert [e.block_hashes for e in batch.events] == [[seq], [1000 + seq]]
            assert all(isinstance(e, WireBlockStored) and e.group_idx == 0 for e in batch.events)
        assert {t for t, _, _ in got} == {b"kv@w1@m"}
        assert (pub.num_sent, pub.num_dropped) == (100, 0)


def test_replay_returns_the_missed_batches(ctx):
    with ZmqEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, buffer_steps=12) as pub:
        for i in range(20):  # nobody listens: all of them are missed
            pub.publish([stored(i)])
        assert pub.flush()
        got = replay(ctx, pub.replay_endpoint, 5)
        # 12 kept (seq 8..19), those from 5 on: 8..19
        assert [s for s, _ in got] == list(range(8, 20))
        assert [decode_batch(p).events[0].block_hashes for _, p in got] == [[i] for i in range(8, 20)]
        assert replay(ctx, pub.replay_endpoint, 19)[0][0] == 19
        assert replay(ctx, pub.replay_endpoint, 20) == []


def test_slow_subscriber_never_blocks_allocate(ctx):
    """A subscriber that never reads (receive queue of 1 message), a send high-water mark of 1
    and a publisher queue of 8: 2000 steps of allocate + publish + free run through, and so do
    2000 more while the sending thread itself is stalled (its queue full: batches are dropped,
    ``publish`` does not wait). Timing is reported, not asserted tightly (shared CI cores)."""
    coord = coordinator(600, fa_spec(16), enable_kv_cache_events=True)
    with ZmqEventPublisher.for_coordinator(coord, LOOPBACK, hwm=1, max_queue_batches=8) as pub:
        sub = subscribe(ctx, pub.endpoint, rcvhwm=1)  # noqa: F841 (connected, never read)
        times: list[float] = []

        def steps(first: int) -> None:
            for i in range(first, first + 2000):
                req = Request(f"r{i}", tokens(512, start=i * 512))
                t = time.perf_counter()
                assert coord.allocate(req, 512) is not None
                pub.publish_from(coord)
                times.append(time.perf_counter() - t)
                coord.free(req.request_id)

        steps(0)
        assert pub.flush(10.0)  # the thread was never stuck on the subscriber
        assert pub.num_sent == pub.num_published > 0
        with pub.paused():  # stall the thread: from now on the queue fills up and stays full
            worker = threading.Thread(target=steps, args=(2000,))
            worker.start()
            worker.join(60.0)
            assert not worker.is_alive(), "publish blocked on a full queue"
        assert pub.num_dropped >= 2000 - 9
        assert pub.flush(10.0)
    times.sort()
    assert len(times) == 4000 and times[len(times) // 2] < 0.05, times[len(times) // 2]


def test_a_dropped_batch_is_followed_by_a_resync(ctx):
    """Stall the sending thread, overflow its queue of 3: the next batch that fits is the whole
    router view (AllBlocksCleared + every announced block), so the subscriber's replayed view
    ends equal to the publisher's."""
    coord = coordinator(64, fa_spec(4), enable_kv_cache_events=True)
    pub = ZmqEventPublisher.for_coordinator(coord, LOOPBACK, replay_endpoint=LOOPBACK, max_queue_batches=3)
    sub = subscribe(ctx, pub.endpoint)
    with pub.paused():  # the thread blocks after its first send
        for i in range(12):
            req = Request(f"r{i}", tokens(8, start=100 * i))
            coord.allocate(req, 8)
            coord.free(req.request_id)
            pub.publish_from(coord)
    assert pub.num_dropped >= 12 - 4
    assert pub.flush()  # the queued batches go out
    req = Request("last", tokens(8, start=5000))
    coord.allocate(req, 8)
    assert pub.publish_from(coord)  # the resync snapshot
    assert pub.flush()
    got = [s for _, s, _ in recv_until(sub, pub.num_sent - 1)]
    assert got == list(range(got[0] if got else 0, pub.num_sent if got else 0))  # live: gap-free
    everything = replay(ctx, pub.replay_endpoint, 0)
    assert [s for s, _ in everything] == list(range(pub.num_sent))
    pub.close()
    view: set[int] = set()
    for _, payload in everything:
        for ev in decode_batch(payload).events:
            if isinstance(ev, WireBlockStored):
                view.update(ev.block_hashes)
            elif isinstance(ev, WireBlockRemoved):
                view.difference_update(ev.block_hashes)
            else:
                view.clear()
    assert pub.announcer is not None
    assert view == {external_hash(k) for k in pub.announcer.announced_keys()}
    assert len(view) == 2 * 13  # 13 requests of 2 blocks, none evicted (64-block pool)


def test_errors():
    with ZmqEventPublisher(LOOPBACK) as pub:
        with pytest.raises(MambaKVError):  # the address is taken
            ZmqEventPublisher(pub.endpoint, bind=True)
    with pytest.raises(PublisherClosedError):
        pub.publish([stored(1)])
    with pytest.raises(MambaKVError):
        ZmqEventPublisher.for_coordinator(coordinator(8, fa_spec(4)))  # events not enabled
    with pytest.raises(MambaKVError):
        ZmqEventPublisher(LOOPBACK, max_queue_batches=0)


def test_empty_router_batches_are_not_sent():
    coord = coordinator(8, fa_spec(4), enable_kv_cache_events=True)
    with ZmqEventPublisher.for_coordinator(coord, LOOPBACK) as pub:
        assert pub.publish([]) is False
        assert pub.flush() and pub.num_sent == 0
