"""The sockets of :class:`~mambakv.events.publisher.ZmqEventPublisher`'s thread: the PUB socket
(bound or connected, as vLLM decides), the replay ROUTER socket, and the answer to a replay
request (the kept batches from ``start_seq``, then the end marker)."""

from __future__ import annotations

from collections import deque

import zmq

__all__ = ["END_SEQ", "SocketsMixin"]

#: the replay end marker's sequence frame
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class SocketsMixin:
    """Socket setup and replay answers, run on the publisher's background thread."""

    endpoint: str
    replay_endpoint: str | None
    num_replayed: int
    _bind: bool | None
    _hwm: int
    _buffer_steps: int
    _buffer: deque[tuple[int, bytes]]
    _ctx: zmq.Context[zmq.Socket[bytes]]

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
