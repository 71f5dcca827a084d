"""EngineRequest: what the coordinator reads of a request, so an engine can hand it its own.

An engine that already keeps every request (its token ids, its counts, the block hashes it
computed) need not mirror it in a :class:`~mambakv.core.request.Request`: any object with the
members below is accepted wherever the coordinator takes a request (``allocate``,
``get_computed_blocks``, ``can_allocate``, ...). Nothing is copied and nothing is hashed again:
the coordinator reads ``block_hashes`` as the engine keeps it, and the KV events carry those
hashes (``BlockStored.block_hashes`` are the engine's keys, so a router sees the keys the
engine computed).

The contract of ``block_hashes`` (checked only by the hits it produces):

- one key per *full* block of ``hash_block_size`` tokens of ``all_token_ids``, in order, and
  current whenever the coordinator reads it (the engine extends it as tokens arrive);
- each key names the whole prefix up to the end of its block (a chained hash: equal keys mean
  equal prefixes), LoRA / salt / multimodal extra keys already folded in by the engine;
- ``hash_block_size`` equals the coordinator's (``KVCacheCoordinator.hash_block_size``), or is
  None and then adopted by ``set_hash_block_size`` (a fixed size refuses another one with
  HashBlockSizeMismatchError).

A coarse group (block 64 over hash blocks of 16) uses the key that ends each of its blocks
(``mambakv.groups.base.BlockHashView``), so one fine chain serves every group::

    hash blocks of 16:   h0 h1 h2 h3 | h4 h5 h6 h7
    a group of 64:                h3 |          h7

``Request`` is the library's own implementation (it hashes its tokens lazily with xxh3-128).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from mambakv.core.retention import Retention


@runtime_checkable
class EngineRequest(Protocol):
    """The members of a request the coordinator reads (and the two it writes).

    Read: ``request_id`` (str, unique among live requests), ``num_prompt_tokens`` and
    ``num_tokens`` (tokens: prompt, prompt + outputs so far), ``all_token_ids`` (a view of the
    ``num_tokens`` ids; sliced only for KV events' ``token_ids``), ``block_hashes`` (see the
    module docstring), ``hash_block_size``, ``lora_id`` / ``lora_name`` (KV events only; the
    name must already be in the hashes), ``retain`` (the decoupled layout's retention hint,
    read at ``free``).

    Written: ``num_computed_tokens`` (the engine advances it; the coordinator resets it to 0 only
    in ``preempt_all``) and ``num_admissions`` (the coordinator adds 1 per admission; > 0 at an
    admission means a resumed preemption in the prefix-cache statistics).
    """

    num_computed_tokens: int
    num_admissions: int

    @property
    def request_id(self) -> str: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def all_token_ids(self) -> Sequence[int] | np.ndarray: ...

    @property
    def block_hashes(self) -> Sequence[bytes]: ...

    @property
    def hash_block_size(self) -> int | None: ...

    def set_hash_block_size(self, hash_block_size: int) -> None: ...

    @property
    def lora_id(self) -> int | None: ...

    @property
    def lora_name(self) -> str | None: ...

    @property
    def retain(self) -> Retention: ...
