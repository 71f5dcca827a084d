"""Publish KV events to routers over ZMQ, in vLLM 0.33.0's format, without ever blocking the
scheduler's step.

    from mambakv.events import ZmqEventPublisher

    pub = ZmqEventPublisher.for_coordinator(coord, "tcp://*:5557", replay_endpoint="tcp://*:5558")
    ...                                   # each scheduler step, after allocate / retire / free:
    pub.publish(coord.take_events())
    ...
    pub.close()

``publish`` runs on the caller's thread and only does cheap work: it feeds the raw events to
the router view (``announce.RouterAnnouncer``, the hybrid announce rule), and puts the
resulting batch on a bounded queue (``put_nowait``). A background thread turns each batch into
vLLM's wire form, numbers it (8-byte big-endian sequence numbers, from 0, gap-free over what is
sent), sends ``(topic, seq, payload)`` on a PUB socket (a PUB socket drops messages for a
subscriber past its high-water mark instead of waiting), keeps the last `buffer_steps`
payloads, and answers replay requests on a ROUTER socket: a request is ``[b"", start_seq (8
bytes, big-endian)]`` from a REQ socket (or the same with the identity frame from a DEALER),
answered by one ``[b"", topic, seq, payload]`` per kept batch with ``seq >= start_seq`` and an
end marker ``[b"", b"", (-1 as 8 signed big-endian bytes), b""]``.

When the queue is full the batch is dropped and counted (``num_dropped``); the next batch that
fits is preceded by a resync batch (``AllBlocksCleared`` and every announced block), so a
router's view is exact again after an overload. Batches with no router event are not sent.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, cast

import zmq

from mambakv.core.errors import MambaKVError
from mambakv.core.events import KVCacheEvent
from mambakv.core.spec import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from mambakv.events.announce import RouterAnnouncer
from mambakv.events.wire import encode_batch, to_wire_batch

if TYPE_CHECKING:
    from mambakv.coordinator import KVCacheCoordinator

__all__ = ["END_SEQ", "PublisherClosedError", "ZmqEventPublisher"]

_STOP = object()
#: the replay end marker's sequence frame
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class PublisherClosedError(MambaKVError, RuntimeError):
    """``publish`` after ``close``."""


def spec_kinds_of(coord: KVCacheCoordinator) -> dict[int, str]:
    """Group id -> vLLM's ``kv_cache_spec_kind`` value for a coordinator's groups."""
    out = {}
    for i, g in enumerate(coord.kv_cache_config.kv_cache_groups):
        s = g.kv_cache_spec
        if isinstance(s, SlidingWindowSpec):
            out[i] = "sliding_window"
        elif isinstance(s, FullAttentionSpec):
            out[i] = "full_attention"
        elif isinstance(s, MambaSpec):
            out[i] = "mamba"
    return out


class ZmqEventPublisher:
    """Sends event batches on a ZMQ PUB socket from a background thread (module docstring).

    Args:
        endpoint: PUB address, e.g. ``tcp://*:5557``, ``tcp://127.0.0.1:0`` (an ephemeral port:
            read ``endpoint`` after construction) or ``ipc:///tmp/kv.sock``.
        replay_endpoint: ROUTER address for replay requests, or None for no replay.
        topic: first frame of every message (llm-d's router, for one, reads the pod and model
            from it; Dynamo ignores it).
        announcer: the router view fed by ``publish``; None publishes the raw stream.
        buffer_steps: batches kept for replay.
        max_queue_batches: batches that may wait for the thread; beyond, batches are dropped.
        hwm: the PUB socket's send high-water mark (messages per subscriber).
        bind: bind (True) or connect (False) the PUB socket; None binds wildcard (``*``),
            ``ipc://``, ``inproc://`` and loopback addresses and connects to the rest (as vLLM).
        data_parallel_rank: written into every batch.
        spec_kinds: group id -> ``kv_cache_spec_kind`` written into BlockStored events.
        start_timeout: seconds to wait for the thread to bind its sockets.

    Raises:
        MambaKVError: the sockets could not be set up (the address is taken or malformed);
            nothing is left running.
    """

    def __init__(self, endpoint: str = "tcp://*:5557", *, replay_endpoint: str | None = None, topic: str = "",
                 announcer: RouterAnnouncer | None = None, buffer_steps: int = 10_000,
                 max_queue_batches: int = 10_000, hwm: int = 100_000, bind: bool | None = None,
                 data_parallel_rank: int = 0, spec_kinds: Mapping[int, str] | None = None,
                 start_timeout: float = 10.0) -> None:
        if buffer_steps < 0 or max_queue_batches < 1 or hwm < 0:
            raise MambaKVError(f"bad sizes: buffer_steps {buffer_steps}, max_queue_batches {max_queue_batches}, hwm {hwm}")
        self.topic = topic
        self.announcer = announcer
        self.data_parallel_rank = data_parallel_rank
        self.spec_kinds = dict(spec_kinds) if spec_kinds else None
        self.num_published = 0  # batches handed to the thread
        self.num_dropped = 0  # batches dropped because the queue was full
        self.num_sent = 0  # batches sent (== next sequence number)
        self.num_replayed = 0  # batches re-sent through the replay socket
        self._resync = False
        self._closed = False
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_queue_batches)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._buffer_steps = buffer_steps
        self._hwm = hwm
        self._bind = bind
        self._done = threading.Condition()
        self._num_done = 0
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._run, name="mambakv-kv-events", daemon=True)
        self._thread.start()
        if not self._ready.wait(start_timeout) or self._error is not None:
            self._closed = True
            self._queue.put(_STOP)
            self._thread.join(start_timeout)
            self._ctx.term()
            raise MambaKVError(f"cannot set up the event sockets on {endpoint!r} / {replay_endpoint!r}: "
                               f"{self._error or 'timed out'}")

    @classmethod
    def for_coordinator(cls, coord: KVCacheCoordinator, endpoint: str = "tcp://*:5557", *, announce: bool = True,
                        **kwargs: Any) -> ZmqEventPublisher:
        """A publisher for a ``KVCacheCoordinator`` (built with ``enable_kv_cache_events=True``):
        with `announce`, the router view of its groups (``RouterAnnouncer.for_coordinator``),
        else its raw stream; ``kv_cache_spec_kind`` filled from its specs.

        Raises:
            MambaKVError: events are not enabled; `announce` for a model without a
                full-attention group (InvalidSpecError).
        """
        if not coord.block_pool.enable_kv_cache_events:
            raise MambaKVError("the coordinator records no events: build it with enable_kv_cache_events=True")
        announcer = RouterAnnouncer.for_coordinator(coord) if announce else None
        kwargs.setdefault("spec_kinds", spec_kinds_of(coord))
        return cls(endpoint, announcer=announcer, **kwargs)

    # ------------------------------------------------------------------ scheduler side
    def publish(self, events: Iterable[KVCacheEvent], ts: float | None = None) -> bool:
        """Hand one step's raw events over; never blocks. Returns False when the batch was
        dropped (the queue is full) or had no router event.

        Raises:
            PublisherClosedError: after ``close``.
        """
        if self._closed:
            raise PublisherClosedError("publish after close")
        events = list(events)
        if self.announcer is not None:
            events = self.announcer.feed(events)
        ts = time.time() if ts is None else ts
        if self._resync:  # an earlier batch was dropped: the whole view, which holds this one too
            # (built only when it can be queued: a snapshot costs one event per announced block)
            if self._queue.full() or not self._offer((ts, self.announcer.snapshot())):  # type: ignore[union-attr]
                if events:
                    self.num_dropped += 1
                return False
            self._resync = False
            return True
        if not events:
            return False
        if not self._offer((ts, events)):
            self.num_dropped += 1
            self._resync = self.announcer is not None
            return False
        return True

    def publish_from(self, coord: KVCacheCoordinator) -> bool:
        """``publish(coord.take_events())`` (every pool's events)."""
        return self.publish(coord.take_events())

    def _offer(self, item: object) -> bool:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            return False
        self.num_published += 1
        return True

    def paused(self) -> threading.Condition:
        """A context manager that holds the sending thread after its current batch (``with
        pub.paused(): ...``): ``publish`` keeps queueing and drops once the queue is full, as
        with a stuck subscriber. For tests and maintenance."""
        return self._done

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every batch handed over so far was sent; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._done:
            while self._num_done < self.num_published:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._done.wait(left)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (up to `timeout`), stop the thread, close the sockets. Idempotent."""
        if self._closed:
            return
        self.flush(timeout)
        self._closed = True
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._ctx.term()

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the thread
    # ------------------------------------------------------------------ the thread's sockets
    def _should_bind(self, endpoint: str) -> bool:
        if self._bind is not None:
            return self._bind
        return ("*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
                or endpoint.startswith(("tcp://127.", "tcp://localhost")))

    def _setup(self) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes] | None]:
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self._hwm)
        pub.setsockopt(zmq.LINGER, 0)
        replay = None
        try:
            if self._should_bind(self.endpoint):
                pub.bind(self.endpoint)
                self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                replay = self._ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                # room for one whole replay and its end marker
                replay.setsockopt(zmq.SNDHWM, 2 * (self._buffer_steps + 1))
                replay.bind(self.replay_endpoint)
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            pub.close()
            if replay is not None:
                replay.close()
            raise
        return pub, replay

    def _serve_replay(self, replay: zmq.Socket[bytes], topic: bytes) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return  # not a replay request: ignored
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
                self.num_replayed += 1
        replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _run(self) -> None:
        try:
            pub, replay = self._setup()
        except Exception as e:  # reported to the constructor
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        topic = self.topic.encode()
        try:
            while True:
                if replay is not None and replay.poll(0):
                    self._serve_replay(replay, topic)
                try:
                    item = self._queue.get(timeout=0.02)
                except queue.Empty:
                    continue
                if item is _STOP:
                    break
                ts, events = cast("tuple[float, list[Any]]", item)  # (timestamp, events), see publish
                payload = encode_batch(to_wire_batch(ts, events, data_parallel_rank=self.data_parallel_rank,
                                                     spec_kinds=self.spec_kinds))
                seq = self.num_sent
                pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))  # PUB: drops, never waits
                self._buffer.append((seq, payload))
                self.num_sent = seq + 1
                with self._done:
                    self._num_done += 1
                    self._done.notify_all()
        finally:
            pub.close(0)
            if replay is not None:
                replay.close(0)
