"""Routers in front of a fleet of simulated engines, and the prefix index a KV-aware router keeps.

A router picks, for each request at its arrival, the instance whose waiting queue it joins::

    round-robin   request k (in arrival order) -> instance k mod N
    least-loaded  the least load; ties -> lowest instance index
    kv            the longest overlap in the router's index of the instances' announced
                  KV events, among instances under the load bound; ties -> least load, then index
    oracle        the longest hit ``get_computed_blocks`` gives on each instance (asked
                  directly), among instances under the load bound; same ties

    load(i)       tokens instance i still owes: for each request waiting or running there,
                  prompt tokens + output tokens - tokens already computed (settled)
    load bound    instance i may be chosen by kv / oracle iff load(i) <= bound x mean(load)
                  (bound >= 1, default 1.5: the least loaded instance always qualifies)

    e.g. loads [0, 2], overlaps [0, 1088] tokens, bound 1.5: mean 1, instance 1's 2 > 1.5, so
    the request goes to instance 0 although instance 1 holds 1088 of its tokens; bound 4 -> 1.

The kv router's index (:class:`PrefixIndex`) holds, per instance, the blocks the instance
announced under the hybrid announce rule (:class:`~mambakv.events.RouterAnnouncer`: only
blocks below a Mamba state checkpoint, so only what can be hit). A prompt of N tokens is
queried as ``tokens[:N-1]`` (the last token is always recomputed): its overlap is the number
of its leading full attention blocks the instance announced, times the block size.
:class:`DynamoIndex` keeps the same view in Dynamo's ``RadixTree`` (``ai-dynamo-runtime``),
fed the same events through the vLLM-to-Dynamo mapping (:mod:`mambakv.events.dynamo`), and
answers the same overlaps.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from typing import Any

from mambakv.core.errors import InvalidSpecError
from mambakv.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

__all__ = ["DEFAULT_LOAD_BOUND", "ROUTERS", "DynamoIndex", "PrefixIndex", "RouterKind", "choose", "least_loaded"]

#: The load bound of the kv and oracle routers: at most this many times the mean load.
DEFAULT_LOAD_BOUND = 1.5


class RouterKind(enum.Enum):
    """The ``--router`` choices (module docstring)."""

    ROUND_ROBIN = "round-robin"
    LEAST_LOADED = "least-loaded"
    KV = "kv"
    ORACLE = "oracle"


#: ``--router`` values, in the order of the docs.
ROUTERS = tuple(r.value for r in RouterKind)


def least_loaded(loads: Sequence[int]) -> int:
    """The index of the least load; ties -> the lowest index."""
    return min(range(len(loads)), key=lambda i: (loads[i], i))


def choose(loads: Sequence[int], scores: Sequence[int], *, load_bound: float = DEFAULT_LOAD_BOUND) -> int:
    """The instance with the best score among those with ``load <= load_bound x mean(load)``;
    ties -> least load, then the lowest index (module docstring's example).

    Raises:
        InvalidSpecError: no instance, `scores` not one per instance, or `load_bound` < 1.
    """
    if not loads or len(scores) != len(loads):
        raise InvalidSpecError(f"need one score per instance, got {len(scores)} scores for {len(loads)} instances")
    if not load_bound >= 1:
        raise InvalidSpecError(f"the load bound must be >= 1, got {load_bound!r}")
    cap = load_bound * sum(loads) / len(loads)
    eligible = [i for i, x in enumerate(loads) if x <= cap]
    return min(eligible, key=lambda i: (-scores[i], loads[i], i))


class PrefixIndex:
    """mambakv's own router index: the announced block keys of each instance.

    Fed the announced stream (``RouterAnnouncer.feed``), which always extends announced
    chains and withdraws deepest first, so a key set per instance is the whole radix tree:
    the leading keys of a prompt that are in the set are exactly its matched path.
    """

    def __init__(self, num_instances: int) -> None:
        self._keys: list[set[bytes]] = [set() for _ in range(num_instances)]

    def apply(self, instance: int, events: Iterable[KVCacheEvent]) -> None:
        keys = self._keys[instance]
        for ev in events:
            if isinstance(ev, BlockStored):
                keys.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                keys.difference_update(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                keys.clear()

    def overlaps(self, keys: Sequence[bytes], tokens: Sequence[int]) -> list[int]:
        """Matched leading blocks of `keys` (the prompt's block keys at the announced block
        size, ``tokens[:N-1]``'s full blocks) per instance; `tokens` is unused here."""
        out = []
        for held in self._keys:
            n = 0
            for k in keys:
                if k not in held:
                    break
                n += 1
            out.append(n)
        return out

    def keys(self, instance: int) -> frozenset[bytes]:
        """The keys `instance` announced (a copy)."""
        return frozenset(self._keys[instance])


class DynamoIndex:
    """The same view in Dynamo's ``RadixTree`` (one tree, worker id = instance index).

    Raises:
        InvalidSpecError: ai-dynamo-runtime (or msgspec, for the event mapping) is not installed.
    """

    def __init__(self, num_instances: int, block_size: int) -> None:
        try:
            from dynamo.llm import RadixTree, compute_block_hash_for_seq

            from mambakv.events.dynamo import event_to_dynamo
            from mambakv.events.wire import to_wire_event
        except ImportError as e:
            raise InvalidSpecError(f"the dynamo index needs ai-dynamo-runtime and msgspec ({e})") from None
        self._tree: Any = RadixTree()
        self._hash: Any = compute_block_hash_for_seq
        self._to_dynamo = event_to_dynamo
        self._to_wire = to_wire_event
        self.block_size = block_size
        self._num = num_instances
        self._next_id = [0] * num_instances

    def apply(self, instance: int, events: Iterable[KVCacheEvent]) -> None:
        for ev in events:
            raw = self._to_dynamo(self._to_wire(ev), self._next_id[instance], self._hash)
            self._tree.apply_event(instance, raw)
            self._next_id[instance] += 1

    def overlaps(self, keys: Sequence[bytes], tokens: Sequence[int]) -> list[int]:
        """Matched leading blocks of `tokens` (``tokens[:N-1]``) per instance; `keys` unused."""
        n = len(tokens) // self.block_size * self.block_size
        if not n:
            return [0] * self._num
        scores = self._tree.find_matches(self._hash(list(tokens[:n]), self.block_size)).scores
        return [int(scores.get((i, 0), 0)) for i in range(self._num)]
