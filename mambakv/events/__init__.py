"""KV events on the wire, for cache-aware routers (docs/routers.md).

* ``announce``: the router view of a hybrid model (what can be hit), pure Python;
* ``wire``: vLLM 0.33.0's msgpack event format (needs msgspec);
* ``publisher``: ``ZmqEventPublisher``, a background-thread ZMQ PUB + replay publisher
  (needs pyzmq and msgspec: ``pip install 'mambakv[events]'``);
* ``dynamo``: the vLLM-to-Dynamo event mapping, for Dynamo's ``RadixTree``.

Nothing here is imported by the core: ``import mambakv`` never loads pyzmq or msgspec.
"""

from __future__ import annotations

from mambakv.events.announce import RouterAnnouncer

__all__ = ["RouterAnnouncer", "ZmqEventPublisher"]


def __getattr__(name: str) -> type:
    if name == "ZmqEventPublisher":
        try:
            from mambakv.events.publisher import ZmqEventPublisher
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(f"{e}: the publisher needs pip install 'mambakv[events]'") from e
        return ZmqEventPublisher
    raise AttributeError(f"module 'mambakv.events' has no attribute {name!r}")
